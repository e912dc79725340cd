"""Does a server of several models give memory back when it unloads one? One `ember serve` with two
or more models; the first stays loaded, and each other one is loaded (a chat request to it) and
unloaded (Ollama's `keep_alive: 0`) cycle after cycle.

    python bench/models_memory.py [--model PATH ...] [--cycles 5] [--json FILE]
        [--serve-arg=--dtype=float32 ...]

The first model is the default GGUF; `--model` adds the others (default: the default GGUF again,
under a second name, which still loads a worker of its own). The server's resident memory is the
server process and every process under it, RSS summed (USS and PSS too, from each process's
smaps). It is read once the first model has answered a request (the baseline), then in every
cycle before a model loads, once it has answered, and once /health shows it `unloaded` and its
worker process has gone. PASS when every reading after an unload is within 10% of the reading
before that load and of the baseline (so nothing creeps from cycle to cycle); exit status 1 else.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from ember.bench.serve_process import serving
from ember.loaders.default_model import default_model_path

MIB = 2**20
TOLERANCE = 0.10
LOAD_TIMEOUT_S = 600


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    role: str  # "server", "worker of NAME", or the process's name
    rss: int
    uss: int | None  # None where smaps cannot be read
    pss: int | None


@dataclass(frozen=True)
class Reading:
    label: str
    processes: list[ProcessMemory]

    def total(self, field: str) -> int | None:
        values = [getattr(process, field) for process in self.processes]
        return None if None in values else sum(values)

    @property
    def server_rss(self) -> int:
        return next(process.rss for process in self.processes if process.role == "server")


@dataclass(frozen=True)
class Cycle:
    number: int
    model: str
    before: Reading
    loaded: Reading
    unloaded: Reading

    def ratio(self, reference: Reading) -> float:
        return self.unloaded.total("rss") / reference.total("rss")


class Server:
    """The running server's /health, its models' worker processes and its process tree's memory."""

    def __init__(self, http: httpx.Client, pid: int) -> None:
        self.http, self.pid = http, pid

    def models(self) -> dict[str, dict[str, Any]]:
        return {entry["model"]: entry for entry in self.http.get("/health").json()["models"]}

    def read(self, label: str) -> Reading:
        workers = {entry["worker_pid"]: f"worker of {name}" for name, entry in self.models().items()
                   if entry.get("worker_pid")}
        server = psutil.Process(self.pid)
        processes = []
        for process in [server, *server.children(recursive=True)]:
            try:
                role = "server" if process.pid == self.pid else workers.get(process.pid, process.name())
                processes.append(_memory(process, role))
            except psutil.NoSuchProcess:
                continue
        return Reading(label, processes)

    def ask(self, model: str) -> None:
        """A short greedy chat request, retried while the model is still loading (503)."""
        body = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
                "temperature": 0}
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            reply = self.http.post("/v1/chat/completions", json=body)
            if reply.status_code != 503 or time.monotonic() > deadline:
                reply.raise_for_status()
                return
            time.sleep(1)

    def unload(self, model: str) -> None:
        """Ollama's keep_alive 0, then wait until /health shows the model unloaded and its worker gone."""
        worker = self.models()[model].get("worker_pid")
        self.http.post("/api/generate", json={"model": model, "keep_alive": 0}).raise_for_status()
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while self.models()[model]["state"] != "unloaded" or (worker and _alive(worker)):
            if time.monotonic() > deadline:
                raise SystemExit(f"{model} was not unloaded in {LOAD_TIMEOUT_S} s: {self.models()[model]}")
            time.sleep(0.2)


def _memory(process: psutil.Process, role: str) -> ProcessMemory:
    try:
        full = process.memory_full_info()  # smaps_rollup on Linux: rss, uss, pss
        return ProcessMemory(process.pid, role, full.rss, full.uss, getattr(full, "pss", None))
    except psutil.AccessDenied:
        return ProcessMemory(process.pid, role, process.memory_info().rss, None, None)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def models_file(folder: Path, paths: list[str]) -> tuple[Path, list[str]]:
    """A --models-config file serving `paths` as model-1, model-2, ... (the same file may come twice)."""
    names = [f"model-{i}" for i in range(1, len(paths) + 1)]
    config = folder / "models.toml"
    config.write_text("".join(f"[models.{name}]\nmodel = {json.dumps(path)}\n\n" for name, path in zip(names, paths)))
    return config, names


