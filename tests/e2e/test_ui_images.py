"""Images on the chat page (`ember serve --ui`) in headless Chromium: against a real server of a tiny
random SmolVLM folder, an image attached with the button, by pasting or by dropping it is shown,
sent as an image_url part, kept across a reload and exported; what the server would refuse is
refused on the page, and the server's own refusals are shown. A text model offers no button, and
neither it nor a vision model under --no-vision claims vision in its model card."""

from __future__ import annotations

import base64
import io
import json
import re

import httpx
import pytest

from browser import browser  # noqa: F401 (a fixture)
from browser import close_page, newest_logged, request_after, wait_until, watched_page
from conftest import VISION_MAX_IMAGE_MB as MAX_IMAGE_MB
from conftest import VISION_MODEL as MODEL
from conftest import ServerProcess
from vision_fixtures import data_url, image_bytes

RED = image_bytes(40, 30, (220, 30, 30))
BLUE = image_bytes(30, 40, (30, 30, 220))
SHOWN = "(name) => document.querySelector('#model-name').textContent === name"
FIGURES = re.compile(r"prompt (\d+) tokens \((\d+) cached\) · first token \d+ ms · (\d+) tokens · [\d.]+ tok/s")


def noise_png(side: int) -> bytes:
    """A PNG that does not compress: about 3 bytes a pixel."""
    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture
def http(vision_server):
    with httpx.Client(base_url=vision_server.url, timeout=120) as session:
        yield session


def new_page(browser, url: str, model: str = MODEL, **context):  # noqa: F811
    page = watched_page(browser, **context)
    open_page(page, url, model)
    return page


def open_page(page, url: str, model: str = MODEL) -> None:
    page.goto(url + "/")
    wait_until(page, SHOWN, model)


@pytest.fixture
def page(browser, vision_server):  # noqa: F811
    page = new_page(browser, vision_server.url, accept_downloads=True)
    yield page
    close_page(page)


def settings(page, **fields) -> None:
    page.click("#toggle-settings")
    for name, value in fields.items():
        page.fill(f"#set-{name.replace('_', '-')}", str(value))
    page.click("#toggle-settings")


def attach(page, *files: tuple[str, str, bytes]) -> None:
    """Pick files (name, type, bytes) with the attach button's file picker."""
    with page.expect_file_chooser() as chooser:
        page.click("#attach")
    chooser.value.set_files([{"name": name, "mimeType": kind, "buffer": data} for name, kind, data in files])


def tray(page) -> list[str]:
    """The thumbnails waiting in the composer, by their images' data URLs."""
    return page.eval_on_selector_all("#attachments img", "(images) => images.map((i) => i.src)")


def wait_for_tray(page, *images: bytes) -> None:
    """Until the tray holds exactly these images: a picked file reaches it after the page has read
    it, which can be after the file chooser returns."""
    wait_until(page, "(want) => JSON.stringify([...document.querySelectorAll('#attachments img')].map((i) => i.src))"
                     " === JSON.stringify(want)", [data_url(image) for image in images])


def notice(page) -> str:
    page.wait_for_selector("#notice.error")
    return page.inner_text("#notice")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_state(page, state: str) -> None:
    page.wait_for_selector(f"article.message.assistant:last-of-type[data-state='{state}']")


def shown_images(page) -> list[str]:
    return page.eval_on_selector_all("article.message.user .images img", "(images) => images.map((i) => i.src)")


def pixels(url: str) -> tuple:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as image:
        return image.size, image.convert("RGB").tobytes()


def put_on_clipboard(page, data: bytes) -> None:
    page.evaluate("""async (b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        await navigator.clipboard.write([new ClipboardItem({"image/png": new Blob([bytes], {type: "image/png"})})]);
    }""", base64.b64encode(data).decode())


# ---- the model card ----------------------------------------------------------------------------

def test_the_model_card_says_whether_the_model_reads_images_and_its_limits(http, one_slot_server, smolvlm):
    card = http.get("/v1/models").json()["data"][0]
    assert card["capabilities"]["vision"] is True
    assert card["max_images"] == 2 and card["max_image_bytes"] == int(MAX_IMAGE_MB * 2**20)
    text = httpx.get(one_slot_server.url + "/v1/models", timeout=60).json()["data"][0]
    assert "vision" not in text["capabilities"] and "max_images" not in text
    no_vision = ServerProcess(str(smolvlm), "--no-vision", "--max-model-len", "1024").start()
    try:
        card = httpx.get(no_vision.url + "/v1/models", timeout=60).json()["data"][0]
    finally:
        no_vision.stop()
    assert card["id"] == MODEL and "vision" not in card["capabilities"] and "max_images" not in card


# ---- attaching and sending ---------------------------------------------------------------------

