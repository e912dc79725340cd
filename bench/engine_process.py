"""What the engine's worker process costs and how fast it comes back, in one run.

    python bench/engine_process.py [--model FILE] [--threads 2] [--rounds 3] [--json results.json]

Two `ember serve` instances on the same model: the default (the engine in a supervised worker
process) and `--no-engine-worker` (the engine in a thread of the server). They are measured in
turn, never at once, with `ember bench` at 1 stream and at 32 streams, alternating rounds so that
drift of a shared machine falls on both; each row's ratio is the median of the rounds' ratios.
Beside the speeds, the CPU time the server used per 1,000 output tokens (its worker process
included, read from /proc): the work the boundary adds, which a machine whose other tenants move
wall-clock speeds by 10% between rounds still shows.
Then the worker is killed with SIGKILL a few times and the time until /health says ok again is
reported (the model's load, warm-up and the supervisor's notice).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vs_llama_cpp import Server, Workload, ember_server, run_workload

WORKLOADS = (
    Workload("1-stream", ("--concurrency", "1", "--input-len", "128", "--output-len", "128", "--num-requests", "6"), ()),
    Workload("32-streams", ("--concurrency", "32", "--input-len", "128", "--output-len", "128",
                            "--num-requests", "64"), ()),
)
_KILLS = 2  # fewer than the supervisor's fault loop (three quick deaths in a row)


def kill_to_ready(server: Server) -> float:
    pid = httpx.get(server.url + "/health", timeout=10).json()["worker_pid"]
    began = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while True:
        body = httpx.get(server.url + "/health", timeout=10).json()
        if body["status"] == "ok" and body["worker_pid"] != pid:
            return time.monotonic() - began
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model ember loads (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common = ["--threads", str(args.threads), "--max-model-len", "2048", "--max-num-seqs", "32",
              "--log-level", "warning", *([args.model] if args.model else [])]
    servers = [ember_server("worker", common), ember_server("thread", [*common, "--no-engine-worker"])]
    results: dict[str, dict[str, list[float]]] = {s.name: {w.name: [] for w in WORKLOADS} for s in servers}
    cpu: dict[str, dict[str, list[float]]] = {s.name: {w.name: [] for w in WORKLOADS} for s in servers}
    restarts: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for server in servers:
            server.start(folder / f"{server.name}.log")
        try:
            for round_ in range(args.rounds):
                for workload in WORKLOADS:
                    order = servers if round_ % 2 == 0 else servers[::-1]
                    for server in order:
                        print(f"round {round_ + 1}: {server.name} {workload.name} ...", file=sys.stderr, flush=True)
                        before = server.cpu_seconds()
                        summary = run_workload(server, workload, folder)
                        results[server.name][workload.name].append(summary["output_tokens_per_s"])
                        used = server.cpu_seconds() - before
                        cpu[server.name][workload.name].append(1000 * used / max(summary["output_tokens"], 1))
            for _ in range(_KILLS):
                restarts.append(kill_to_ready(servers[0]))
        finally:
            for server in servers:
                server.stop()
    print(f"model {args.model or 'default'}, {args.threads} threads, {args.rounds} rounds")
    print("| workload | worker process, output tok/s | engine thread, output tok/s | worker / thread (median) "
          "| CPU s per 1,000 tokens, worker / thread | worker / thread (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for workload in WORKLOADS:
        a, b = results["worker"][workload.name], results["thread"][workload.name]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        ca, cb = cpu["worker"][workload.name], cpu["thread"][workload.name]
        cpu_ratio = statistics.median(x / y for x, y in zip(ca, cb))
        print(f"| {workload.name} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | {ratio:.3f}x "
              f"| {statistics.median(ca):.2f} / {statistics.median(cb):.2f} | {cpu_ratio:.3f}x |")
    print("kill -9 to ready, s: " + ", ".join(f"{t:.1f}" for t in restarts))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "cpu_s_per_1000_tokens": cpu,
                                                  "kill_to_ready_s": restarts}, indent=1))


if __name__ == "__main__":
    main()
