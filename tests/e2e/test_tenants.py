"""Tenant keys on a real server: shares of the queue, the tenant (never the key) in logs and
metrics, and the key file read again on SIGHUP without dropping requests."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from conftest import ServerProcess

ALPHA, BETA, GAMMA = "alpha-key-0001", "beta-key-0002", "gamma-key-0003"
LONG = {"messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 60, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    key_file, log = folder / "keys", folder / "requests.jsonl"
    key_file.write_text(f"# two teams\nalpha: {ALPHA}\nbeta: {BETA}\n")
    process = ServerProcess("--api-key-file", str(key_file), "--max-num-seqs", "1", "--max-pending", "8",
                            "--max-pending-per-tenant", "2", "--request-log", str(log)).start()
    yield process, key_file, log
    process.stop()


def post(url: str, key: str, body: dict, client: httpx.AsyncClient) -> "asyncio.Future":
    return client.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_a_flooding_tenant_gets_its_own_429_and_the_other_tenant_goes_first(tenants):
    server, _, log = tenants

    async def until(client: httpx.AsyncClient, gauge: str, count: int) -> None:
        """Until admission's gauge reads `count` (from /metrics, not guessed from time)."""
        for _ in range(600):
            text = (await client.get(server.url + "/metrics", headers={"x-api-key": BETA})).text
            if f"ember:num_requests_{gauge} {float(count)}" in text:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"ember:num_requests_{gauge} never read {count}")

    async def scenario():
        async with httpx.AsyncClient(timeout=600) as client:
            running = asyncio.ensure_future(post(server.url, ALPHA, {**LONG, "max_tokens": 600}, client))
            await until(client, "running", 1)
            queued = [asyncio.ensure_future(post(server.url, ALPHA, LONG, client)) for _ in range(2)]
            await until(client, "waiting", 2)
            refused = await post(server.url, ALPHA, LONG, client)
            other = asyncio.ensure_future(post(server.url, BETA, {**LONG, "max_tokens": 4}, client))
            await until(client, "waiting", 3)
            replies = await asyncio.gather(running, *queued, other)
            return refused, replies

    refused, replies = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_overloaded"
    assert "'alpha'" in refused.json()["error"]["message"] and int(refused.headers["retry-after"]) > 0
    assert [r.status_code for r in replies] == [200, 200, 200, 200]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [e["tenant"] for e in events if e["event"] == "request_start"]
    assert starts[-4:] == ["alpha", "beta", "alpha", "alpha"]  # beta arrived last and ran second
    text = log.read_text()
    assert ALPHA not in text and BETA not in text
    metrics = httpx.get(server.url + "/metrics", headers={"x-api-key": BETA}).text
    assert 'ember:tenant_requests_total{route="chat",status="429",tenant="alpha"} 1.0' in metrics
    assert ALPHA not in metrics and BETA not in metrics


def test_sighup_reads_the_key_file_again_without_dropping_a_request(tenants):
    server, key_file, _ = tenants
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=ALPHA, max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    async def long_reply():
        return await asyncio.to_thread(client.chat.completions.create, model=model, messages=LONG["messages"],
                                       max_tokens=60, extra_body={"ignore_eos": True})

    async def scenario():
        reply = asyncio.ensure_future(long_reply())
        await asyncio.sleep(0.5)
        key_file.write_text(f"alpha: {ALPHA}\ngamma: {GAMMA}\n")
        server.proc.send_signal(signal.SIGHUP)
        return await reply

    finished = asyncio.run(scenario())
    assert finished.usage.completion_tokens == 60  # the request in flight was not touched
    deadline = time.monotonic() + 30
    while any("SIGHUP" in line for line in server.lines) is False and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("SIGHUP: 2 API keys in force" in line for line in server.lines)
    gamma = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {GAMMA}"})
    beta = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {BETA}"})
    assert gamma.status_code == 200 and beta.status_code == 401
    key_file.write_text("broken: a b c\n")
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while not any("keys are unchanged" in line for line in server.lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("keys are unchanged" in line and "line 1" in line for line in server.lines)
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": GAMMA}).status_code == 200
