"""A soak against a running `ember serve`: many requests across every dialect, some of them from
clients that misbehave, then a check that the server holds nothing it should have let go.

Well-behaved clients (the `openai` and `anthropic` libraries, and httpx for /generate) send Chat,
Completions, Responses, Messages and /generate requests, streamed and not, with structured outputs
and tools. Beside them, by the shares `Mix` gives: clients that disconnect at a random point of a
stream, clients that read a stream slowly, clients that send malformed or hostile bodies (each must
get a 4xx), and one tenant that floods the server (its 429s are provoked, not failures).

`soak()` only sends and counts; `ServerProbe` reads what the server holds (KV blocks, requests,
file descriptors, threads, resident memory of the server and its worker) for the caller's checks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

WELL_BEHAVED_KINDS = ("chat", "chat_stream", "completions", "completions_stream", "responses", "responses_stream",
                      "messages", "messages_stream", "generate", "generate_stream", "structured", "tools")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
                 "required": ["answer"], "additionalProperties": False}
TOPICS = ("harbours", "violins", "glaciers", "lanterns", "bees", "bridges", "comets", "orchards", "deserts", "clocks")
# bodies a server must refuse with a 4xx: (path, raw body, content type)
HOSTILE_BODIES = (
    ("/v1/chat/completions", b"{not json", "application/json"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": "hello"}).encode(), "application/json"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 10 ** 30}).encode(), "application/json"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "temperature": "hot"}).encode(), "application/json"),
    ("/v1/messages", json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "tool"}]}).encode(),
     "application/json"),
    ("/v1/responses", ("[" * 5000 + "]" * 5000).encode(), "application/json"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "logit_bias": {"-1": 400}}).encode(), "application/json"),
    ("/generate", b"\xff\xfe\x00garbage", "application/octet-stream"),
)


@dataclass(frozen=True)
class Mix:
    """The shares of misbehaving requests; the rest are well behaved."""

    disconnect: float = 0.10
    slow_reader: float = 0.05
    hostile: float = 0.02
    flood_every: int = 200  # one burst of the flooding tenant per this many requests (0: none)
    flood_burst: int = 40  # past a tenant's share of the queue (bench/soak.py sets it to the concurrency)

    @classmethod
    def clean(cls) -> "Mix":
        return cls(0.0, 0.0, 0.0, 0)


@dataclass
class SoakResult:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)  # (kind, status) -> count
    latencies: list[float] = field(default_factory=list)  # well-behaved requests' seconds, whole reply read
    unexpected: list[str] = field(default_factory=list)  # what went wrong that nobody provoked
    faults: Counter = field(default_factory=Counter)  # misbehaviour kind -> how many were sent

    def p(self, quantile: float) -> float | None:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


class Clients:
    """The clients of one soak, all on one server: a well-behaved tenant's and a flooding one's."""

    def __init__(self, url: str, key: str, flood_key: str | None, model: str, timeout: float) -> None:
        import anthropic
        import openai

        self.url, self.key, self.flood_key, self.model = url, key, flood_key, model
        self.openai = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)
        self.anthropic = anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=timeout)
        self.http = httpx.AsyncClient(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"},
                                      limits=httpx.Limits(max_connections=256))

    async def close(self) -> None:
        await self.openai.close()
        await self.anthropic.close()
        await self.http.aclose()


async def soak(clients: Clients, num_requests: int, *, concurrency: int = 16, mix: Mix = Mix(), seed: int = 0,
               max_tokens: int = 8) -> SoakResult:
    """Send `num_requests` requests, `concurrency` at a time, by `mix`; count what came back."""
    rng = random.Random(seed)
    result = SoakResult()
    plan = [_pick(rng, mix) for _ in range(num_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for i, kind in enumerate(plan):
        queue.put_nowait((i, kind))

    async def worker() -> None:
        while not queue.empty():
            i, kind = queue.get_nowait()
            await _one(clients, kind, i, rng.random(), result, max_tokens)
            if mix.flood_every and i % mix.flood_every == mix.flood_every - 1 and clients.flood_key:
                await _flood(clients, mix.flood_burst, result)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.requests = num_requests
    return result


def _pick(rng: random.Random, mix: Mix) -> str:
    roll = rng.random()
    for kind, share in (("disconnect", mix.disconnect), ("slow_reader", mix.slow_reader), ("hostile", mix.hostile)):
        if roll < share:
            return kind
        roll -= share
    return rng.choice(WELL_BEHAVED_KINDS)


async def _one(clients: Clients, kind: str, i: int, roll: float, result: SoakResult, max_tokens: int) -> None:
    topic = TOPICS[i % len(TOPICS)]
    started = time.perf_counter()
    try:
        if kind in ("disconnect", "slow_reader", "hostile"):
            result.faults[kind] += 1
            status = await MISBEHAVIOURS[kind](clients, topic, roll, max_tokens)
            if status is not None and status >= 500:
                result.unexpected.append(f"{kind}: HTTP {status}")
            result.statuses[(kind, status)] += 1
            return
        await WELL_BEHAVED[kind](clients, topic, max_tokens)
        result.latencies.append(time.perf_counter() - started)
        result.statuses[(kind, 200)] += 1
    except Exception as exc:  # a well-behaved request must succeed; anything else is a finding
        status = getattr(exc, "status_code", None)
        result.statuses[(kind, status)] += 1
        result.unexpected.append(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}")


# ---- well-behaved requests --------------------------------------------------------------------


def _ask(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Say one thing about {topic}."}]


async def _chat(c: Clients, topic: str, n: int) -> None:
    reply = await c.openai.chat.completions.create(model=c.model, messages=_ask(topic), max_tokens=n, temperature=0)
    _expect(reply.choices[0].finish_reason in ("stop", "length"), reply)


async def _chat_stream(c: Clients, topic: str, n: int) -> None:
    stream = await c.openai.chat.completions.create(model=c.model, messages=_ask(topic), max_tokens=n, stream=True,
                                                    temperature=0.7, stream_options={"include_usage": True})
    finish = [chunk.choices[0].finish_reason async for chunk in stream if chunk.choices]
    _expect(finish and finish[-1] in ("stop", "length"), finish)


async def _completions(c: Clients, topic: str, n: int) -> None:
    reply = await c.openai.completions.create(model=c.model, prompt=f"Facts about {topic}:", max_tokens=n)
    _expect(reply.choices[0].finish_reason in ("stop", "length"), reply)


async def _completions_stream(c: Clients, topic: str, n: int) -> None:
    stream = await c.openai.completions.create(model=c.model, prompt=f"A poem on {topic}:", max_tokens=n, stream=True)
    _expect([chunk async for chunk in stream], "an empty stream")


async def _responses(c: Clients, topic: str, n: int) -> None:
    reply = await c.openai.responses.create(model=c.model, input=f"Name a fact about {topic}.", max_output_tokens=n,
                                            store=False)
    _expect(reply.status in ("completed", "incomplete"), reply.status)


async def _responses_stream(c: Clients, topic: str, n: int) -> None:
    stream = await c.openai.responses.create(model=c.model, input=f"Describe {topic}.", max_output_tokens=n,
                                             stream=True, store=False)
    kinds = [event.type async for event in stream]
    _expect(kinds and kinds[-1] in ("response.completed", "response.incomplete"), kinds[-3:])


async def _messages(c: Clients, topic: str, n: int) -> None:
    reply = await c.anthropic.messages.create(model=c.model, max_tokens=n, messages=_ask(topic))
    _expect(reply.stop_reason in ("end_turn", "max_tokens"), reply.stop_reason)


async def _messages_stream(c: Clients, topic: str, n: int) -> None:
    async with c.anthropic.messages.stream(model=c.model, max_tokens=n, messages=_ask(topic)) as stream:
        message = await stream.get_final_message()
    _expect(message.stop_reason in ("end_turn", "max_tokens"), message.stop_reason)


async def _generate(c: Clients, topic: str, n: int) -> None:
    reply = await c.http.post("/generate", json={"text": f"About {topic}:", "sampling_params": {
        "max_new_tokens": n, "temperature": 0}})
    _expect(reply.status_code == 200 and "meta_info" in reply.json(), reply.text[:200])


async def _generate_stream(c: Clients, topic: str, n: int) -> None:
    async with c.http.stream("POST", "/generate", json={"text": f"On {topic}:", "stream": True,
                                                        "sampling_params": {"max_new_tokens": n}}) as reply:
        _expect(reply.status_code == 200, reply.status_code)
        lines = [line async for line in reply.aiter_lines() if line.startswith("data:")]
    _expect(lines and lines[-1].strip() == "data: [DONE]", lines[-1:])


async def _structured(c: Clients, topic: str, n: int) -> None:
    reply = await c.openai.chat.completions.create(
        model=c.model, messages=_ask(topic), max_tokens=n + 24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        json.loads(choice.message.content)  # a complete reply is the schema's JSON


async def _tools(c: Clients, topic: str, n: int) -> None:
    reply = await c.openai.chat.completions.create(
        model=c.model, messages=[{"role": "user", "content": "What is the weather in Lagos?"}], max_tokens=n + 24,
        tools=[WEATHER_TOOL], tool_choice="required", temperature=0)
    _expect(reply.choices[0].finish_reason in ("tool_calls", "length"), reply.choices[0].finish_reason)


def _expect(condition: Any, detail: Any) -> None:
    if not condition:
        raise AssertionError(f"unexpected reply: {detail}")


WELL_BEHAVED = {"chat": _chat, "chat_stream": _chat_stream, "completions": _completions,
                "completions_stream": _completions_stream, "responses": _responses,
                "responses_stream": _responses_stream, "messages": _messages, "messages_stream": _messages_stream,
                "generate": _generate, "generate_stream": _generate_stream, "structured": _structured,
                "tools": _tools}


# ---- misbehaving clients ----------------------------------------------------------------------


def _long_stream_body(c: Clients, topic: str, max_tokens: int) -> dict[str, Any]:
    return {"model": c.model, "messages": _ask(topic), "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


async def _disconnect(c: Clients, topic: str, roll: float, max_tokens: int) -> int:
    """A stream left after a random number of chunks (none at all, sometimes)."""
    keep = int(roll * 6)
    async with c.http.stream("POST", "/v1/chat/completions", json=_long_stream_body(c, topic, 8 * max_tokens)) as reply:
        status = reply.status_code
        read = 0
        async for _ in reply.aiter_raw():
            read += 1
            if read >= keep:
                break
    return status  # leaving the block closes the connection mid-stream


async def _slow_reader(c: Clients, topic: str, roll: float, max_tokens: int) -> int:
    """A stream read to its end, a pause after every chunk."""
    async with c.http.stream("POST", "/v1/chat/completions", json=_long_stream_body(c, topic, 4 * max_tokens)) as reply:
        async for _ in reply.aiter_raw():
            await asyncio.sleep(0.05 + 0.1 * roll)
        return reply.status_code


async def _hostile(c: Clients, topic: str, roll: float, max_tokens: int) -> int:
    path, body, content_type = HOSTILE_BODIES[int(roll * len(HOSTILE_BODIES))]
    reply = await c.http.post(path, content=body, headers={"content-type": content_type})
    if not 400 <= reply.status_code < 500:
        raise AssertionError(f"a hostile body to {path} got HTTP {reply.status_code}")
    return reply.status_code


MISBEHAVIOURS = {"disconnect": _disconnect, "slow_reader": _slow_reader, "hostile": _hostile}


async def _flood(c: Clients, burst: int, result: SoakResult) -> None:
    """One tenant's burst at once: what its share of the queue cannot take is refused with 429."""
    headers = {"Authorization": f"Bearer {c.flood_key}"}
    body = {"model": c.model, "messages": _ask("floods"), "max_tokens": 4}
    replies = await asyncio.gather(*(c.http.post("/v1/chat/completions", json=body, headers=headers)
                                     for _ in range(burst)), return_exceptions=True)
    result.faults["flood"] += burst
    for reply in replies:
        status = getattr(reply, "status_code", None)
        result.statuses[("flood", status)] += 1
        if status not in (200, 429):
            result.unexpected.append(f"flood: {f'HTTP {status}' if status else f'{type(reply).__name__}: {reply}'}")


