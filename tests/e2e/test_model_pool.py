"""Several models behind one `ember serve` (the shared `pool_server`: the default GGUF as `smol`,
tiny Qwen3 and Llama folders, a model that cannot load, at most two loaded at once): routing by
name through the openai and anthropic clients, loading on first use, unloading under the cap and
on request while other requests run untouched, a broken model's 503 beside working ones, and
Ollama's list and ps across the models.

The tests share one server and so do not count on which models are loaded when they start: each
brings the models it needs into the state it checks."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.e2e.conftest import POOL_MODELS

HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def pool(pool_server):
    with httpx.Client(base_url=pool_server.url, timeout=300) as session:
        yield session


@pytest.fixture(scope="module")
def oai(pool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def states(pool: httpx.Client) -> dict[str, str]:
    return {entry["model"]: entry["state"] for entry in pool.get("/health").json()["models"]}


def wait_state(pool: httpx.Client, model: str, state: str, timeout: float = 120) -> dict[str, str]:
    """Poll /health until `model` is in `state` (a liveness wait: the deadline only ends a hung test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = states(pool)
        if now[model] == state:
            return now
        time.sleep(0.1)
    raise AssertionError(f"{model} never became {state}: {states(pool)}")


def unload(pool: httpx.Client, model: str) -> None:
    reply = pool.post("/api/generate", json={"model": model, "keep_alive": 0})
    assert reply.status_code == 200 and reply.json()["done_reason"] == "unload"
    wait_state(pool, model, "unloaded")


def chat(oai: openai.OpenAI, model: str, max_tokens: int = 4) -> str:
    reply = oai.chat.completions.create(model=model, messages=HI, max_tokens=max_tokens, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    return reply.model


def test_every_model_is_listed_with_its_state_and_the_first_loads_at_start(pool):
    listed = pool.get("/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["smol", "default", "tiny", "small", "tiny-llama", "broken"]
    assert {card["root"] for card in listed} == set(POOL_MODELS)
    assert all(card["state"] in ("unloaded", "loading", "ready", "unloading", "failed") for card in listed)
    health = pool.get("/health").json()
    assert health["status"] == "ok" and [entry["model"] for entry in health["models"]] == list(POOL_MODELS)
    wait_state(pool, "smol", "ready")
    smol = pool.get("/v1/models/default").json()
    assert smol["root"] == "smol" and smol["max_model_len"] == 1024 and smol["input_modalities"] == ["text"]


def test_requests_route_by_name_and_alias_through_openai_and_anthropic(pool, oai, pool_server):
    assert chat(oai, "smol") == "smol"
    assert chat(oai, "small") == "tiny"  # an alias reaches its model, which answers under its id
    claude = anthropic.Anthropic(base_url=pool_server.url, api_key="none", max_retries=0, timeout=300)
    message = claude.messages.create(model="tiny", max_tokens=4, messages=HI)
    assert message.model == "tiny" and message.usage.output_tokens > 0
    with pytest.raises(openai.NotFoundError) as missing:
        chat(oai, "no-such-model")
    assert missing.value.body["code"] == "model_not_found" and "no-such-model" in missing.value.body["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=4, messages=HI)
    entries = pool.get("/debug/requests").json()["data"]
    assert {"smol", "tiny"} <= {entry["model"] for entry in entries}
    metrics = pool.get("/metrics").text
    assert 'ember:model_requests_total{model="tiny",route="chat",status="200"}' in metrics
    assert 'ember:model_state{model="tiny",state="ready"} 1.0' in metrics


def test_a_model_loads_on_its_first_request_and_reports_the_wait(pool):
    unload(pool, "tiny-llama")
    reply = pool.post("/api/generate", json={"model": "tiny-llama", "prompt": "Hi", "stream": False,
                                             "options": {"num_predict": 3}})
    assert reply.status_code == 200 and reply.json()["done"] is True
    assert reply.json()["load_duration"] > 0  # this request waited for the load
    assert states(pool)["tiny-llama"] == "ready"
    again = pool.post("/api/generate", json={"model": "tiny-llama", "prompt": "Hi", "stream": False,
                                             "options": {"num_predict": 3}})
    assert again.json()["load_duration"] == 0
    card = pool.get("/v1/models/tiny-llama").json()
    assert card["state"] == "ready" and card["max_model_len"] == 256


def stream_in_background(pool_server, model: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streamed chat that reads its reply slowly enough to still run while the test goes on."""
    outcome: dict = {}

    def run() -> None:
        client = openai.OpenAI(base_url=pool_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        stream = client.chat.completions.create(model=model, messages=HI, max_tokens=max_tokens, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True})
        pieces = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome["finish_reason"] = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                outcome["completion_tokens"] = chunk.usage.completion_tokens
            pieces.append(chunk)
            time.sleep(0.02)
        outcome["chunks"] = len(pieces)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_the_cap_unloads_the_least_recently_used_idle_model_while_another_streams(pool, oai, pool_server):
    chat(oai, "tiny")  # loaded (two at most: smol or tiny-llama may be unloaded to make room)
    thread, outcome = stream_in_background(pool_server, "smol", 200)
    try:
        wait_state(pool, "smol", "ready")
        time.sleep(0.5)  # the stream is under way
        assert chat(oai, "tiny-llama") == "tiny-llama"  # needs room: tiny is idle, smol is busy
        now = states(pool)
        assert now["tiny"] == "unloaded" and now["smol"] == "ready" and now["tiny-llama"] == "ready"
    finally:
        thread.join(300)
    assert outcome["finish_reason"] == "length" and outcome["completion_tokens"] == 200  # untouched


def test_a_running_request_outlives_an_unload_asked_of_its_model(pool, oai, pool_server):
    chat(oai, "smol")
    thread, outcome = stream_in_background(pool_server, "smol", 150)
    try:
        time.sleep(1.0)
        reply = pool.post("/api/chat", json={"model": "smol", "messages": [], "keep_alive": 0})
        assert reply.status_code == 200 and reply.json()["done_reason"] == "unload"
        if thread.is_alive():
            assert states(pool)["smol"] == "unloading"  # it waits for the stream
    finally:
        thread.join(300)
    assert outcome["finish_reason"] == "length" and outcome["completion_tokens"] == 150
    wait_state(pool, "smol", "unloaded")
    assert chat(oai, "default") == "smol"  # the next request loads it again


def test_keep_alive_unloads_a_model_once_it_has_been_idle_that_long(pool):
    reply = pool.post("/api/chat", json={"model": "tiny", "keep_alive": "5s",
                                         "messages": HI, "stream": False, "options": {"num_predict": 2}})
    assert reply.status_code == 200
    ps = ollama.Client(host=str(pool.base_url)).ps()
    assert "tiny" in [entry.model for entry in ps.models]
    wait_state(pool, "tiny", "unloaded", timeout=60)


def test_a_model_that_fails_to_load_answers_503_naming_it_while_the_others_serve(pool, oai):
    with pytest.raises(openai.InternalServerError) as refused:
        chat(oai, "broken")
    assert refused.value.status_code == 503 and "broken" in refused.value.body["message"]
    health = pool.get("/health").json()
    broken = next(entry for entry in health["models"] if entry["model"] == "broken")
    assert health["status"] == "ok" and broken["state"] == "failed" and "no-such-architecture" in broken["reason"]
    assert chat(oai, "smol") == "smol"
    again = pool.post("/v1/chat/completions", json={"model": "broken", "messages": HI, "max_tokens": 2})
    assert again.status_code == 503 and "broken" in again.json()["error"]["message"]  # not tried again at once


def test_ollama_lists_every_model_and_shows_the_loaded_ones_running(pool):
    client = ollama.Client(host=str(pool.base_url))
    listed = [entry.model for entry in client.list().models]
    assert listed == ["smol", "default", "tiny", "small", "tiny-llama", "broken"]
    running = {entry.model for entry in client.ps().models}
    loaded = {name for name, state in states(pool).items() if state == "ready"}
    assert loaded and {name for name in running if name in POOL_MODELS} == loaded
    shown = client.show("small")
    assert shown.modelinfo["general.architecture"] == "qwen3"
