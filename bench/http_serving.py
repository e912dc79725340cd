"""HTTP serving benchmark: N concurrent streaming clients against `ember serve`, then the engine
alone on the same load, in the same run.

    python bench/http_serving.py [--model PATH] [--concurrency 16] [--input-len 128] [--output-len 128]
    python bench/http_serving.py --base-url http://127.0.0.1:8000 --skip-engine   # any OpenAI-compatible server

Every client streams one completion of token-id prompts (distinct, so the prefix cache cannot
serve them) with temperature 0, ignore_eos and max_tokens = output length. Aggregate output tok/s
is completion tokens over the wall time from the first request sent to the last stream closed.
The engine figure runs the same prompts and settings through `ember.llm.LLM` after the server
has stopped, so both numbers come from the same machine in the same state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import os
import sys
import threading
import time

import httpx

SENTENCE = "The history of science is a story of curiosity, patience and argument. "


def start_server(args) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "ember.cli", "serve", "--port", "0", "--log-level", "warning",
               "--max-num-seqs", str(max(args.concurrency, 16)), "--max-model-len", str(args.max_model_len),
               "--dtype", args.dtype]
    if args.model:
        command.insert(4, args.model)
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    found: dict = {}
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stderr:
            match = re.search(r"listening on (http://\S+);", line)
            if match:
                found["url"] = match.group(1)
                ready.set()
            if "Traceback" in line or "Error" in line:
                print(line, end="", file=sys.stderr)
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait(300)
    if "url" not in found:
        raise SystemExit("the server did not start")
    url = found["url"]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server never became healthy")


def make_prompts(url: str, count: int, length: int, headers: dict) -> list[list[int]]:
    text = SENTENCE * (length // 10 + 1)
    reply = httpx.post(url + "/v1/completions", headers=headers, timeout=300,
                       json={"prompt": text, "max_tokens": 1, "return_token_ids": True})
    reply.raise_for_status()
    base = reply.json()["prompt_token_ids"]
    # A different first token per prompt: no prompt shares a cached block with another.
    return [[100 + i] + base[: length - 1] for i in range(count)]


async def one_stream(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> int:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


async def run_http(url: str, prompts: list[list[int]], output_len: int, headers: dict) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=3600, limits=limits) as client:
        await one_stream(client, prompts[0][: len(prompts[0]) // 2], 4)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(client, p, output_len) for p in prompts))
        return sum(counts), time.perf_counter() - start


def run_engine(args, prompts: list[list[int]]) -> tuple[int, float]:
    from ember import SamplingParams
    from ember.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.concurrency, 16), max_model_len=args.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][: len(prompts[0]) // 2]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outputs), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--base-url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--api-key", default=os.environ.get("EMBER_API_KEY"))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-engine", action="store_true", help="only the HTTP figure")
    args = parser.parse_args()
    args.max_model_len = args.input_len + args.output_len + 16
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    proc = None
    url = args.base_url
    if url is None:
        proc, url = start_server(args)
    try:
        prompts = make_prompts(url, args.concurrency, args.input_len, headers)
        tokens, seconds = asyncio.run(run_http(url, prompts, args.output_len, headers))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    http_rate = tokens / seconds
    print(f"{args.concurrency} streams x ({args.input_len} prompt + {args.output_len} output tokens)")
    print(f"HTTP   {tokens:6d} tokens in {seconds:7.2f} s = {http_rate:8.1f} output tok/s")
    if args.skip_engine:
        return
    tokens, seconds = run_engine(args, prompts)
    engine_rate = tokens / seconds
    print(f"engine {tokens:6d} tokens in {seconds:7.2f} s = {engine_rate:8.1f} output tok/s")
    print(f"HTTP / engine = {http_rate / engine_rate:.1%}")


if __name__ == "__main__":
    main()
