"""The KV cache tiers, in one run: a long agent-style prefix served cold, from the pool, from host
memory and from disk after a restart; and a multi-turn workload with more conversations than the
pool holds, with the tiers on and off.

    python bench/cache_tiers.py [--prefix-tokens 20000] [--conversations 8] [--turns 3]

Every request goes to `POST /generate` with token ids (a seeded random prefix: timing does not
depend on what the tokens say) and asks for one new token, so its time is its time to first token.
Part 1 runs one server with `--cache-ram` and `--cache-dir` on a pool that holds the prefix once:
the prefix cold; again (from the pool); after other prompts pushed it out of the pool (from host
memory); after the server is stopped and started again on the same folder (from disk). Part 2
serves the conversations round-robin, each turn its conversation so far plus a short new message,
on a pool that holds about two of them: once with the tiers on (host memory), once with the pool
alone. Prints the times, each as a share of the cold prefill measured in the same run, the per-tier
split of cached tokens /generate reports, and part 2's mean time to first token and hit rate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vs_llama_cpp import Server, ember_server

BYTES_PER_TOKEN = 23_040  # the default model's KV (30 layers, 3 KV heads of 64, bfloat16, keys and values)


def token_ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(count)]


def first_token(server: Server, ids: list[int]) -> tuple[float, dict]:
    """(seconds to the one new token, meta_info's cached_tokens_details or {})."""
    began = time.perf_counter()
    reply = httpx.post(server.url + "/generate", timeout=1800, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    seconds = time.perf_counter() - began
    reply.raise_for_status()
    meta = reply.json()["meta_info"]
    return seconds, meta.get("cached_tokens_details") or {"total": meta.get("cached_tokens", 0)}


def health_counts(server: Server) -> tuple[int, int]:
    body = httpx.get(server.url + "/health", timeout=10).json()
    return body["prompt_tokens_total"], body["cached_tokens_total"]


def pool_mib(tokens: int) -> str:
    return str(max(1, tokens * BYTES_PER_TOKEN >> 20))


def long_prefix(args, common: list[str], folder: Path) -> list[tuple[str, float, dict]]:
    prefix = token_ids(args.prefix_tokens, 1)
    tail = lambda n: token_ids(24, 100 + n)  # a new user message each time
    margin = 2048  # the pool holds the prefix and this many tokens more
    flags = [*common, "--kv-cache-mib", pool_mib(args.prefix_tokens + margin), "--cache-ram", "8192",
             "--cache-dir", str(folder / "kv")]
    server = ember_server("tiers", flags)
    rows = []
    server.start(folder / "tiers.log")
    try:
        rows.append(("cold", *first_token(server, prefix + tail(0))))
        rows.append(("from the pool", *first_token(server, prefix + tail(1))))
        for n in range(2):  # other prompts, together as many tokens as the pool, push the prefix out of it
            first_token(server, token_ids(args.prefix_tokens // 2 + margin // 2, 50 + n))
        rows.append(("from host memory", *first_token(server, prefix + tail(2))))
    finally:
        server.stop()
    server.start(folder / "tiers-restarted.log")
    try:
        rows.append(("from disk, after a restart", *first_token(server, prefix + tail(3))))
    finally:
        server.stop()
    return rows


def multi_turn(args, common: list[str], folder: Path, tiers: bool) -> tuple[float, float]:
    """(mean time to first token, share of prompt tokens served from cache) of the conversations."""
    holds = 2 * (args.conversation_tokens + args.turns * 64)
    flags = [*common, "--kv-cache-mib", pool_mib(holds), "--cache-ram", "4096" if tiers else "0"]
    name = "tiers on" if tiers else "pool alone"
    server = ember_server(name, flags)
    server.start(folder / f"{name}.log")
    try:
        conversations = [token_ids(args.conversation_tokens, 1000 + c) for c in range(args.conversations)]
        for c in range(args.conversations):  # every conversation's first turn, outside the measure
            first_token(server, conversations[c])
        prompt_before, cached_before = health_counts(server)
        times = []
        for turn in range(1, args.turns):
            for c in range(args.conversations):
                conversations[c] += token_ids(48, 10_000 * c + turn)
                seconds, _ = first_token(server, conversations[c])
                times.append(seconds)
                print(f"  {name}: turn {turn + 1} of conversation {c + 1}: {seconds:.2f} s", file=sys.stderr, flush=True)
        prompt_after, cached_after = health_counts(server)
    finally:
        server.stop()
    return statistics.mean(times), (cached_after - cached_before) / max(prompt_after - prompt_before, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model ember loads (default: the default model)")
    parser.add_argument("--prefix-tokens", type=int, default=20_000)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--conversation-tokens", type=int, default=3000, help="each conversation's first prompt")
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    common = ["--max-model-len", str(args.prefix_tokens + 256), "--log-level", "warning",
              *([args.model] if args.model else [])]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = long_prefix(args, common, folder)
        on = multi_turn(args, common, folder, tiers=True)
        off = multi_turn(args, common, folder, tiers=False)
    cold = rows[0][1]
    print(f"model {args.model or 'default'}, a {args.prefix_tokens}-token prefix")
    print("| prefix served | time to first token | share of cold | cached tokens by tier |")
    print("| --- | --- | --- | --- |")
    for name, seconds, split in rows:
        print(f"| {name} | {seconds:.2f} s | {seconds / cold:.3f} | {split} |")
    print(f"\n{args.conversations} conversations, {args.turns} turns, a pool holding about two of them")
    print("| setup | mean time to first token, turns 2 on | prompt tokens from cache |")
    print("| --- | --- | --- |")
    for name, (mean, share) in (("tiers on (host memory)", on), ("the pool alone", off)):
        print(f"| {name} | {mean:.2f} s | {share:.1%} |")
    print(f"\nthe pool alone / tiers on: {off[0] / on[0]:.1f}x")


if __name__ == "__main__":
    main()
