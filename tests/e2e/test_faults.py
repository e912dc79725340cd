"""Fault paths of the real server and its engine worker: still loading, a device fault injected
into the worker mid-stream or mid-request (EMBER_INJECT_FAULT's plans, ember.engine.faults), a
fault loop, and a model that cannot load."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx

from ember.config import EngineConfig
from ember.server.app import create_app
from ember.server.config import ServerConfig
from ember.server.state import load_model

HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
ENGINE = EngineConfig(max_model_len=512, kv_cache_tokens=8192)


def config(fault: str | None = None) -> ServerConfig:
    return ServerConfig(engine=ENGINE, inject_fault=fault)


def gated_loader(gate: threading.Event):
    def load(config):
        gate.wait(60)
        return load_model(config)
    return load


async def with_app(scenario, config, loader=load_model):
    app = create_app(config, loader=loader)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=600) as client:
            await scenario(client)


async def wait_for(client, status: str) -> dict:
    for _ in range(30000):
        health = await client.get("/health")
        if health.json()["status"] == status:
            return health.json()
        await asyncio.sleep(0.02)
    raise AssertionError(f"the server never became {status}")


def test_loading_answers_503_then_serves():
    gate = threading.Event()

    async def scenario(client):
        health = await client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        reply = await client.post("/v1/chat/completions", json=HI)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "model_loading"
        assert reply.headers["retry-after"]
        assert (await client.head("/health")).status_code == 503
        gate.set()
        await wait_for(client, "ok")
        reply = await client.post("/v1/chat/completions", json=HI)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]

    asyncio.run(with_app(scenario, config(), gated_loader(gate)))


def test_a_fault_mid_stream_is_an_error_event_then_done_and_the_worker_comes_back():
    async def scenario(client):
        first = await wait_for(client, "ok")
        assert first["worker_restarts"] == 0
        body = {**HI, "max_tokens": 50, "stream": True, "temperature": 0}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]
                    if json.loads(e).get("choices")]
        assert any(contents)  # some tokens streamed before the fault, so the stream cannot run again
        error = json.loads(events[-2])
        assert error["error"]["type"] == "server_error" and error["error"]["code"] == "engine_restarted"
        assert "injected device fault" in error["error"]["message"] and error["request_id"]
        assert events[-1] == "[DONE]"
        health = await wait_for(client, "ok")
        assert health["worker_restarts"] == 1 and health["worker_pid"] != first["worker_pid"]
        again = await client.post("/v1/chat/completions", json=body)
        assert again.status_code == 200 and again.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in again.text and '"finish_reason":' in again.text

    asyncio.run(with_app(scenario, config("raise@6")))


def test_a_whole_request_whose_worker_fails_runs_again_and_equals_a_clean_run():
    body = {"prompt": "Count: one, two,", "max_tokens": 20, "temperature": 0}

    async def scenario(client):
        await wait_for(client, "ok")
        retried = await client.post("/v1/completions", json=body)  # the worker fails at its 3rd step
        assert retried.status_code == 200
        health = (await client.get("/health")).json()
        assert health["worker_restarts"] == 1 and health["engine"]["kv_blocks_used"] == 0
        clean = await client.post("/v1/completions", json=body)
        assert retried.json()["choices"][0]["text"] == clean.json()["choices"][0]["text"]
        assert retried.json()["usage"]["completion_tokens"] == 20

    asyncio.run(with_app(scenario, config("raise@3")))


def test_three_quick_faults_in_a_row_leave_the_engine_unavailable_with_the_reason():
    async def scenario(client):
        await wait_for(client, "ok")
        failed = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_restarted"
        await wait_for(client, "ok")
        refused = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert refused.status_code == 503
        health = await wait_for(client, "unavailable")
        assert "3 engine workers in a row" in health["reason"] and "injected device fault" in health["reason"]
        anthropic = await client.post("/v1/messages", json={**HI, "model": "m"})
        assert anthropic.status_code in (503, 529)

    asyncio.run(with_app(scenario, config("raise@1,always")))


def test_a_model_that_fails_to_load_leaves_the_server_unavailable(tmp_path):
    missing = str(tmp_path / "no-such-model")

    async def scenario(client):
        for _ in range(500):
            health = await client.get("/health")
            if health.json()["status"] != "loading":
                break
            await asyncio.sleep(0.01)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert "no-such-model" in health.json()["reason"]

    asyncio.run(with_app(scenario, ServerConfig(model=missing)))
