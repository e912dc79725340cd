"""The HTTP process's CPU per streamed token: this checkout against another commit, in one run.

    python bench/front_end_cpu.py [--ref HEAD~1] [--concurrency 1,32] [--rounds 2]

`--ref` is checked out into a temporary git worktree; `ember serve` runs from each tree in turn
(never both at once, rounds alternating), and `ember bench` streams the default model's replies
through it (128-token prompts; 512 output tokens at one stream, 128 at more). The front end's CPU
time (user + system, from /proc, the engine's worker process excluded) over the output tokens is
the figure: it changes only with the work the front end does per token, where wall-clock speeds
drift with a shared machine's other tenants. Output tok/s is shown beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PORT = 8119


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(tree: Path, concurrency: int) -> tuple[float, float]:
    """(front-end CPU ms per output token, output tok/s) of one server from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    server = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--port", str(PORT)], cwd=tree, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/v1/models").json()["data"]:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the server from {tree} did not start")
        bench = [sys.executable, "-m", "ember.cli", "bench", "--base-url", f"http://127.0.0.1:{PORT}/v1", "--quiet",
                 "--concurrency", str(concurrency), "--input-len", "128"]
        subprocess.run(bench + ["--output-len", "16", "--num-requests", str(concurrency)], check=True,
                       capture_output=True)  # warm-up
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            output_len, requests = (512, 6) if concurrency == 1 else (128, 2 * concurrency)
            began = cpu_seconds(server.pid)
            subprocess.run(bench + ["--output-len", str(output_len), "--num-requests", str(requests), "--json",
                                    out.name], check=True, capture_output=True)
            used = cpu_seconds(server.pid) - began
            summary = json.loads(Path(out.name).read_text())["levels"][0]["summary"]
        return used * 1e3 / summary["output_tokens"], summary["output_tokens_per_s"]
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default="HEAD~1", help="the commit to compare with (default HEAD~1)")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        other = Path(folder) / "other"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.ref], check=True,
                       capture_output=True)
        try:
            trees = {args.ref: other, "this checkout": ROOT}
            for concurrency in map(int, args.concurrency.split(",")):
                results = {name: [] for name in trees}
                for _ in range(args.rounds):
                    for name, tree in trees.items():
                        results[name].append(measure(tree, concurrency))
                base = statistics.median(cpu for cpu, _ in results[args.ref])
                for name, runs in results.items():
                    cpu = statistics.median(c for c, _ in runs)
                    speed = statistics.median(s for _, s in runs)
                    print(f"{concurrency:>3} streams  {name:<14} front end {cpu:.3f} ms CPU a token ({cpu / base:.2f}x), "
                          f"{speed:.1f} output tok/s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], capture_output=True)


if __name__ == "__main__":
    main()
