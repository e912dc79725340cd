"""Concurrent streams, and clients that leave: answers stay exact and KV blocks come back."""

from __future__ import annotations

import asyncio

import httpx
import openai

from conftest import wait_idle

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "mountains", "a red bicycle", "winter mornings", "a lost key", "coffee", "the moon",
          "an old library", "thunderstorms", "a city at night", "honey bees", "a train journey", "snow",
          "a lighthouse", "autumn leaves", "the desert", "a small garden", "a violin", "clocks", "rivers"]


def messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def test_twenty_concurrent_streams_equal_their_solo_runs(client, server, http):
    """Text, finish and every log probability (exact floats through JSON), greedy and seeded."""
    sampling = [{"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": 100 + i} for i in range(len(TOPICS))]
    solo = [client.chat.completions.create(model=MODEL, messages=messages(t), max_tokens=16, logprobs=True,
                                           top_logprobs=2, **s) for t, s in zip(TOPICS, sampling)]

    async def stream(aclient: openai.AsyncOpenAI, topic: str, sample: dict) -> tuple[str, str, list]:
        chunks = await aclient.chat.completions.create(model=MODEL, messages=messages(topic), max_tokens=16,
                                                       logprobs=True, top_logprobs=2, stream=True, **sample)
        text, finish, logprobs = [], None, []
        async for chunk in chunks:
            if chunk.choices:
                choice = chunk.choices[0]
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
                logprobs += _numbers(choice.logprobs.content if choice.logprobs else [])
        return "".join(text), finish, logprobs

    async def run_all() -> list[tuple[str, str, list]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(stream(aclient, t, s) for t, s in zip(TOPICS, sampling)))

    together = asyncio.run(run_all())
    for alone, (text, finish, logprobs) in zip(solo, together):
        assert text == alone.choices[0].message.content
        assert finish == alone.choices[0].finish_reason
        assert logprobs == _numbers(alone.choices[0].logprobs.content)
    wait_idle(http)


def _numbers(entries) -> list:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]


def test_a_client_leaving_mid_stream_frees_its_kv_blocks(server, http):
    wait_idle(http)
    before = http.get("/health").json()["engine"]["generation_tokens"]
    body = {"model": MODEL, "messages": messages("a very long journey"), "max_tokens": 800, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as session:
        with session.stream("POST", "/v1/chat/completions", json=body) as reply:
            lines = reply.iter_lines()  # kept alive: dropping it would close the connection early
            for _ in range(4):
                next(line for line in lines if line.startswith("data: "))
            busy = http.get("/health").json()
            assert busy["requests_running"] == 1 and busy["engine"]["kv_blocks_used"] > 0, busy
    # The connection is closed: the request must be aborted and its blocks returned.
    idle = wait_idle(http)
    generated = idle["engine"]["generation_tokens"] - before
    assert generated < 800
    assert wait_idle(http)["engine"]["generation_tokens"] == idle["engine"]["generation_tokens"]


def test_a_client_leaving_a_whole_request_aborts_it(server, http):
    wait_idle(http)
    before = http.get("/health").json()["engine"]["generation_tokens"]
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 800, "temperature": 0,
            "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=2.0)
    except httpx.TimeoutException:
        pass
    idle = wait_idle(http)
    assert idle["engine"]["generation_tokens"] - before < 800
