"""The chat page (`ember serve --ui`) in headless Chromium against a real server on the default model:
streaming, figures, stop, storage, safe rendering, busy and down servers, the API key, phones, dark."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from browser import browser  # noqa: F401 (a fixture)
from browser import close_page, newest_logged, request_after, wait_until, watched_page
from conftest import ServerProcess, wait_idle

MODEL = "SmolLM2-135M-Instruct"
KEY = "ui-secret-key-5678"
PAYLOAD = '<script>window.__owned = 1</script><img src=x onerror="window.__owned = 2"> **bold**'
MODEL_SHOWN = "(name) => document.querySelector('#model-name').textContent === name"
FIGURES = re.compile(r"prompt (\d+) tokens \((\d+) cached\) · first token \d+ ms · (\d+) tokens · [\d.]+ tok/s")


@pytest.fixture(scope="module")
def ui_server(one_slot_server):
    return one_slot_server  # one slot and no queue, so a second request is a 429 at once (the busy test)


@pytest.fixture(scope="module")
def keyed_server():
    process = ServerProcess("--ui", "--api-key", KEY, "--max-model-len", "512", "--max-num-seqs", "2").start()
    yield process
    process.stop()


@pytest.fixture
def http(ui_server):
    with httpx.Client(base_url=ui_server.url, timeout=120) as session:
        yield session


@pytest.fixture
def page(browser, ui_server):  # noqa: F811
    page = watched_page(browser, accept_downloads=True)
    open_page(page, ui_server.url)
    yield page
    close_page(page)


def open_page(page, url: str) -> None:
    page.goto(url + "/")
    wait_until(page, MODEL_SHOWN, MODEL)


def settings(page, **fields) -> None:
    """Fill settings fields by id suffix (temperature, max-tokens, extra, ...), then close the panel."""
    page.click("#toggle-settings")
    for name, value in fields.items():
        page.fill(f"#set-{name.replace('_', '-')}", str(value))
    page.click("#toggle-settings")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def last_reply(page):
    return page.locator("article.message.assistant").last


def wait_state(page, state: str) -> None:
    page.wait_for_selector(f"article.message.assistant:last-of-type[data-state='{state}']")


# ---- the route ---------------------------------------------------------------------------------

def test_the_page_and_its_files_are_served_with_a_strict_policy(http):
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    script = http.get("/ui/js/main.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert http.get("/ui/js/main.js", headers={"If-None-Match": script.headers["etag"]}).status_code == 304
    assert http.get("/ui/js/missing.js").status_code == 404
    assert http.get("/ui/../app.py").status_code == 404
    assert http.get("/health").json()["status"] == "ok"  # health keeps its own path


# ---- chatting ----------------------------------------------------------------------------------

def test_a_reply_streams_in_with_its_figures(page, http):
    before = newest_logged(http)
    assert page.locator("#model-context").text_content() == "context 1024 tokens"
    settings(page, temperature=0, max_tokens=40)
    page.evaluate("""() => {
        window.__lengths = new Set();
        new MutationObserver(() => {
            const reply = [...document.querySelectorAll('article.assistant .content')].pop();
            if (reply && reply.textContent) window.__lengths.add(reply.textContent.length);
        }).observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true});
    }""")
    page.fill("#input", "Name a colour.")
    page.press("#input", "Shift+Enter")
    page.keyboard.type("Then name a fruit.")
    assert page.input_value("#input") == "Name a colour.\nThen name a fruit."  # Shift+Enter did not send
    page.press("#input", "Enter")
    assert page.input_value("#input") == ""
    user = page.locator("article.message.user").last
    assert user.locator(".content").inner_text() == "Name a colour.\nThen name a fruit."
    wait_state(page, "done")
    reply = last_reply(page)
    assert reply.locator(".content").inner_text().strip()
    assert page.evaluate("window.__lengths.size") >= 2  # the text arrived in pieces, not at once
    figures = FIGURES.fullmatch(reply.locator(".figures").inner_text())
    assert figures, reply.locator(".figures").inner_text()
    logged = request_after(http, before)
    assert logged["outcome"] == "done" and logged["stream"] is True
    assert int(figures.group(1)) == logged["prompt_tokens"] and int(figures.group(2)) == logged["cached_tokens"]
    assert int(figures.group(3)) == logged["completion_tokens"] <= 40
    assert page.locator("#conversations li.current .title").inner_text() == "Name a colour."


def test_stop_ends_the_stream_and_the_server_frees_the_request(page, http):
    before = newest_logged(http)
    settings(page, temperature=0, max_tokens=900, extra='{"ignore_eos": true}')
    send(page, "Tell me a long story about a lighthouse.")
    wait_until(page, "() => [...document.querySelectorAll('article.assistant .content')].pop()?.textContent.length > 40")
    assert page.is_visible("#stop") and not page.is_visible("#send")
    page.keyboard.press("Escape")
    wait_state(page, "stopped")
    assert last_reply(page).locator(".note").inner_text() == "Stopped."
    assert page.is_visible("#send") and not page.is_visible("#stop")
    health = wait_idle(http)  # no request running, no KV block held
    assert health["requests_running"] == 0 and health["engine"]["kv_blocks_used"] == 0
    logged = request_after(http, before)
    assert logged["outcome"] == "error" and logged["code"] == "client_gone"
    assert 0 < logged["completion_tokens"] < 900


def test_conversations_survive_a_reload_and_can_be_renamed_exported_and_deleted(page, ui_server, tmp_path):
    settings(page, temperature=0, max_tokens=8)
    send(page, "Say hello.")
    wait_state(page, "done")
    answer = last_reply(page).locator(".content").inner_text()
    page.click("#new-chat")
    send(page, "Say goodbye.")
    wait_state(page, "done")
    page.reload()
    open_page(page, ui_server.url)
    titles = page.locator("#conversations .title")
    assert titles.all_inner_texts() == ["Say goodbye.", "Say hello."]
    titles.nth(1).click()
    assert page.locator("article.message.user .content").inner_text() == "Say hello."
    assert last_reply(page).locator(".content").inner_text() == answer

    item = page.locator("#conversations li", has_text="Say hello.")
    item.locator("button[title='Rename']").click()
    page.fill("#conversations input.rename", "Greetings")
    page.press("#conversations input.rename", "Enter")
    page.reload()
    open_page(page, ui_server.url)
    assert page.locator("#conversations .title").all_inner_texts() == ["Say goodbye.", "Greetings"]

    with page.expect_download() as download:
        page.locator("#conversations li", has_text="Greetings").locator("button[title='Export as JSON']").click()
    path = tmp_path / "export.json"
    download.value.save_as(path)
    exported = json.loads(path.read_text())
    assert exported["exported_by"] == "ember"
    [conversation] = exported["conversations"]
    assert conversation["title"] == "Greetings"
    assert [(m["role"], m["content"]) for m in conversation["messages"]] == [("user", "Say hello."),
                                                                             ("assistant", answer)]
    with page.expect_download() as download:
        page.click("#export-all")
    download.value.save_as(path)
    assert [c["title"] for c in json.loads(path.read_text())["conversations"]] == ["Say goodbye.", "Greetings"]

    page.locator("#conversations li", has_text="Greetings").locator("button[title='Delete']").click()
    page.locator("#conversations li button.danger").click()
    page.reload()
    open_page(page, ui_server.url)
    assert page.locator("#conversations .title").all_inner_texts() == ["Say goodbye."]


def test_edit_and_regenerate(page, http):
    logged = newest_logged(http)
    settings(page, temperature=0, max_tokens=6)
    send(page, "Count to three.")
    wait_state(page, "done")
    logged = request_after(http, logged)
    first = last_reply(page).locator(".content").inner_text()
    last_reply(page).locator("button", has_text="Regenerate").click()
    wait_state(page, "done")
    logged = request_after(http, logged)
    assert page.locator("article.message").count() == 2
    assert last_reply(page).locator(".content").inner_text() == first  # greedy: the same reply again
    user = page.locator("article.message.user")
    user.locator("button", has_text="Edit").click()
    user.locator("textarea.edit").fill("Count to five.")
    user.locator("button", has_text="Save and send").click()
    wait_state(page, "done")
    assert page.locator("article.message").count() == 2
    assert user.locator(".content").inner_text() == "Count to five."
    assert request_after(http, logged)["outcome"] == "done"


# ---- rendering ---------------------------------------------------------------------------------

def test_markup_in_a_model_reply_is_shown_as_text(page):
    # guided_choice makes the real model write exactly PAYLOAD, through the same stream and renderer.
    settings(page, temperature=0, max_tokens=200, extra=json.dumps({"guided_choice": [PAYLOAD]}))
    send(page, "Show me some HTML.")
    wait_state(page, "done")
    content = last_reply(page).locator(".content")
    assert content.locator("script, img").count() == 0
    text = content.inner_text()
    assert '<script>window.__owned = 1</script><img src=x onerror="window.__owned = 2">' in text
    assert content.locator("strong").inner_text() == "bold"  # markdown still applies around it
    assert page.evaluate("window.__owned") is None
    assert page.locator("#messages script, #messages img").count() == 0


def test_a_stored_conversation_renders_reasoning_tool_calls_code_and_only_safe_links(page, ui_server):
    stored = [{"id": "c1", "title": "Stored", "created": 1, "updated": 2, "messages": [
        {"id": "m1", "role": "user", "content": "Check the weather <b>now</b>"},
        {"id": "m2", "role": "assistant", "state": "done", "reasoning": "The user wants <i>weather</i>.",
         "content": "Here:\n\n```html\n<img src=x onerror=alert(1)>\n```\n\n[click](javascript:alert(1)) and "
                    "[docs](https://example.com/a)",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"<Paris>\"}"}}]}]}]
    page.evaluate("(c) => { localStorage.setItem('ember.conversations.v1', JSON.stringify(c));"
                  " localStorage.setItem('ember.current.v1', JSON.stringify('c1')); }", stored)
    page.reload()
    open_page(page, ui_server.url)
    assert page.locator("article.user .content").inner_text() == "Check the weather <b>now</b>"
    reply = last_reply(page)
    reasoning = reply.locator("details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    assert reasoning.locator("summary").inner_text() == "Reasoning (30 characters)"
    assert reasoning.locator(".reasoning-body").text_content() == "The user wants <i>weather</i>."
    card = reply.locator(".tool-call")
    assert card.locator(".tool-name").inner_text() == "get_weather"
    assert json.loads(card.locator("pre").inner_text()) == {"city": "<Paris>"}
    assert reply.locator(".code-block pre code").text_content() == "<img src=x onerror=alert(1)>"
    assert reply.locator(".code-block .code-head span").inner_text() == "html"
    assert reply.locator("a").count() == 1
    assert reply.locator("a").get_attribute("href") == "https://example.com/a"
    assert "[click](javascript:alert(1))" in reply.locator(".content").inner_text()
    assert page.locator("#messages img, #messages b, #messages i").count() == 0


# ---- refusals and the layout -------------------------------------------------------------------

def test_a_busy_server_gets_a_clear_message_and_the_draft_is_kept(page, http, ui_server):
    settings(page, temperature=0, max_tokens=8)
    hold = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=ui_server.url, timeout=120) as holder:
        with holder.stream("POST", "/v1/chat/completions", json=hold) as stream:
            lines = stream.iter_lines()  # kept: a dropped line iterator closes the stream
            next(line for line in lines if line.startswith("data: "))  # it holds the only slot
            send(page, "Are you there?")
            page.wait_for_selector("#notice.error")
            assert "The server is busy" in page.inner_text("#notice")
            assert page.input_value("#input") == "Are you there?"
            assert page.locator("article.message").count() == 0
    wait_idle(http)
    page.press("#input", "Enter")  # the kept draft goes once the slot is free
    wait_state(page, "done")
    assert page.locator("article.message.user .content").inner_text() == "Are you there?"


def test_a_phone_gets_one_column_and_a_dark_system_gets_dark_colours(browser, ui_server):  # noqa: F811
    def background(context):
        """The page and its body's colour as (r, g, b)."""
        page = context.new_page()
        open_page(page, ui_server.url)
        color = page.evaluate("getComputedStyle(document.body).backgroundColor")
        return page, tuple(int(v) for v in re.findall(r"\d+", color)[:3])

    phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
                                color_scheme="dark")
    page, dark = background(phone)
    assert sum(dark) < 150
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
    assert page.is_visible("#toggle-sidebar") and page.locator("#composer").bounding_box()["width"] <= 390
    assert page.locator("#sidebar").bounding_box()["x"] < 0  # slid away
    page.click("#toggle-sidebar")
    wait_until(page, "() => document.querySelector('#sidebar').getBoundingClientRect().x >= 0")
    phone.close()
    light = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
    _, bright = background(light)
    assert sum(bright) > 600
    light.close()


