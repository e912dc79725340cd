"""What a wheel of ember (`pip install .`, not only an editable install) ships: every file the
package reads at run time beside its modules must be in pyproject's package data."""

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package_of(path: Path) -> Path:
    folder = path.parent
    while not (folder / "__init__.py").is_file():
        folder = folder.parent
    return folder


def test_the_package_data_covers_every_file_read_at_run_time():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = [path for path in (ROOT / "ember").rglob("*")
             if path.is_file() and path.suffix not in (".py", ".pyc", ".md") and "__pycache__" not in path.parts]
    assert any(path.suffix == ".cpp" for path in files)  # the CPU kernels' sources are among them
    for path in files:
        package = _package_of(path)
        name = ".".join(package.relative_to(ROOT).parts)
        relative = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns.get(name, [])), \
            f"{path.relative_to(ROOT)} is not in [tool.setuptools.package-data] {name!r}"
