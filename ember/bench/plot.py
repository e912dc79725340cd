"""`--plot FILE.png`: throughput and latency against concurrency (or request rate), and TTFT by turn.

matplotlib is an optional extra (`pip install 'ember[plot]'`); `require_matplotlib` is called
before a run starts, so a missing package never costs a finished benchmark.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ember.bench.config import BenchError
from ember.bench.result import BenchResult


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install 'ember[plot]' "
                         "(or pip install matplotlib)")


def write_plot(result: BenchResult, path: str | Path) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multiturn = result.config.workload == "multiturn"
    figure, axes = plt.subplots(1, 3 if multiturn else 2, figsize=(15 if multiturn else 10, 4.2))
    levels = result.levels
    xs = [level.level.x_value for level in levels]
    x_label = "request rate (req/s)" if result.config.request_rates is not None else "concurrency"

    throughput = axes[0]
    throughput.plot(xs, [level.summary.output_tokens_per_s for level in levels], marker="o")
    throughput.set(xlabel=x_label, ylabel="output tok/s", title="aggregate output throughput")

    latency = axes[1]
    for name, pick in (("TTFT p50", lambda s: s.ttft and s.ttft.p50), ("TTFT p99", lambda s: s.ttft and s.ttft.p99),
                       ("ITL p50", lambda s: s.itl and s.itl.p50), ("TPOT p50", lambda s: s.tpot and s.tpot.p50)):
        points = [(x, pick(level.summary)) for x, level in zip(xs, levels)]
        points = [(x, y * 1000) for x, y in points if y is not None]
        if points:
            latency.plot(*zip(*points), marker="o", label=name)
    latency.set(xlabel=x_label, ylabel="ms", title="latency")
    latency.legend()

    if multiturn:
        by_turn = axes[2]
        for level in levels:
            points = [(t.turn, t.ttft.p50 * 1000) for t in level.summary.by_turn or [] if t.ttft is not None]
            if points:
                by_turn.plot(*zip(*points), marker="o", label=level.level.label)
        by_turn.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="time to first token by turn")
        by_turn.legend()

    for axis in axes[:2]:
        if min(xs) > 0 and max(xs) / min(xs) >= 8:  # 1, 4, 16, 32 spread evenly
            axis.set_xscale("log", base=2)
        axis.set_xticks(xs, [f"{x:g}" for x in xs])
        axis.set_ylim(bottom=0)
    if multiturn:
        axes[2].set_xticks(range(1, result.config.turns + 1))
        axes[2].set_ylim(bottom=0)
    for axis in axes:
        axis.grid(alpha=0.3)
    figure.suptitle(f"ember bench: {result.model} at {result.target} ({result.config.endpoint})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
