"""Fault paths of the real server and engine: still loading, an engine fault mid-stream or
mid-request (injected into the real model runner), and a model that cannot load."""

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
CONFIG = ServerConfig(engine=EngineConfig(max_model_len=512, kv_cache_tokens=8192))


class FaultyRunner:
    """The real runner, which raises a device-style error from its `fail_at`-th call on."""

    def __init__(self, runner, fail_at: int) -> None:
        self.runner, self.fail_at, self.calls = runner, fail_at, 0

    def execute(self, scheduled):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("device lost")
        return self.runner.execute(scheduled)


def faulty_loader(fail_at: int, gate: threading.Event | None = None):
    def load(config):
        if gate is not None:
            gate.wait(60)
        loaded = load_model(config)
        core = loaded.engine.core
        core.runner = FaultyRunner(core.runner, fail_at)
        return loaded
    return load


async def with_app(loader, scenario, config=CONFIG):
    app = create_app(config, loader=loader)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            await scenario(client)


async def wait_ready(client) -> None:
    for _ in range(3000):
        if (await client.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the server never became ready")


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
        await wait_ready(client)
        reply = await client.post("/v1/chat/completions", json=HI)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]

    asyncio.run(with_app(faulty_loader(fail_at=10**9, gate=gate), scenario))


def test_an_engine_fault_mid_stream_is_an_error_event_then_done_and_the_server_turns_unavailable():
    async def scenario(client):
        await wait_ready(client)
        body = {**HI, "max_tokens": 50, "stream": True, "temperature": 0}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]
                    if json.loads(e).get("choices")]
        assert any(contents)  # some tokens streamed before the fault
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "device lost" in error["message"]
        assert events[-1] == "[DONE]"
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        refused = await client.post("/v1/chat/completions", json=HI)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"

    asyncio.run(with_app(faulty_loader(fail_at=4), scenario))


def test_a_whole_request_failing_in_the_engine_is_500():
    async def scenario(client):
        await wait_ready(client)
        reply = await client.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 20})
        assert reply.status_code == 500 and reply.json()["error"]["code"] == "generation_failed"
        assert reply.headers["x-request-id"]

    asyncio.run(with_app(faulty_loader(fail_at=3), scenario))


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

    asyncio.run(with_app(load_model, scenario, ServerConfig(model=missing)))
