"""Screenshots of the chat page for the README, at desktop and phone widths, of a real reply.

    ember serve --ui &                          # then:
    python scripts/ui_screenshots.py            # writes docs/ui-desktop.png and docs/ui-phone.png
    python scripts/ui_screenshots.py --url http://127.0.0.1:8001 --out /tmp

Needs Playwright's Python package and Debian's chromium (the tests' setup, see .ci/run).
The desktop shot is in the light scheme, the phone shot in the dark one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from browser import WAIT_MS, chromium_path, wait_until  # noqa: E402

PROMPTS = ("Write a Python function that reverses a string.", "What is the capital of France?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running `ember serve --ui`")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for the two PNG files")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=["--no-sandbox"])
        desktop = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
        page = desktop.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(args.url + "/")
        wait_until(page, "() => document.querySelector('#model-context').textContent !== ''")
        page.click("#toggle-settings")
        page.fill("#set-temperature", "0")
        page.fill("#set-max-tokens", "120")
        page.click("#toggle-settings")
        for prompt in PROMPTS:
            page.fill("#input", prompt)
            page.press("#input", "Enter")
            page.wait_for_selector("article.message.assistant:last-of-type[data-state='done']")
        page.fill("#input", "Tell me more")
        page.screenshot(path=str(args.out / "ui-desktop.png"))
        state = desktop.storage_state()
        phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
                                    device_scale_factor=2, color_scheme="dark", storage_state=state)
        page = phone.new_page()
        page.goto(args.url + "/")
        wait_until(page, "() => document.querySelector('#model-context').textContent !== ''")
        page.screenshot(path=str(args.out / "ui-phone.png"))
        browser.close()
    print(f"wrote {args.out / 'ui-desktop.png'} and {args.out / 'ui-phone.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
