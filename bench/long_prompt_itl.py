"""What a long prompt does to the streams already running: inter-token latency of 4 streams while a
20,000-token prompt prefills, against the same streams alone, with the step budget counting
attention (the default) and counting tokens only (--attention-cost-tokens 0).

    python bench/long_prompt_itl.py [--prompt-tokens 20000] [--streams 4] [--model PATH]

Each setting starts its own `ember serve`. The streams (short prompts, 1,000 output tokens each)
start first; the long prompt is sent two seconds later, and the gaps between stream chunks are
counted from then until its first token (or, without it, for as long as the long prompt took).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx

WORDS = "river stone lamp harbour winter garden letter engine window market mountain candle".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream(client: httpx.AsyncClient, index: int, arrivals: list[float]) -> None:
    body = {"prompt": f"Story {index}: once upon a time", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())


async def long_prompt(client: httpx.AsyncClient, tokens: int) -> tuple[float, float]:
    text = " ".join(WORDS[i % len(WORDS)] + str(i % 97) for i in range(tokens // 2))
    sent = time.perf_counter()
    reply = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "temperature": 0})
    reply.raise_for_status()
    return sent, time.perf_counter()


async def measure(url: str, streams: int, prompt_tokens: int, with_prompt: bool, window: float | None):
    arrivals = [[] for _ in range(streams)]
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        tasks = [asyncio.create_task(stream(client, i, arrivals[i])) for i in range(streams)]
        await asyncio.sleep(2.0)
        if with_prompt:
            start, end = await long_prompt(client, prompt_tokens)
        else:
            start = time.perf_counter()
            await asyncio.sleep(window)
            end = time.perf_counter()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps = sorted(b - a for times in arrivals for a, b in zip(times, times[1:]) if start <= a and b <= end)
    return gaps, end - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    index = (len(values) - 1) * q
    low = int(index)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (index - low)


def serve(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "ember.cli", "serve", *([model] if model else []), "--port", str(port),
               "--max-model-len", "32768", "--log-level", "warning", *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("ember serve did not get ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=20000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for label, extra in (("attention-aware budget (default)", []), ("tokens-only budget", ["--attention-cost-tokens", "0"])):
        process, url = serve(args.model, extra)
        try:
            busy, seconds = asyncio.run(measure(url, args.streams, args.prompt_tokens, True, None))
            quiet, _ = asyncio.run(measure(url, args.streams, args.prompt_tokens, False, min(seconds, 60.0)))
        finally:
            process.terminate()
            process.wait(30)
        rows.append((label, seconds, percentile(quiet, 0.5), percentile(quiet, 0.99), percentile(busy, 0.5),
                     percentile(busy, 0.99), max(busy, default=float("nan"))))
    print(f"{args.streams} streams; a {args.prompt_tokens}-token prompt arriving; inter-token latency in ms")
    print("| step budget | long prompt's time to first token s | alone p50 | alone p99 | with the prompt p50 | "
          "with the prompt p99 | with the prompt, longest gap |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, seconds, qp50, qp99, bp50, bp99, worst in rows:
        print(f"| {label} | {seconds:.1f} | {qp50 * 1e3:.0f} | {qp99 * 1e3:.0f} | {bp50 * 1e3:.0f} | {bp99 * 1e3:.0f} | "
              f"{worst * 1e3:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
