"""Headless Chromium for the chat page's tests: Debian's `chromium` package driven by Playwright
(which cannot download its own browsers here). Tests skip, saying why, when Chromium is missing
(`.ci/run` installs it)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

CHROMIUM_PATHS = ("chromium", "chromium-browser", "/usr/bin/chromium", "/usr/lib/chromium/chromium")
WAIT_MS = 180_000  # a reply on a busy 2-core machine; only a bound for a hang, never a timing check


def chromium_path() -> str | None:
    for name in CHROMIUM_PATHS:
        found = shutil.which(name) or (name if os.path.isfile(name) else None)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def browser():
    """Module-scoped: Playwright's sync API keeps an event loop running in this thread while it is
    open, and the suite's later asyncio.run() calls need it gone."""
    from playwright import sync_api  # a test dependency (the test extra), never skipped

    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium: apt-get install chromium")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: Chromium's sandbox cannot start as root, which CI runs as.
        launched = playwright.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        yield launched
        launched.close()


class PageErrors:
    """Script errors and console errors (a Content-Security-Policy refusal is one) seen by a page."""

    def __init__(self, page) -> None:
        self.seen: list[str] = []
        page.on("pageerror", lambda error: self.seen.append(f"pageerror: {error}"))
        page.on("console", lambda message: message.type == "error" and self.seen.append(f"console: {message.text}"))

    @property
    def unexpected(self) -> list[str]:
        """All but the browser's own note on a refused fetch (a 401 or 429 the page answers itself)."""
        return [e for e in self.seen if "Failed to load resource" not in e]


def watched_page(browser, **context):
    """A page in a new browser context (desktop-sized unless `context` says otherwise), its errors
    watched and every wait bounded by WAIT_MS; end it with close_page."""
    page = browser.new_context(**{"viewport": {"width": 1280, "height": 800}, **context}).new_page()
    page.errors = PageErrors(page)
    page.set_default_timeout(WAIT_MS)
    return page


def close_page(page) -> None:
    """Close a watched page's context, once it has seen no unexpected error."""
    assert page.errors.unexpected == []
    page.context.close()


def wait_until(page, script: str, arg=None, timeout_ms: int = WAIT_MS):
    """Poll `script` (a function of `arg`) in the page until it returns something true, and return
    it. Playwright's own wait_for_function evaluates strings in the page, which the page's
    Content-Security-Policy forbids; evaluate goes through the browser's debugger protocol."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        value = page.evaluate(script, arg)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never true in the page: {script}")
        page.wait_for_timeout(100)


# The server's /debug/requests log, for pages' requests: `http` is a client of the page's server.

def newest_logged(http) -> dict | None:
    logged = http.get("/debug/requests").json()["data"]
    return logged[-1] if logged else None


def request_after(http, earlier: dict | None) -> dict:
    """The newest logged request once it is not `earlier`: a request is logged when its response
    has ended, a moment after the page has shown its last token (the deadline only ends a hung
    test)."""
    deadline = time.monotonic() + 30
    while (newest := newest_logged(http)) is None or (earlier is not None
                                                      and newest["request_id"] == earlier["request_id"]):
        assert time.monotonic() < deadline, "the request was never logged"
        time.sleep(0.05)
    return newest
