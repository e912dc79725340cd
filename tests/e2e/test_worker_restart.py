"""The engine worker dies under a real `ember serve` and the server lives on: kill -9 during
concurrent requests of every dialect, requests sent while it restarts, no leaked KV blocks, a
client that stops reading, and a drain on SIGTERM. The last test stops this module's server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import anthropic
import httpx
import openai
import pytest

from conftest import ServerProcess, wait_idle

FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "24", "--stalled-client-timeout", "3",
         "--drain-timeout", "60"]
TOPICS = ["rivers", "bread", "glass", "owls", "copper", "rain", "salt", "maps"]
MAX_TOKENS = 40
MODEL = "SmolLM2-135M-Instruct"  # the default model's id (Messages accepts any)


@pytest.fixture(scope="module")
def worker_server():
    process = ServerProcess(*FLAGS).start()
    yield process
    process.stop()


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


def prompt(topic: str) -> str:
    return f"Write a few sentences about {topic}."


async def chat(server, topic: str, stream: bool) -> str:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    body = dict(model=MODEL, messages=[{"role": "user", "content": prompt(topic)}], max_tokens=MAX_TOKENS,
                temperature=0)
    if not stream:
        reply = await client.chat.completions.create(**body)
        return reply.choices[0].message.content
    parts = []
    async for chunk in await client.chat.completions.create(**body, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


async def responses(server, topic: str, stream: bool) -> str:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    body = dict(model=MODEL, input=prompt(topic), max_output_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return (await client.responses.create(**body)).output_text
    parts, failed = [], None
    async for event in await client.responses.create(**body, stream=True):
        if event.type == "response.output_text.delta":
            parts.append(event.delta)
        elif event.type == "error":
            failed = event
        elif event.type == "response.failed":
            assert failed is not None, "response.failed must follow an error event"
            raise RuntimeError(f"stream failed: {failed.message}")
    return "".join(parts)


async def messages(server, topic: str, stream: bool) -> str:
    client = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0, timeout=600)
    body = dict(model="m", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},  # the SDK has no sampling fields
                messages=[{"role": "user", "content": prompt(topic)}])
    if not stream:
        reply = await client.messages.create(**body)
        return "".join(block.text for block in reply.content if block.type == "text")
    parts = []
    async for event in await client.messages.create(**body, stream=True):
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            parts.append(event.delta.text)
    return "".join(parts)


DIALECTS = {"chat": chat, "responses": responses, "messages": messages}
PAIRS = [(name, topic) for topic in TOPICS for name in DIALECTS][:16]
CASES = [(name, topic, i % 2 == 0) for i, (name, topic) in enumerate(PAIRS)]  # (dialect, topic, streamed)


async def run_cases(server) -> list[tuple[str, str | Exception]]:
    async def one(name, topic, stream):
        try:
            return await DIALECTS[name](server, topic, stream)
        except Exception as exc:  # a well-formed error reaches the client as its library's exception
            return exc

    return await asyncio.gather(*(one(*case) for case in CASES))


def test_kill_9_during_sixteen_requests_every_one_completes_identically_or_fails_cleanly(worker_server):
    assert len(CASES) == 16 and sum(stream for _, _, stream in CASES) == 8
    clean = asyncio.run(run_cases(worker_server))
    assert all(isinstance(text, str) and text for text in clean), clean
    before = health(worker_server)
    pid = before["worker_pid"]

    async def scenario():
        work = asyncio.ensure_future(run_cases(worker_server))
        generated = before["engine"]["generation_tokens"]
        while health(worker_server)["engine"]["generation_tokens"] < generated + 24:  # mid-flight
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        seen = []
        while not work.done():
            seen.append(health(worker_server)["status"])
            await asyncio.sleep(0.2)
        return await work, seen

    after, statuses = asyncio.run(scenario())
    assert "loading" in statuses
    for (name, topic, stream), reference, result in zip(CASES, clean, after):
        if isinstance(result, Exception):
            assert stream, f"a {name} request that had sent nothing must have run again: {result!r}"
            assert "engine worker" in str(result), result
        else:
            assert result == reference, (name, topic, stream)
    assert all(isinstance(result, str) for (_, _, stream), result in zip(CASES, after) if not stream)
    body = wait_idle(httpx.Client(base_url=worker_server.url, timeout=30))
    assert body["status"] == "ok" and body["worker_restarts"] == 1 and body["worker_pid"] not in (None, pid)
    assert body["engine"]["kv_blocks_used"] == 0 and body["requests_running"] == 0
    assert body["engine"]["generation_tokens"] >= before["engine"]["generation_tokens"]  # totals never go back
    metrics = httpx.get(worker_server.url + "/metrics").text
    assert "ember:engine_worker_restarts_total 1.0" in metrics
    assert f"ember:engine_worker_pid {float(body['worker_pid'])}" in metrics


def test_a_request_sent_while_the_worker_restarts_waits_for_it(worker_server):
    pid = health(worker_server)["worker_pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while health(worker_server)["status"] != "loading":  # the supervisor notices within a poll
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client = openai.OpenAI(base_url=worker_server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           temperature=0)
    assert reply.choices[0].message.content
    body = wait_idle(httpx.Client(base_url=worker_server.url, timeout=30))
    assert body["worker_restarts"] == 2 and body["engine"]["kv_blocks_used"] == 0


def test_a_stream_whose_client_reads_nothing_is_cut_off_and_its_blocks_return(worker_server):
    mark = len(worker_server.lines)
    # 8 choices with 20 alternatives a token: about 16 KiB of events a step, enough to fill the
    # server's bounded send buffer within a few dozen steps while the client reads nothing
    body = json.dumps({"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 400,
                       "ignore_eos": True, "temperature": 0.5, "seed": 1, "n": 8, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    reader.connect(("127.0.0.1", worker_server.port))
    reader.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        deadline = time.monotonic() + 300
        while not any("read nothing" in line for line in worker_server.log_since(mark)):
            assert time.monotonic() < deadline, "the stalled stream was never cut off"
            time.sleep(0.2)
        idle = wait_idle(httpx.Client(base_url=worker_server.url, timeout=30))
        assert idle["engine"]["kv_blocks_used"] == 0
        assert idle["engine"]["generation_tokens"] > 0
    finally:
        reader.close()


def test_sigterm_under_load_drains_the_running_requests_then_stops_with_its_worker(worker_server):
    pid = health(worker_server)["worker_pid"]

    async def scenario():
        client = openai.AsyncOpenAI(base_url=worker_server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt("bells")}], max_tokens=MAX_TOKENS,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        finish, pieces = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
                if pieces == 2:
                    worker_server.proc.send_signal(signal.SIGTERM)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish, pieces

    finish, pieces = asyncio.run(scenario())
    assert finish == "length" and pieces > 2  # it ran to its end after the signal
    assert worker_server.proc.wait(120) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(worker_server.url + "/health", timeout=5)
