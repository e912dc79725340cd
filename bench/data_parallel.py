"""Data-parallel replicas against one engine worker on the same cores, in one run.

    python bench/data_parallel.py [--model FILE] [--rounds 3] [--replicas 2]

Two `ember serve` instances on the same model: one engine worker (`--threads` all the cores)
and `--data-parallel-size N` (the cores split between the N workers). Measured in turn, never at
once, with `ember bench`: many independent streams, and multi-turn conversations, whose later
turns are served from the prefix cache only if the router sends them back to the worker that
holds their earlier turns. For each, output tokens per second (the median of the rounds' ratios)
and the share of prompt tokens found in the prefix cache (from /health's counters: equal shares
mean the router loses no cache hits by splitting the cache).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from vs_llama_cpp import Server, Workload, ember_server, run_workload

WORKLOADS = (
    Workload("32 streams", ("--concurrency", "32", "--input-len", "128", "--output-len", "64",
                            "--num-requests", "64"), ()),
    Workload("16 conversations", ("--workload", "multiturn", "--concurrency", "16", "--turns", "4",
                                  "--input-len", "96", "--output-len", "32", "--num-requests", "64"), ()),
)


def cache_counts(server: Server) -> tuple[int, int]:
    body = httpx.get(server.url + "/health", timeout=10).json()
    return body["prompt_tokens_total"], body["cached_tokens_total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model ember loads (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    common = ["--max-model-len", "2048", "--max-num-seqs", "32", "--log-level", "warning",
              *([args.model] if args.model else [])]
    servers = [ember_server("one worker", [*common, "--threads", str(cores)]),
               ember_server(f"{args.replicas} replicas", [*common, "--data-parallel-size", str(args.replicas)])]
    speed = {s.name: {w.name: [] for w in WORKLOADS} for s in servers}
    hits = {s.name: {w.name: [0, 0] for w in WORKLOADS} for s in servers}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for server in servers:
            server.start(folder / f"{server.name}.log")
        try:
            for round_ in range(args.rounds):
                for workload in WORKLOADS:
                    for server in (servers if round_ % 2 == 0 else servers[::-1]):
                        print(f"round {round_ + 1}: {server.name} {workload.name} ...", file=sys.stderr, flush=True)
                        prompt_before, cached_before = cache_counts(server)
                        summary = run_workload(server, workload, folder)
                        prompt_after, cached_after = cache_counts(server)
                        speed[server.name][workload.name].append(summary["output_tokens_per_s"])
                        hits[server.name][workload.name][0] += prompt_after - prompt_before
                        hits[server.name][workload.name][1] += cached_after - cached_before
        finally:
            for server in servers:
                server.stop()
    one, many = servers[0].name, servers[1].name
    print(f"model {args.model or 'default'}, {cores} cores, {args.rounds} rounds")
    print(f"| workload | {one}, output tok/s | {many}, output tok/s | ratio (median) | prompt tokens cached, "
          f"{one} | same, {many} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for workload in WORKLOADS:
        a, b = speed[many][workload.name], speed[one][workload.name]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        share = {name: hits[name][workload.name][1] / max(hits[name][workload.name][0], 1) for name in (one, many)}
        print(f"| {workload.name} | {statistics.median(b):.1f} | {statistics.median(a):.1f} | {ratio:.3f}x "
              f"| {share[one]:.1%} | {share[many]:.1%} |")


if __name__ == "__main__":
    main()
