"""The chat page's files as shipped: nothing fetched from elsewhere, every reference resolves, the
package data covers them, and no script turns text into HTML."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from ember.server.ui_routes import UI_DIR, load_assets

ROOT = Path(__file__).resolve().parents[2]
# Ways a string can become live markup or code in a page.
HTML_SINKS = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
              "createContextualFragment", "DOMParser", "srcdoc")


def test_the_page_references_only_its_own_files():
    assets = load_assets()
    assert {"index.html", "style.css", "js/main.js"} <= set(assets)
    page = assets["index.html"].body.decode()
    references = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert references
    for reference in references:
        assert reference == "data:," or reference.removeprefix("/ui/") in assets, reference
    for name, asset in assets.items():
        text = asset.body.decode()
        assert "://" not in text, f"{name} names another site"
        if name.endswith(".js"):
            for imported in re.findall(r'from "\./([^"]+)"', text):
                assert f"js/{imported}" in assets, f"{name} imports a missing {imported}"


def test_no_script_turns_text_into_html():
    for path in sorted(UI_DIR.rglob("*.js")):
        text = path.read_text()
        for sink in HTML_SINKS:
            assert sink not in text, f"{path.name} uses {sink}"
        assert not re.search(r"setAttribute\(\s*[\"']on", text), f"{path.name} sets an event attribute"


def test_the_package_data_ships_every_file():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["ember.server"]
    for name in load_assets():
        assert any(fnmatch.fnmatch(f"ui/{name}", pattern) for pattern in patterns), name
