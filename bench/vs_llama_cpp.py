"""ember against llama.cpp's server on the same GGUF file, with the same threads and the same
workloads, measured by `ember bench` in one run; prints one table of ratios, and each speed as a
fraction of the machine's bound (ember/bench/limits.py, probed first on the same threads).

    python bench/vs_llama_cpp.py --llama-server PATH/TO/llama-server [--model FILE.gguf] [--threads 2]
        [--only one-stream,32-streams,...] [--json results.json] [--ember-arg=--quantization=int4 ...]

Each server is started in turn (never both at once), waited for, measured on every workload and
stopped. Resident memory is read from /proc after the server is ready and at its peak during the
workloads. The default model's GGUF is used unless --model names another file.

The bounds: one stream's decode against read bandwidth / weight bytes per token (ember's from its
/health, llama-server's the GGUF file's size; at 8,000 tokens of context the keys and values each
step reads are added, 16-bit in both servers, a sliding window's layers reading their window's),
many streams and prefill (prompt tokens over the time to first token) against int8 peak / (2 x
weights), the weights as ember counts them. One
stream is shown two ways against the read bound: output tokens over the whole run (each request's
prefill and the gaps between requests included) and its decode alone (1 / TPOT, as `ember bench`
reports it). 32 streams too: output tokens alone, and every token computed (each request's prompt,
less what the prefix cache held, is prefilled between the others' decode steps: arithmetic the int8
peak counts).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(frozen=True)
class Workload:
    name: str
    args: tuple[str, ...]
    # (label, summary key, statistic, higher is better, bound): the bound its speed is held
    # against, "read" (one stream's decode), "read@N" (the same with N tokens of keys and values
    # read each step), "int8" (many streams, prefill) or "" (none)
    metrics: tuple[tuple[str, str, str, bool, str], ...]


# every token the server ran through the model: a many-stream run prefills each request's prompt
# (less what its prefix cache held) as well, so its output tokens alone understate the arithmetic
# done against the int8 peak
COMPUTED = "computed_tokens_per_s"
WORKLOADS = (
    Workload("one-stream", ("--concurrency", "1", "--input-len", "128", "--output-len", "128", "--num-requests", "8"),
             (("one stream, output tok/s", "output_tokens_per_s", "", True, "read"),
              ("one stream, ms per token after the first (TPOT p50)", "tpot", "p50", False, "read"))),
    Workload("32-streams", ("--concurrency", "32", "--input-len", "128", "--output-len", "128", "--num-requests", "64"),
             (("32 streams, output tok/s", "output_tokens_per_s", "", True, "int8"),
              ("32 streams, prompt (less cached) and output tokens computed a second", COMPUTED, "", True, "int8"))),
    Workload("prompt-1500", ("--concurrency", "1", "--input-len", "1500", "--output-len", "4", "--num-requests", "3"),
             (("1,500-token prompt, time to first token s", "ttft", "p50", False, "int8"),)),
    Workload("prompt-8000", ("--concurrency", "1", "--input-len", "8000", "--output-len", "48", "--num-requests", "2"),
             (("8,000-token prompt, time to first token s", "ttft", "p50", False, "int8"),
              ("decode at 8,000 tokens of context, ms per token", "tpot", "p50", False, "read@8000"))),
    Workload("multiturn", ("--workload", "multiturn", "--turns", "6", "--concurrency", "1", "--input-len", "600",
                           "--output-len", "64"),
             (("6-turn conversation (600 new tokens a turn), mean time to first token s", "ttft", "mean", False, ""),
              ("6-turn conversation, output tok/s per request", "request_output_tokens_per_s", "p50", True, ""))),
)
_CONTEXT = 16384  # room for the 8,000-token prompt and the conversation
_SLOTS = 32


@dataclass
class Server:
    name: str
    command: list[str]
    url: str
    process: subprocess.Popen | None = None
    rss_after_load_mib: float = 0.0
    rss_peak_mib: float = 0.0
    results: dict[str, dict] = field(default_factory=dict)
    weight_bytes: int = 0  # what one decode step reads, for the bounds

    def read_weight_bytes(self, gguf: Path) -> None:
        """ember's weights in memory from its /health; another server's, its GGUF file's size."""
        health = httpx.get(self.url + "/health", timeout=10).json()
        self.weight_bytes = int(health["gb"] * 1e9) if "gb" in health else gguf.stat().st_size

    def start(self, log: Path) -> None:
        self.process = subprocess.Popen(self.command, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited with status {self.process.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.rss_after_load_mib = self.rss_mib()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} did not get ready in 600 s; see {log}")

    def rss_mib(self) -> float:
        """The server's resident memory, its child processes' included (ember's engine worker)."""
        return sum(_rss_mib(pid) for pid in _process_tree(self.process.pid))

    def cpu_seconds(self) -> float:
        """CPU time the server and its live child processes have used so far, user and system."""
        return sum(_cpu_seconds(pid) for pid in _process_tree(self.process.pid))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _process_tree(pid: int) -> list[int]:
    pids, index = [pid], 0
    while index < len(pids):
        for task in Path(f"/proc/{pids[index]}/task").glob("*"):
            try:
                pids += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                pass
        index += 1
    return pids


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ember_server(name: str, args: list[str]) -> Server:
    """An `ember serve` with these arguments on a free local port (not started)."""
    port = free_port()
    return Server(name, [sys.executable, "-m", "ember.cli", "serve", "--port", str(port), *args],
                  f"http://127.0.0.1:{port}")


def run_workload(server: Server, workload: Workload, folder: Path) -> dict:
    out = folder / f"{server.name}-{workload.name}.json"
    command = [sys.executable, "-m", "ember.cli", "bench", "--base-url", server.url, "--quiet", "--json", str(out),
               *workload.args]
    peak = [server.rss_peak_mib]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            peak[0] = max(peak[0], server.rss_mib())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    finally:
        done.set()
        watcher.join()
    server.rss_peak_mib = peak[0]
    level = json.loads(out.read_text())["levels"][0]
    # prompt tokens the server took from its prefix cache, where its usage says (else none)
    level["summary"]["cached_tokens"] = sum(request.get("cached_tokens") or 0 for request in level["requests"])
    return level["summary"]


def value(summary: dict, key: str, statistic: str) -> float:
    if key == COMPUTED:
        return (summary["prompt_tokens"] - summary["cached_tokens"] + summary["output_tokens"]) / summary["wall_s"]
    item = summary[key]
    number = item[statistic] if statistic else item
    return number * 1000 if key in ("tpot", "itl") else number


def speed(summary: dict, key: str, statistic: str) -> float:
    """A metric as tokens a second: throughputs as they are, a time per token inverted, a time to
    first token as the prompt's tokens over it."""
    number = value(summary, key, statistic)
    if key == "tpot":
        return 1000 / number
    if key == "ttft":
        return summary["prompt_tokens"] / summary["num_ok"] / number
    return number


def ember_num_weights(server: Server) -> int:
    """The weights as ember counts them, from its /health's gigabytes and bits per weight."""
    health = httpx.get(server.url + "/health", timeout=10).json()
    return round(health["gb"] * 1e9 * 8 / health["bpw"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="path of a built llama-server binary")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--threads", type=int, default=2, help="threads for each server (default 2)")
    parser.add_argument("--only", default=None, help="comma-separated workload names: "
                        + ", ".join(w.name for w in WORKLOADS))
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--ember-arg", action="append", default=[], help="an extra `ember serve` argument")
    args = parser.parse_args()
    if args.model is None:
        from ember.loaders.default_model import default_model_path
        args.model = str(default_model_path())
    workloads = [w for w in WORKLOADS if args.only is None or w.name in args.only.split(",")]
    from ember.bench.limits import Bounds
    from ember.bench.machine_probe import probe
    limits = probe(args.threads)  # before any server starts: the machine to itself

    ember_port, llama_port = free_port(), free_port()
    servers = [
        Server("ember", [sys.executable, "-m", "ember.cli", "serve", args.model, "--port", str(ember_port),
                         "--threads", str(args.threads), "--max-model-len", str(_CONTEXT),
                         "--max-num-seqs", str(_SLOTS), "--log-level", "warning", *args.ember_arg],
               f"http://127.0.0.1:{ember_port}"),
        Server("llama-server", [args.llama_server, "-m", args.model, "--port", str(llama_port), "-t", str(args.threads),
                                "-tb", str(args.threads), "-c", str(_CONTEXT * 2), "-np", str(_SLOTS), "-kvu",
                                "--no-webui"],
               f"http://127.0.0.1:{llama_port}"),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for server in servers:
            server.start(folder / f"{server.name}.log")
            try:
                server.read_weight_bytes(Path(args.model))
                if server.name == "ember":
                    num_weights = ember_num_weights(server)
                for workload in workloads:
                    print(f"{server.name}: {workload.name} ...", file=sys.stderr, flush=True)
                    server.results[workload.name] = run_workload(server, workload, folder)
            finally:
                server.stop()

    ember, llama = servers
    bounds = {server.name: Bounds(limits, server.weight_bytes, num_weights) for server in servers}
    rows = []
    for workload in workloads:
        for label, key, statistic, higher_better, bound in workload.metrics:
            results = (ember.results[workload.name], llama.results[workload.name])
            a, b = (value(result, key, statistic) for result in results)
            shares = [share_of_bound(bounds[server.name], bound, speed(result, key, statistic), Path(args.model))
                      for server, result in zip(servers, results)]
            rows.append((label, a, b, a / b if b else float("nan"), higher_better, *shares))
    rows.append(("resident memory after load, MiB", ember.rss_after_load_mib, llama.rss_after_load_mib,
                 ember.rss_after_load_mib / llama.rss_after_load_mib, False, None, None))
    rows.append(("resident memory at its peak, MiB", ember.rss_peak_mib, llama.rss_peak_mib,
                 ember.rss_peak_mib / llama.rss_peak_mib, False, None, None))
    print(f"model {Path(args.model).name}, {args.threads} threads each, "
          f"ember args: {' '.join(args.ember_arg) or '(defaults)'}")
    print(f"{limits.describe()}; weights: ember {ember.weight_bytes / 1e9:.3f} GB, llama-server "
          f"{llama.weight_bytes / 1e9:.3f} GB (its file), {num_weights / 1e6:.0f} M")
    print("| measure | ember | llama-server | ember / llama-server | ember / bound | llama-server / bound |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, a, b, ratio, higher_better, ember_share, llama_share in rows:
        better = "higher is better" if higher_better else "lower is better"
        print(f"| {label} | {a:.2f} | {b:.2f} | {ratio:.2f}x ({better}) | {_percent(ember_share)} | "
              f"{_percent(llama_share)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "threads": args.threads,
                                               "ember_args": args.ember_arg, "rows": rows,
                                               "bounds": {name: b.to_json() for name, b in bounds.items()},
                                               "results": {s.name: s.results for s in servers}}, indent=1))


def share_of_bound(bounds, bound: str, tokens_per_s: float, gguf: Path) -> float | None:
    """A speed as a fraction of the bound its metric names ("read", "read@N", "int8"), None for none."""
    if bound.startswith("read"):
        context = int(bound.partition("@")[2] or 0)
        return bounds.of_read(tokens_per_s, cache_bytes_at(gguf, context) if context else 0)
    return bounds.of_int8(tokens_per_s) if bound == "int8" else None


def cache_bytes_at(gguf: Path, context: int) -> int:
    """The keys and values a decode step at `context` tokens reads from a 16-bit cache (both
    servers' default), from the file's shape as ember reads it."""
    from ember.bench.limits import cache_bytes_read
    from ember.config import ModelConfig
    from ember.loaders.gguf_file import GGUFModel
    config = ModelConfig.from_hf(GGUFModel(gguf).hf_config([]))
    per_key = config.num_key_value_heads * config.head_dim * 2 * 2  # a key and a value, 2 bytes each
    return cache_bytes_read(config.layer_windows, config.num_hidden_layers, per_key, context)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


if __name__ == "__main__":
    main()
