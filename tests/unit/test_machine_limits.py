"""The machine-limits probe (ember.bench.machine_probe) and the speeds `ember bench` prints against it.

The probe runs for real, scaled down; its figures are only checked to exist, never for size.
"""

from __future__ import annotations

import json

import pytest
import torch

from ember.bench.config import BenchConfig, Level
from ember.bench.limits import Bounds, MachineLimits, cache_bytes_read, decode_share
from ember.bench.machine_probe import probe
from ember.bench.records import RequestRecord
from ember.bench.report import format_report
from ember.bench.result import BenchResult, LevelResult
from ember.bench.stats import summarize
from ember.bench.workload import Calibration


@pytest.fixture(scope="module")
def small_probe() -> MachineLimits:
    return probe(threads=1, read_mib=32, repeat=1, compute_scale=0.05)


def test_the_probe_measures_every_figure_on_the_threads_asked_and_restores_the_count(small_probe):
    before = torch.get_num_threads()
    assert small_probe.threads == 1 and torch.get_num_threads() == before
    assert small_probe.read_gb_per_s > 0 and small_probe.bf16_gflops > 0 and small_probe.seconds > 0
    from ember import kernels
    assert (small_probe.int8_gops > 0) == kernels.available()
    assert small_probe.read_method == ("ember's int8 kernel" if kernels.available()
                                       else "torch sum, without ember's kernels")
    assert "machine limits (1 threads)" in small_probe.describe()
    assert json.loads(json.dumps(small_probe.to_json()))["threads"] == 1


def test_bounds_divide_the_limits_by_the_model_weights():
    limits = MachineLimits(threads=2, read_gb_per_s=20.0, read_method="x", int8_gops=400.0, bf16_gflops=100.0,
                           seconds=1.0)
    bounds = Bounds(limits, weight_bytes=200 * 10**6, num_weights=100 * 10**6)
    assert bounds.decode_tokens_per_s == pytest.approx(100.0)  # 20 GB/s over 0.2 GB a token
    assert bounds.compute_tokens_per_s == pytest.approx(2000.0)  # 400 GOP/s over 2 x 100 M a token
    assert decode_share(bounds, 1, 50.0) == pytest.approx(0.5)
    assert decode_share(bounds, 32, 500.0) == pytest.approx(0.25)
    assert decode_share(bounds, None, 500.0) == pytest.approx(0.25)  # an open loop: many streams
    # a long context's keys and values are read beside the weights: 50 tok/s over 0.4 GB a step
    assert bounds.of_read(50.0, cache_bytes=200 * 10**6) == pytest.approx(1.0)
    assert json.loads(json.dumps(bounds.to_json()))["decode_tokens_per_s"] == pytest.approx(100.0)


def test_a_decode_step_reads_each_layers_keys_up_to_its_window():
    assert cache_bytes_read([], 30, 768, 8000) == 30 * 8000 * 768  # no layer has a window
    # Gemma 3 270M's shape: five local layers of 512 keys to each global one
    windows = [None if (layer + 1) % 6 == 0 else 512 for layer in range(18)]
    assert cache_bytes_read(windows, 18, 1024, 8000) == (15 * 512 + 3 * 8000) * 1024
    assert cache_bytes_read(windows, 18, 1024, 100) == 18 * 100 * 1024  # a context inside every window


def _level(index: int, concurrency: int, prompt_tokens: int, ttft: float, gap: float) -> LevelResult:
    """Four requests of 9 output tokens, the first after `ttft` and the rest `gap` apart."""
    records = []
    for number in range(4):
        record = RequestRecord(f"r{index}-{number}", index, number, prompt_tokens, 9)
        record.sent, record.status, record.outcome = 0.0, 200, "ok"
        record.chunk_times = [ttft + gap * i for i in range(9)]
        record.ended = record.chunk_times[-1]
        record.prompt_tokens, record.completion_tokens = prompt_tokens, 9
        records.append(record)
    return LevelResult(index, Level(concurrency=concurrency), 0.0, records, None,
                       summarize(records, max(r.ended for r in records)))


def test_the_report_prints_each_level_against_its_bound(small_probe):
    config = BenchConfig(base_url="http://x", concurrency=[1, 8])
    levels = [_level(0, 1, prompt_tokens=100, ttft=0.5, gap=0.01), _level(1, 8, prompt_tokens=100, ttft=0.5, gap=0.01)]
    bounds = Bounds(small_probe, weight_bytes=10**8, num_weights=10**8)
    result = BenchResult(config, "offline engine", "m", Calibration(1.0, 0.0), levels, bounds)
    report = format_report(result)
    assert small_probe.describe() in report
    one_stream = next(line for line in report.splitlines() if "decode (1 / TPOT p50)" in line)
    assert one_stream.split()[-1] == f"{decode_share(bounds, 1, 100.0):.0%}"  # 10 ms a token
    prefill = next(line for line in report.splitlines() if "prefill (prompt / TTFT p50)" in line)
    assert prefill.split()[-1] == f"{bounds.of_int8(200.0):.0%}"  # 100 tokens in 0.5 s
    many = next(line for line in report.splitlines() if "output" in line and line.split()[-1].endswith("%"))
    assert many.split()[-1] == f"{bounds.of_int8(levels[1].summary.output_tokens_per_s):.0%}"
    assert json.loads(json.dumps(result.to_json()))["bounds"]["num_weights"] == 10**8
    assert "against the machine's limits" not in format_report(BenchResult(config, "t", "m", Calibration(1.0, 0.0),
                                                                           levels))
