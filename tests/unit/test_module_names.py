"""Every test module has a basename of its own: pytest imports them without packages, and two of
one name stop the whole run at collection."""

from collections import Counter
from pathlib import Path


def test_no_two_test_modules_share_a_basename():
    names = Counter(path.name for path in Path(__file__).parents[1].rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