# ---- what the server holds --------------------------------------------------------------------


@dataclass(frozen=True)
class Holdings:
    kv_blocks_used: int
    requests_running: int
    processes: dict[str, dict[str, int]]  # "server" / "worker <pid>" -> fds, threads, rss_bytes


class ServerProbe:
    """Reads a server's /health and its processes (the server's own, and its engine workers')."""

    def __init__(self, url: str, server_pid: int, key: str) -> None:
        self.url, self.server_pid = url, server_pid
        self.headers = {"Authorization": f"Bearer {key}"}

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", headers=self.headers, timeout=30).json()

    def wait_idle(self, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:
            body = self.health()
            engine = body.get("engine", {})
            if body.get("requests_running") == 0 and engine.get("num_running") == 0 and engine.get(
                    "num_waiting") == 0 and engine.get("kv_blocks_used") == 0:
                return body
            time.sleep(0.2)
        raise AssertionError(f"the server did not become idle: {body}")

    def holdings(self) -> Holdings:
        import psutil

        body = self.health()
        pids = {"server": (self.server_pid, 0)}
        for i, worker in enumerate(body.get("workers") or [body]):
            if worker.get("worker_pid"):
                pids[f"worker {i}"] = (worker["worker_pid"], worker.get("host_cache_bytes", 0))
        processes = {}
        for name, (pid, host_cache_bytes) in pids.items():
            process = psutil.Process(pid)
            processes[name] = {"fds": process.num_fds(), "threads": process.num_threads(),
                               "rss_bytes": process.memory_info().rss, "host_cache_bytes": host_cache_bytes}
        return Holdings(body["engine"]["kv_blocks_used"], body["requests_running"], processes)


def compare(before: Holdings, after: Holdings, rss_tolerance: float = 0.05) -> list[str]:
    """What `after` holds beyond `before`: KV blocks, running requests, descriptors, threads, memory.
    A worker's host cache tier (--cache-ram) fills with the blocks its pool evicts, up to its cap:
    what it took meanwhile is its budget at work, not a leak, so it is allowed beside the tolerance."""
    problems = []
    if after.kv_blocks_used or after.requests_running:
        problems.append(f"held at the end: {after.kv_blocks_used} KV blocks, {after.requests_running} requests")
    for name, start in before.processes.items():
        end = after.processes.get(name)
        if end is None:
            problems.append(f"{name} is gone (restarted?)")
            continue
        for what in ("fds", "threads"):
            if end[what] > start[what]:
                problems.append(f"{name}: {what} {start[what]} -> {end[what]}")
        cache_growth = max(end["host_cache_bytes"] - start["host_cache_bytes"], 0)
        if end["rss_bytes"] > start["rss_bytes"] * (1 + rss_tolerance) + cache_growth:
            problems.append(f"{name}: resident memory {start['rss_bytes'] >> 20} -> {end['rss_bytes'] >> 20} MiB "
                            f"(the host cache tier took {cache_growth >> 20} MiB of it)")
    return problems


def wait_released(probe: ServerProbe, before: Holdings, timeout: float = 60) -> tuple[Holdings, list[str]]:
    """The server's holdings once what the soak left has had `timeout` seconds to go, and what
    is still held beyond `before` then (connections and threads close a moment after the replies)."""
    deadline = time.monotonic() + timeout
    while True:
        after = probe.holdings()
        problems = compare(before, after)
        if not problems or time.monotonic() > deadline:
            return after, problems
        time.sleep(0.5)


@dataclass
class SoakReport:
    clean: SoakResult
    mixed: SoakResult
    before: Holdings
    after: Holdings
    problems: list[str]  # leaks and unprovoked failures; empty when the soak passed

    def p99_ratio(self) -> float | None:
        clean, mixed = self.clean.p(0.99), self.mixed.p(0.99)
        return mixed / clean if clean and mixed else None

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.clean.requests + self.mixed.requests,
            "faults_injected": dict(self.mixed.faults),
            "unexpected": self.clean.unexpected + self.mixed.unexpected,
            "p50_clean_s": self.clean.p(0.5), "p99_clean_s": self.clean.p(0.99),
            "p50_mixed_s": self.mixed.p(0.5), "p99_mixed_s": self.mixed.p(0.99), "p99_ratio": self.p99_ratio(),
            "kv_blocks_held": self.after.kv_blocks_used,
            "processes": {name: {"before": self.before.processes[name], "after": self.after.processes.get(name)}
                          for name in self.before.processes},
            "problems": self.problems,
        }