def measure(server: Server, names: list[str], cycles: int, settle_s: float) -> tuple[Reading, list[Cycle]]:
    first, others = names[0], names[1:]
    server.ask(first)  # the request path warmed on the model that stays, before the baseline
    time.sleep(settle_s)
    baseline = server.read("baseline")
    results = []
    for number in range(1, cycles + 1):
        for name in others:
            before = server.read(f"cycle {number}: before loading {name}")
            server.ask(name)
            loaded = server.read(f"cycle {number}: {name} loaded")
            server.unload(name)
            time.sleep(settle_s)
            unloaded = server.read(f"cycle {number}: {name} unloaded")
            results.append(Cycle(number, name, before, loaded, unloaded))
            print(f"cycle {number} {name}: {_mib(before.total('rss'))} -> {_mib(loaded.total('rss'))} -> "
                  f"{_mib(unloaded.total('rss'))} MiB", file=sys.stderr, flush=True)
    return baseline, results


def table(baseline: Reading, cycles: list[Cycle]) -> str:
    columns = ("cycle", "model", "before load", "loaded", "after unload", "after / before", "after / baseline",
               "server process before -> after", "USS after", "PSS after")
    rows = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for cycle in cycles:
        rows.append(f"| {cycle.number} | {cycle.model} | {_mib(cycle.before.total('rss'))} | "
                    f"{_mib(cycle.loaded.total('rss'))} | {_mib(cycle.unloaded.total('rss'))} | "
                    f"{cycle.ratio(cycle.before):.3f} | {cycle.ratio(baseline):.3f} | "
                    f"{_mib(cycle.before.server_rss)} -> {_mib(cycle.unloaded.server_rss)} | "
                    f"{_mib(cycle.unloaded.total('uss'))} | {_mib(cycle.unloaded.total('pss'))} |")
    processes = ", ".join(f"{process.role} {_mib(process.rss)}" for process in baseline.processes)
    return (f"baseline: {_mib(baseline.total('rss'))} MiB RSS, {_mib(baseline.total('uss'))} MiB USS, "
            f"{_mib(baseline.total('pss'))} MiB PSS ({processes}); figures in MiB, RSS summed over the server "
            f"and every process under it\n\n" + "\n".join(rows))


def verdict(baseline: Reading, cycles: list[Cycle]) -> tuple[bool, float]:
    """Whether every unload came back within the tolerance; the worst ratio."""
    worst = max(max(cycle.ratio(cycle.before), cycle.ratio(baseline)) for cycle in cycles)
    return worst <= 1 + TOLERANCE, worst


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=[],
                        help="one more model to load and unload, as `ember serve` takes it (repeatable; default: "
                             "the default GGUF under a second name)")
    parser.add_argument("--cycles", type=int, default=5, help="load and unload cycles (default 5)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds to wait before a reading (default 2)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--json", help="write the readings here")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more flag for ember serve")
    args = parser.parse_args()
    paths = [str(default_model_path()), *(args.model or [str(default_model_path())])]
    with tempfile.TemporaryDirectory() as folder:
        config, names = models_file(Path(folder), paths)
        flags = ["--models-config", str(config), "--max-model-len", str(args.max_model_len), "--log-level",
                 "warning", *args.serve_arg]
        with serving(flags) as (proc, url), httpx.Client(base_url=url, timeout=LOAD_TIMEOUT_S) as http:
            baseline, cycles = measure(Server(http, proc.pid), names, args.cycles, args.settle)
    passed, worst = verdict(baseline, cycles)
    print(table(baseline, cycles))
    print(f"\n{'PASS' if passed else 'FAIL'}: the worst reading after an unload is {worst:.3f}x its reference "
          f"(allowed: {1 + TOLERANCE:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "models": dict(zip(names, paths)), "baseline": asdict(baseline),
            "cycles": [asdict(cycle) for cycle in cycles], "worst_ratio": worst, "passed": passed}, indent=2) + "\n")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