def test_an_attached_image_is_sent_shown_kept_across_a_reload_and_exported(page, http, vision_server, tmp_path):
    before = newest_logged(http)
    assert page.is_visible("#attach")
    attach(page, ("red.png", "image/png", RED), ("blue.png", "image/png", BLUE))
    assert tray(page) == [data_url(RED), data_url(BLUE)]
    page.click("#attachments button[aria-label='Remove blue.png']")
    assert tray(page) == [data_url(RED)]

    settings(page, temperature=0, max_tokens=8, extra='{"ignore_eos": true}')
    send(page, "What is in this picture?")
    assert tray(page) == [] and not page.is_visible("#attachments")
    user = page.locator("article.message.user").last
    assert shown_images(page) == [data_url(RED)]
    image_box, text_box = user.locator(".images img").bounding_box(), user.locator(".content").bounding_box()
    assert image_box["y"] + image_box["height"] <= text_box["y"]  # the image above the text
    wait_state(page, "done")
    reply = page.locator("article.message.assistant").last
    figures = FIGURES.fullmatch(reply.locator(".figures").inner_text())
    assert figures, reply.locator(".figures").inner_text()
    logged = request_after(http, before)
    assert logged["outcome"] == "done" and logged["stream"] is True and logged["completion_tokens"] == 8
    image_prompt = logged["prompt_tokens"]
    assert image_prompt > 20 and int(figures.group(1)) == image_prompt  # the image's tokens were read

    # Local storage keeps the text and the image's id; the image itself is in IndexedDB.
    stored = page.evaluate("localStorage.getItem('ember.conversations.v1')")
    assert "What is in this picture?" in stored and "base64" not in stored
    page.reload()
    open_page(page, vision_server.url)
    page.wait_for_selector("article.message.user .images img")
    assert shown_images(page) == [data_url(RED)]
    assert page.locator("#conversations li.current .title").inner_text() == "What is in this picture?"

    send(page, "And now?")  # the conversation's image goes again, read back from storage
    wait_state(page, "done")
    assert request_after(http, logged)["prompt_tokens"] > image_prompt + 8

    with page.expect_download() as download:
        page.locator("#conversations li.current button[title='Export as JSON']").click()
    path = tmp_path / "export.json"
    download.value.save_as(path)
    [conversation] = json.loads(path.read_text())["conversations"]
    [image] = conversation["messages"][0]["images"]
    assert image["name"] == "red.png" and image["url"] == data_url(RED)


def test_an_image_can_be_pasted_or_dropped_and_sent_without_text(page, http, vision_server):
    before = newest_logged(http)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=vision_server.url)
    put_on_clipboard(page, BLUE)
    page.focus("#input")
    page.keyboard.press("Control+V")
    wait_until(page, "() => document.querySelectorAll('#attachments img').length === 1")
    [pasted] = tray(page)
    assert pixels(pasted) == pixels(data_url(BLUE))  # the browser's clipboard writes the PNG anew
    page.click("#attachments .remove")

    dropped = page.evaluate_handle("""(b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], "dropped.png", {type: "image/png"}));
        return transfer;
    }""", base64.b64encode(RED).decode())
    page.dispatch_event("#composer", "dragover", {"dataTransfer": dropped})
    assert "dropping" in page.get_attribute("#composer", "class")
    page.dispatch_event("#composer", "drop", {"dataTransfer": dropped})
    wait_until(page, "() => document.querySelectorAll('#attachments img').length === 1")
    assert tray(page) == [data_url(RED)] and "dropping" not in (page.get_attribute("#composer", "class") or "")

    settings(page, temperature=0, max_tokens=4)
    page.click("#send")  # an image alone is a message
    wait_state(page, "done")
    assert shown_images(page) == [data_url(RED)]
    assert not page.locator("article.message.user .content").is_visible()
    assert page.locator("#conversations li.current .title").inner_text() == "Image"
    assert request_after(http, before)["prompt_tokens"] > 20


def test_an_image_the_browsers_storage_refuses_is_sent_then_shown_as_not_kept_and_the_text_stays(
        page, http, vision_server):
    before = newest_logged(http)
    session = page.context.new_cdp_session(page)  # a full disk: this site may keep 4 KiB
    session.send("Storage.overrideQuotaForOrigin", {"origin": vision_server.url, "quotaSize": 4096})
    settings(page, temperature=0, max_tokens=2)
    attach(page, ("photo.png", "image/png", noise_png(80)))
    send(page, "Keep this?")
    wait_until(page, "() => document.querySelector('#notice').textContent.includes('did not take the image')")
    wait_state(page, "done")
    first = request_after(http, before)
    assert first["prompt_tokens"] > 20  # sent from memory all the same
    page.reload()
    open_page(page, vision_server.url)
    page.wait_for_selector("article.message.user .image-missing")
    assert page.inner_text("article.message.user .image-missing").startswith("Image not kept")
    assert page.inner_text("article.message.user .content") == "Keep this?"
    send(page, "Again?")
    wait_state(page, "done")
    assert request_after(http, first)["prompt_tokens"] < first["prompt_tokens"]  # the text goes on without the image


# ---- refusals ----------------------------------------------------------------------------------