async def _sweep_pool(url: str, key: str, model: str, health: dict[str, Any], timeout: float) -> None:
    """Distinct prompts that fill the window, until they have passed through every block of the KV
    pool: the pool's memory is taken page by page as blocks are first written (engine.attention),
    so a pool not yet swept would look like a leak as the prefix cache spreads over it."""
    length = health["max_model_len"] - 2
    count = -(-health["kv_cache_tokens"] // length) + 2
    rng = random.Random(1)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"}) as http:
        for start in range(0, count, 4):
            bodies = [{"model": model, "prompt": [rng.randrange(1000, 20000) for _ in range(length)], "max_tokens": 1}
                      for _ in range(min(4, count - start))]
            for reply in await asyncio.gather(*(http.post("/v1/completions", json=body) for body in bodies)):
                reply.raise_for_status()


def run_soak(url: str, server_pid: int, key: str, flood_key: str | None, model: str, num_requests: int, *,
             concurrency: int = 16, warm_up: int = 160, seed: int = 0, max_tokens: int = 8,
             timeout: float = 300) -> SoakReport:
    """Warm up (the same mix, and every block of the KV pool written once), take the server's
    holdings, run a quarter of `num_requests` from well-behaved clients alone (the latency baseline)
    and the rest with the misbehaving ones, then check that the server let go of everything."""
    probe = ServerProbe(url, server_pid, key)

    async def phase(count: int, mix: Mix, phase_seed: int) -> SoakResult:
        clients = Clients(url, key, flood_key, model, timeout)
        try:
            return await soak(clients, count, concurrency=concurrency, mix=mix, seed=phase_seed, max_tokens=max_tokens)
        finally:
            await clients.close()

    asyncio.run(phase(warm_up, Mix(), seed - 1))  # every kind of request, so every buffer has its size
    asyncio.run(_sweep_pool(url, key, model, probe.health(), timeout))
    probe.wait_idle()
    before = probe.holdings()
    clean = asyncio.run(phase(num_requests // 4, Mix.clean(), seed))
    mixed = asyncio.run(phase(num_requests - num_requests // 4, Mix(), seed + 1))
    problems = [f"unexpected: {u}" for u in clean.unexpected + mixed.unexpected]
    try:
        probe.wait_idle()
    except AssertionError as exc:
        problems.append(str(exc))
    after, leaks = wait_released(probe, before)
    return SoakReport(clean, mixed, before, after, problems + leaks)