# ---- the API key -------------------------------------------------------------------------------

def test_the_key_is_asked_once_and_kept_for_the_tab_only(browser, keyed_server):  # noqa: F811
    context = browser.new_context()
    page = context.new_page()
    page.goto(keyed_server.url + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "wrong-key")
    page.click("#key-submit")
    page.wait_for_selector("#key-error:not([hidden])")
    assert page.inner_text("#key-error") == "That key was refused."
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    wait_until(page, MODEL_SHOWN, MODEL)
    assert not page.is_visible("#key-dialog")
    settings(page, max_tokens=4)
    send(page, "Hi")
    wait_state(page, "done")
    page.reload()
    wait_until(page, MODEL_SHOWN, MODEL)
    assert not page.is_visible("#key-dialog")  # asked once per tab
    assert page.evaluate("JSON.stringify(localStorage)").find(KEY) < 0  # never kept beyond the tab
    assert page.evaluate("sessionStorage.getItem('ember.apiKey')") == KEY
    other = browser.new_context().new_page()
    other.goto(keyed_server.url + "/")
    other.wait_for_selector("#key-dialog[open]")
    other.context.close()
    context.close()


def test_a_server_that_is_down_gets_a_clear_message_and_the_draft_is_kept(browser, keyed_server):  # noqa: F811
    """Runs last in this module: it stops the keyed server."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(keyed_server.url + "/")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    wait_until(page, MODEL_SHOWN, MODEL)
    keyed_server.stop()
    send(page, "Still there?")
    page.wait_for_selector("#notice.error")
    assert "cannot be reached" in page.inner_text("#notice")
    assert page.input_value("#input") == "Still there?"
    assert page.locator("article.message").count() == 0
    context.close()
