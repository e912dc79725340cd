"""Images by http(s) URL under a real `ember serve --image-urls` of a tiny random SmolVLM folder (the
shared vision_server): the server fetches them from a local HTTP server, within its size limit and
timeout; a fetched image answers as the same image sent inline does; every failure is a clear error
naming the part, and nothing leaks."""

from __future__ import annotations

import http.server
import threading
import time

import anthropic
import httpx
import openai
import pytest

from conftest import wait_idle
from test_vision_http import QUESTION
from vision_fixtures import data_url, picture

IMAGE = picture(120, 80, seed=7)
HUGE = picture(400, 400, seed=8)  # about 480 KB of noise: past --max-image-mb 0.1
SLOW_S = 4.0  # past --image-fetch-timeout 1


class Pictures(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        if self.path == "/slow.png":
            time.sleep(SLOW_S)
        body = {"/picture.png": IMAGE, "/huge.png": HUGE, "/slow.png": IMAGE}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server gave up on this one

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def pictures():
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pictures)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()


@pytest.fixture(scope="module")
def client(vision_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vision_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http_client(vision_server):
    with httpx.Client(base_url=vision_server.url, timeout=120) as session:
        yield session


def ask(client, url: str):
    return client.chat.completions.create(
        model="tiny-smolvlm", max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": QUESTION}]}])


def test_a_fetched_image_answers_as_the_same_image_inline(client, vision_server, pictures):
    fetched, inline = ask(client, pictures + "/picture.png"), ask(client, data_url(IMAGE))
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens > 20

    message = anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0).messages.create(
        model="tiny-smolvlm", max_tokens=6, extra_body={"ignore_eos": True, "temperature": 0},
        messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                            "url": pictures + "/picture.png"}},
                                               {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == inline.choices[0].message.content


@pytest.mark.parametrize("path, status, code", [
    ("/missing.png", 400, "invalid_media"),  # the site answers 404
    ("/huge.png", 400, "invalid_media"),  # read no further than --max-image-mb
    ("/slow.png", 504, "media_fetch_timeout"),  # --image-fetch-timeout 1
])
def test_a_failed_fetch_is_a_clear_error_naming_the_part(http_client, pictures, path, status, code):
    reply = http_client.post("/v1/chat/completions", json={"model": "tiny-smolvlm", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                     {"type": "image_url", "image_url": {"url": pictures + path}}]}]})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["param"] == "messages[0].content[1].image_url.url", error
    assert wait_idle(http_client)["engine"]["kv_blocks_used"] == 0


def test_an_unreachable_site_is_a_bad_gateway(http_client):
    reply = http_client.post("/v1/chat/completions", json={"model": "tiny-smolvlm", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]}]})
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "media_fetch_failed", reply.text
