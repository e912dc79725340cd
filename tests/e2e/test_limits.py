"""A small server with tight limits: API key, CORS, 413, 429 and 503 admission, keep-alive, Ctrl-C."""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from conftest import ServerProcess, wait_idle

KEY = "tight-secret-key-1234"
ALLOWED = "http://allowed.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tight():
    process = ServerProcess(
        "--api-key", KEY, "--cors-origins", ALLOWED, "--max-num-seqs", "1", "--max-pending", "1",
        "--pending-timeout", "1", "--max-request-mb", "0.01", "--max-model-len", "1024",
        "--max-num-batched-tokens", "32", "--sse-keepalive", "0.05",
        "--served-model-name", "tight-model,tight-alias", "--allowed-hosts", "ember.internal,.lan.example").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def session(tight):
    with httpx.Client(base_url=tight.url, timeout=120, headers=AUTH) as s:
        yield s


def test_api_key_is_required_except_for_health(tight):
    open_client = httpx.Client(base_url=tight.url, timeout=60)
    for path in ("/v1/models", "/openapi.json", "/metrics"):
        reply = open_client.get(path)
        assert reply.status_code == 401, path
        assert reply.json()["error"]["type"] == "authentication_error"
        assert reply.headers["x-request-id"]
    assert open_client.post("/v1/chat/completions", json={"messages": HI}).status_code == 401
    assert open_client.get("/health").status_code == 200
    assert open_client.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert open_client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert open_client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert open_client.get("/v1/models", headers={"x-api-key": KEY[:-1]}).status_code == 401
    good = openai.OpenAI(base_url=tight.url + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model="tight-model", messages=HI, max_tokens=2).choices
    bad = openai.OpenAI(base_url=tight.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert all(KEY not in line for line in tight.lines)


def test_served_model_name_and_alias(session):
    assert [m["id"] for m in session.get("/v1/models").json()["data"]] == ["tight-model", "tight-alias"]
    assert session.get("/v1/models/tight-alias").status_code == 200
    reply = session.post("/v1/chat/completions", json={"model": "tight-alias", "messages": HI, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == "tight-model"
    reply = session.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", "messages": HI})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_cors_only_for_listed_origins(tight, session):
    preflight = {"Origin": ALLOWED, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    reply = httpx.options(tight.url + "/v1/chat/completions", headers=preflight)  # no key: preflight is open
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == ALLOWED
    reply = httpx.options(tight.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert reply.status_code == 403 and reply.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in reply.headers
    reply = session.get("/v1/models", headers={"Origin": ALLOWED})
    assert reply.headers["access-control-allow-origin"] == ALLOWED
    assert "x-request-id" in reply.headers["access-control-expose-headers"].lower()
    reply = session.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert reply.status_code == 403 and "access-control-allow-origin" not in reply.headers


def test_a_page_of_another_origin_is_refused_before_any_work(http):
    reply = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2},
                      headers={"Origin": "http://evil.example"})
    assert reply.status_code == 403 and reply.json()["error"]["type"] == "permission_error"
    assert "x-request-id" in reply.headers and "access-control-allow-origin" not in reply.headers
    assert http.get("/v1/models", headers={"Origin": ALLOWED}).status_code == 403  # no --cors-origins: none
    assert http.get("/v1/models", headers={"Origin": "null"}).status_code == 403  # a file:// page or a sandbox
    same_origin = http.base_url.scheme + "://" + http.base_url.netloc.decode()
    assert http.get("/v1/models", headers={"Origin": same_origin}).status_code == 200  # ember's own page
    reply = http.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": HI},
                      headers={"Origin": "http://evil.example"})
    assert reply.status_code == 403 and reply.json()["error"]["type"] == "permission_error"  # Anthropic's shape
    assert reply.json()["type"] == "error" and reply.headers["request-id"]


def test_a_foreign_host_name_is_refused_and_loopback_names_pass(tight):
    def status(host: str) -> int:
        return httpx.get(tight.url + "/v1/models", headers={**AUTH, "Host": host}).status_code

    port = tight.url.rsplit(":", 1)[1]
    assert status(f"rebind.attacker.example:{port}") == 403  # DNS rebinding names the attacker's host
    assert status("127.0.0.1.attacker.example") == 403 and status("localhost.evil") == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", f"[::1]:{port}", "ember.internal",
                 f"node.lan.example:{port}"):
        assert status(host) == 200, host
    reply = httpx.get(tight.url + "/v1/models", headers={**AUTH, "Host": "evil.example"})
    assert reply.json()["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in reply.json()["error"]["message"]


def test_body_over_the_limit_is_413(session):
    big = {"messages": [{"role": "user", "content": "x" * 20_000}]}
    reply = session.post("/v1/chat/completions", json=big)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 1000
        yield b'"}]}'

    reply = session.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413


def test_keep_alive_comments_while_the_stream_is_idle(session):
    long_prompt = "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 80
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2, "stream": True}
    with session.stream("POST", "/v1/chat/completions", json=body) as reply:
        lines = list(reply.iter_lines())
    assert ": keep-alive" in lines
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines


def test_full_queue_is_429_and_a_long_wait_is_503(tight, session):
    wait_idle(session)
    hold = {"messages": HI, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    waited: dict = {}

    def waiter() -> None:
        reply = httpx.post(tight.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                           json={"messages": HI, "max_tokens": 2})
        waited["status"], waited["body"], waited["headers"] = reply.status_code, reply.json(), reply.headers

    with httpx.Client(base_url=tight.url, timeout=120, headers=AUTH) as holder:
        with holder.stream("POST", "/v1/chat/completions", json=hold) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # admitted and running
            thread = threading.Thread(target=waiter)
            thread.start()
            _wait_for(lambda: session.get("/health").json()["requests_waiting"] == 1)
            full = session.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "server_overloaded"
            assert int(full.headers["retry-after"]) > 0 and full.headers["x-should-retry"] == "true"
            thread.join(60)
    assert waited["status"] == 503 and waited["body"]["error"]["code"] == "request_queue_timeout"
    assert int(waited["headers"]["retry-after"]) > 0 and waited["headers"]["x-should-retry"] == "true"
    wait_idle(session)
    assert session.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200


def test_a_second_ctrl_c_cancels_running_requests_and_frees_the_port(tight):
    """Runs last in this module: it stops the server. The first Ctrl-C drains (nothing new is
    admitted; running requests may finish); the second ends them at once."""
    body = {"messages": HI, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tight.url, timeout=120, headers=AUTH) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            tight.proc.send_signal(signal.SIGINT)
            _wait_for(lambda: any("have" in line and "to finish" in line for line in tight.lines))
            try:  # draining: nothing new is admitted (uvicorn stops listening; a kept connection gets 503)
                assert httpx.post(tight.url + "/v1/chat/completions", json=body, headers=AUTH,
                                  timeout=30).status_code == 503
            except httpx.ConnectError:
                pass
            code = tight.interrupt()
            rest = list(_safe_lines(lines))
    assert code == 0
    assert not any("finish_reason\":\"length" in line for line in rest)
    assert any("stopped" in line for line in tight.lines)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", tight.port))


def _safe_lines(lines):
    try:
        yield from lines
    except httpx.HTTPError:
        return


def _wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_hostile_bodies_get_400_and_the_server_stays_up(http, path):
    bodies = {
        b"[" * 10_000 + b"]" * 10_000: None,
        b'{"messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 2}': "messages[0].content",
        b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}': "messages[0].content",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}': "temperature",
        b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}': None,
    }
    for body, param in bodies.items():
        reply = http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400, (path, body[:40], reply.text[:200])
        error = reply.json()["error"]
        if path == "/v1/messages":  # Anthropic's errors have no param: the message names the place
            assert param is None or param in error["message"]
        else:
            assert error["param"] == param
    assert http.get("/health").status_code == 200