def test_what_the_server_would_refuse_is_refused_on_the_page(page):
    attach(page, ("notes.txt", "text/plain", b"not a picture"))
    assert "\u201cnotes.txt\u201d is not an image ember reads (PNG, JPEG, WebP, GIF)." in notice(page)
    big = noise_png(200)
    assert len(big) > MAX_IMAGE_MB * 2**20
    attach(page, ("big.png", "image/png", big))
    assert f"\u201cbig.png\u201d is {len(big) / 2**20:.1f} MiB; the server takes images up to 0.1 MiB." in notice(page)
    assert tray(page) == []

    attach(page, ("a.png", "image/png", RED), ("b.png", "image/png", BLUE), ("c.png", "image/png", RED))
    assert "at most 2 images per request" in notice(page) and "only the first 2 of these 3 fit" in notice(page)
    assert tray(page) == [data_url(RED), data_url(BLUE)]
    page.click("#attachments button[aria-label='Remove b.png']")
    settings(page, temperature=0, max_tokens=2)
    send(page, "One.")
    wait_state(page, "done")
    attach(page, ("b.png", "image/png", BLUE), ("c.png", "image/png", RED))  # the conversation holds one
    assert "only the first 1 of these 2 fit" in notice(page) and tray(page) == [data_url(BLUE)]


def test_the_servers_refusals_are_shown_and_the_message_and_images_kept(page):
    wide = image_bytes(500, 500)  # a small file, but 0.7 MiB decoded: past --media-budget-mb 0.5
    attach(page, ("wide.png", "image/png", wide))
    wait_for_tray(page, wide)
    send(page, "Look.")
    message = notice(page)
    assert "the media budget is 0.5 MiB" in message and "(field: messages[0].content[0].image_url.url)" in message
    assert page.input_value("#input") == "Look." and tray(page) == [data_url(wide)]
    assert page.locator("article.message").count() == 0

    page.click("#attachments .remove")
    attach(page, ("broken.png", "image/png", b"\x89PNG\r\n\x1a\n not really"))
    wait_for_tray(page, b"\x89PNG\r\n\x1a\n not really")  # sent without it, the reply would be no refusal
    page.press("#input", "Enter")
    wait_until(page, "() => document.querySelector('#notice').textContent.includes('not a readable image')")
    assert tray(page) == [data_url(b"\x89PNG\r\n\x1a\n not really")]
    assert page.input_value("#input") == "Look." and page.locator("article.message").count() == 0


def test_a_text_model_offers_no_button_and_shows_the_servers_refusal(browser, one_slot_server):  # noqa: F811
    page = new_page(browser, one_slot_server.url, "SmolLM2-135M-Instruct")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=one_slot_server.url)
    assert not page.is_visible("#attach")
    put_on_clipboard(page, RED)
    page.focus("#input")
    page.keyboard.press("Control+V")
    assert "This model reads no images" in notice(page) and tray(page) == []

    # A conversation kept from when a vision model was served at this address.
    page.evaluate("""async (url) => {
        localStorage.setItem('ember.conversations.v1', JSON.stringify([{id: 'c1', title: 'Earlier', created: 1,
            updated: 2, messages: [{id: 'm1', role: 'user', content: 'What is this?',
                                    images: [{id: 'i1', name: 'red.png', type: 'image/png'}]}]}]));
        localStorage.setItem('ember.current.v1', JSON.stringify('c1'));
        const db = await new Promise((resolve) => { const r = indexedDB.open('ember.images', 1);
                                                   r.onsuccess = () => resolve(r.result); });
        await new Promise((resolve) => { const tx = db.transaction('images', 'readwrite');
                                         tx.objectStore('images').put(url, 'i1'); tx.oncomplete = resolve; });
    }""", data_url(RED))
    page.reload()
    open_page(page, one_slot_server.url, "SmolLM2-135M-Instruct")
    page.wait_for_selector("article.message.user .images img")
    send(page, "And this?")
    message = notice(page)
    assert "is an image, and this server reads no images" in message and "Your message is kept." in message
    assert page.input_value("#input") == "And this?"
    assert page.locator("article.message").count() == 1
    close_page(page)


# ---- the layout --------------------------------------------------------------------------------

def test_images_fit_a_phone_in_dark_colours(browser, vision_server):  # noqa: F811
    page = new_page(browser, vision_server.url, viewport={"width": 390, "height": 844}, is_mobile=True,
                    has_touch=True, color_scheme="dark")
    assert page.is_visible("#attach")
    attach(page, ("red.png", "image/png", image_bytes(600, 200)), ("blue.png", "image/png", BLUE))
    assert len(tray(page)) == 2
    settings(page, temperature=0, max_tokens=2)
    send(page, "Both?")
    wait_state(page, "done")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
    for image in page.locator("article.message.user .images img").all():
        box = image.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390
    assert page.locator("#composer").bounding_box()["width"] <= 390
    colour = page.evaluate("getComputedStyle(document.querySelector('#attach')).backgroundColor")
    assert sum(int(v) for v in re.findall(r"\d+", colour)[:3]) < 150  # the button follows the dark scheme
    close_page(page)
