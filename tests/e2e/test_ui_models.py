"""The chat page on a server with several models (the shared `pool_server`): the header's selector
lists each model once with its state, a pick routes the page's requests and survives a reload, a
model that is not loaded loads for its first request, and a model that fails to load gets an error
naming it. Other modules share the server: no test counts on which models are loaded when it starts."""

from __future__ import annotations

import re

import httpx
import pytest

from browser import browser, close_page, wait_until, watched_page  # noqa: F401 (browser is a fixture)
from conftest import POOL_MODELS

STATE = r"\((not loaded|loading|ready|unloading|failed)\)"
LISTED = "() => document.querySelector('#model-select').options.length > 0"
OPTION_TEXT = "(id) => [...document.querySelector('#model-select').options].find((o) => o.value === id)?.textContent"


@pytest.fixture
def http(pool_server):
    with httpx.Client(base_url=pool_server.url, timeout=120) as session:
        yield session


@pytest.fixture
def page(browser, pool_server):  # noqa: F811
    page = watched_page(browser)
    open_page(page, pool_server.url)
    yield page
    close_page(page)


def open_page(page, url: str) -> None:
    page.goto(url + "/")
    wait_until(page, LISTED)


def option_text(page, model: str) -> str:
    return page.evaluate(OPTION_TEXT, model)


def wait_option(page, model: str, state: str) -> None:
    wait_until(page, f"(id) => ({OPTION_TEXT})(id) === `${{id}} ({state})`", model)


def send(page, text: str) -> None:
    page.click("#toggle-settings")
    page.fill("#set-temperature", "0")
    page.fill("#set-max-tokens", "4")
    page.click("#toggle-settings")
    page.fill("#input", text)
    page.press("#input", "Enter")


def test_the_selector_lists_each_model_once_by_its_id_with_its_state(page):
    assert page.is_visible("#model-select") and not page.is_visible("#model-name")
    options = page.locator("#model-select option")
    assert options.evaluate_all("(all) => all.map((o) => o.value)") == list(POOL_MODELS)  # no alias (default, small)
    for model, text in zip(POOL_MODELS, options.all_inner_texts()):
        assert re.fullmatch(rf"{re.escape(model)} {STATE}", text), text
    assert page.input_value("#model-select") == "smol"  # nothing picked yet: the server's default


def test_a_picked_model_answers_then_shows_its_card_and_stays_picked_after_a_reload(page, http, pool_server):
    page.select_option("#model-select", "tiny")
    send(page, "Hi.")
    page.wait_for_selector("article.message.assistant[data-state='done']")
    assert page.locator("article.message.assistant .who").inner_text() == "tiny"
    assert http.get("/debug/requests").json()["data"][-1]["model"] == "tiny"
    wait_option(page, "tiny", "ready")  # the list was asked again after the reply
    assert page.locator("#model-context").inner_text() == "context 256 tokens"  # tiny's card, once loaded

    page.reload()
    open_page(page, pool_server.url)
    assert page.input_value("#model-select") == "tiny"
    assert page.locator("article.message.assistant .who").inner_text() == "tiny"


def test_a_model_that_fails_to_load_gets_an_error_naming_it_and_the_message_is_kept(page):
    page.evaluate("""() => {
        window.__progress = [];
        const text = document.querySelector('#progress-text');
        new MutationObserver(() => window.__progress.push(text.textContent))
            .observe(text, {childList: true, characterData: true, subtree: true});
    }""")
    page.select_option("#model-select", "broken")
    send(page, "Hello there.")
    page.wait_for_selector("#notice.error")
    assert "broken" in page.locator("#notice").inner_text()
    assert page.input_value("#input") == "Hello there."  # refused before the reply began: kept to send again
    assert page.locator("article.message").count() == 0
    assert "Loading broken\u2026" in page.evaluate("window.__progress")  # it was not ready: the page said it loads
    wait_option(page, "broken", "failed")


def test_the_states_are_asked_again_when_the_page_gets_focus(page, http):
    reply = http.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 1,
                                                    "messages": [{"role": "user", "content": "Hi."}]})
    assert reply.status_code == 200
    with page.expect_request(lambda request: request.url.endswith("/v1/models")):
        page.evaluate("() => window.dispatchEvent(new Event('focus'))")
    wait_option(page, "tiny-llama", "ready")
