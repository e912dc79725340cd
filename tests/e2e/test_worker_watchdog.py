"""An engine worker that stops making progress without dying, under a real `ember serve`: an
injected hang and SIGSTOP, each caught by the watchdog and restarted as after a crash. One server
for the module, whose first request meets the hang (the tests run in order)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from conftest import ServerProcess, wait_idle

STALL_TIMEOUT_S = 5
FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "8", "--worker-stall-timeout", str(STALL_TIMEOUT_S)]
MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Say hello to a lighthouse keeper."}]


@pytest.fixture(scope="module")
def stall_server():
    process = ServerProcess(*FLAGS, env={"EMBER_INJECT_FAULT": "hang@1"}).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stall_http(stall_server):
    with httpx.Client(base_url=stall_server.url, timeout=120) as session:
        yield session


def wait_serving(http: httpx.Client, timeout: float = 600) -> dict:
    """/health once a restarted worker serves (its load is slow on a busy machine), then idle."""
    deadline = time.monotonic() + timeout
    while http.get("/health").json()["status"] != "ok":
        assert time.monotonic() < deadline, "the worker never came back"
        time.sleep(0.2)
    return wait_idle(http)


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)


def test_a_hung_step_is_killed_and_the_request_runs_again_on_a_fresh_worker(stall_server, stall_http):
    pid = stall_http.get("/health").json()["worker_pid"]
    client = openai_client(stall_server)
    # the server's first model step hangs (EMBER_INJECT_FAULT=hang@1): nothing reached the client, so it runs again
    retried = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0)
    body = wait_idle(stall_http)
    assert body["worker_restarts"] == 1 and body["worker_pid"] not in (None, pid)
    assert body["worker_exits"] == {"stalled": 1}
    assert body["last_worker_exit"]["cause"] == "stalled"
    assert "no progress" in body["last_worker_exit"]["reason"]
    clean = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0)
    assert retried.choices[0].message.content == clean.choices[0].message.content
    assert retried.usage.completion_tokens == 12
    metrics = stall_http.get("/metrics").text
    assert 'ember:engine_worker_exits_total{cause="stalled"} 1.0' in metrics


def test_a_stopped_worker_is_killed_and_its_started_stream_ends_with_an_error(stall_server, stall_http):
    pid = stall_http.get("/health").json()["worker_pid"]
    stream = openai_client(stall_server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
    pieces = 0
    with pytest.raises(openai.APIError) as failed:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
                if pieces == 1:
                    os.kill(pid, signal.SIGSTOP)
    assert pieces >= 1 and "no progress" in str(failed.value)
    body = wait_serving(stall_http)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left stopped
    assert body["worker_restarts"] == 2 and body["worker_exits"] == {"stalled": 2}
    assert body["worker_pid"] not in (None, pid)
