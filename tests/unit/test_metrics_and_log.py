"""Observability logic without a model: argv redaction, the request log file, prompt progress,
finish labels, the throughput line, the Prometheus exposition, and the KV cache tiers in /health,
metrics and the request log."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember.engine.stats import EngineCounters, EngineStats
from ember.protocols.neutral import RunResult
from ember.protocols.progress import PromptProgress
from ember.server.app import cache_tier_fields
from ember.server.metrics import Metrics
from ember.server.request_record import RequestRecord
from ember.server.request_events import finish_label, log_line, sampling_summary, telemetry, terminal_kind
from ember.server.flags import redact_argv
from ember.server.request_log import REDACTED, RequestLog, RequestLogError
from ember.server.stats_logger import ThroughputReporter
from ember.types import FinishReason, GenerationOutput, RequestTimings, SamplingParams


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--api-key", "k3y-value", "--port", "1"], ["serve", "--api-key", REDACTED, "--port", "1"]),
    (["serve", "--api-key=k3y-value"], ["serve", f"--api-key={REDACTED}"]),
    (["serve", "--api-k", "k3y-value"], ["serve", "--api-k", REDACTED]),
    (["serve", "--served-model-name", "x-k3y-value-y"], ["serve", "--served-model-name", f"x-{REDACTED}-y"]),
    (["serve", "--allow-no-api-key", "--port", "1"], ["serve", "--allow-no-api-key", "--port", "1"]),
])
def test_argv_never_keeps_the_key(argv, expected):
    assert redact_argv(argv, "k3y-value") == expected


def test_the_request_log_appends_one_flushed_json_line_per_event(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "from an earlier run"}\n')
    log = RequestLog.open(str(path))
    log.write("request_start", request_id="a", prompt_tokens=3)
    lines = path.read_text().splitlines()  # readable before close: every event is flushed
    assert len(lines) == 2
    event = json.loads(lines[1])
    assert event["event"] == "request_start" and event["prompt_tokens"] == 3
    assert event["server_instance_id"] == log.server_instance_id and event["time_unix_ms"] > 0
    log.hide("k3y-value")
    log.write("request_done", request_id="x-k3y-value")  # a client may copy the key into a field
    assert "k3y-value" not in path.read_text() and REDACTED in path.read_text()
    log.close()
    log.write("request_done", request_id="a")  # a closed file is reported once, never raised
    with pytest.raises(RequestLogError, match="cannot open the request log"):
        RequestLog.open(str(tmp_path / "missing" / "log.jsonl"))


def _output(new_ids=(), computed=None, finish=None, cached=16, by_tier=None) -> GenerationOutput:
    return GenerationOutput("r", [], list(new_ids), "", list(new_ids), "", None, None, finish, cached,
                            RequestTimings(arrival=1.0, scheduled=1.0), num_computed_prompt_tokens=computed,
                            cached_tokens_by_tier=by_tier)


def test_prompt_progress_starts_at_the_cache_and_ends_at_the_total_with_the_first_token():
    progress = PromptProgress(total=100)
    reports = progress.update(_output(computed=48))
    assert [(r["cache"], r["processed"]) for r in reports] == [(16, 16), (16, 48)]
    assert progress.update(_output(computed=40)) == []  # never backwards
    assert [r["processed"] for r in progress.update(_output(computed=80))] == [80]
    assert [r["processed"] for r in progress.update(_output(new_ids=[5]))] == [100]
    assert progress.update(_output(computed=100)) == [] and progress.update(_output(new_ids=[6])) == []
    assert all(r["total"] == 100 for r in reports)


def test_prompt_progress_of_a_request_that_fails_before_its_first_token():
    progress = PromptProgress(total=50)
    assert progress.update(_output(finish=FinishReason.ERROR)) == []
    assert progress.update(_output(new_ids=[1])) == []


def _record(*reasons, admitted=True, client_gone=False) -> RequestRecord:
    record = RequestRecord("POST", "/v1/chat/completions", "id")
    record.route, record.admitted, record.client_gone = "chat", 1.0 if admitted else None, client_gone
    record.result = RunResult(len(reasons), [1, 2])
    for choice, reason in zip(record.result.choices, reasons):
        choice.finish_reason = reason
    record.result.num_finished = sum(r is not None for r in reasons)
    return record


def test_one_finish_label_and_terminal_event_per_request():
    assert finish_label(_record(FinishReason.STOP, FinishReason.LENGTH)) == "length"
    assert finish_label(_record(FinishReason.STOP, FinishReason.ERROR)) == "error"
    assert finish_label(_record(FinishReason.STOP, None, client_gone=True)) == "abort"
    assert terminal_kind(_record(FinishReason.STOP)) == "request_done"
    assert terminal_kind(_record(None, client_gone=True)) == "request_error"
    assert terminal_kind(_record(FinishReason.ABORT)) == "request_error"


def test_sampling_summary_counts_stop_strings_without_showing_them():
    summary = sampling_summary(SamplingParams(stop=["SECRET-STOP"], logit_bias={5: 1.0}, seed=3))
    assert summary["num_stop_strings"] == 1 and summary["num_logit_bias"] == 1 and summary["seed"] == 3
    assert "SECRET-STOP" not in json.dumps(summary)


def _stats(**values):
    base = dict(prompt_tokens=0, generation_tokens=0, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                prefill_seconds=0.0, decode_seconds=0.0, num_running=0, num_waiting=0, num_paused=0, kv_blocks_used=0,
                kv_blocks_total=100, spec_rounds=0, spec_proposed_tokens=0, spec_accepted_tokens=0, cache_tiers={})
    return {**base, **values}


def test_the_throughput_line_is_quiet_when_idle(caplog):
    admission = SimpleNamespace(num_running=0, num_waiting=0)
    reporter = ThroughputReporter(SimpleNamespace(states=[]), 10.0)
    with caplog.at_level(logging.INFO, logger="ember.stats"):
        assert reporter.report(_stats(), _stats(), 10.0, admission) is None
        summary = reporter.report(_stats(), _stats(prompt_tokens=200, generation_tokens=50, prefix_cache_queries=80,
                                                   prefix_cache_hits=20, kv_blocks_used=25, num_running=1), 10.0,
                                  admission)
    assert summary["prompt_tokens_per_second"] == 20.0 and summary["generation_tokens_per_second"] == 5.0
    assert summary["prefix_cache_hit_rate"] == 0.25 and summary["kv_cache_usage"] == 0.25
    assert [r.getMessage() for r in caplog.records] == [
        "throughput: prompt 20.0 tok/s, generation 5.0 tok/s; running 0, waiting 0; KV cache 25.0% used; "
        "prefix cache hits 25.0%"]


def test_metrics_expose_engine_totals_as_counters_under_the_ember_prefix():
    metrics = Metrics()
    admission = SimpleNamespace(num_running=2, num_waiting=1)
    engine = {**_stats(prompt_tokens=7, generation_tokens=9, kv_blocks_used=50), "admitted_prompt_tokens": 12,
              "cached_prompt_tokens": 5, "kv_blocks_cached": 3, "kv_blocks_pinned": 2, "num_steps": 4}
    text = metrics.render(admission, engine).decode()
    assert "ember:kv_cache_blocks_pinned 2.0" in text
    assert "# TYPE ember:generation_tokens_total counter" in text and "ember:generation_tokens_total 9.0" in text
    assert "ember:prompt_tokens_total 12.0" in text and "ember:kv_cache_usage_ratio 0.5" in text
    assert "ember:num_requests_running 2.0" in text
    without_engine = metrics.render(admission, None).decode()
    assert "ember:num_requests_waiting 1.0" in without_engine and "generation_tokens" not in without_engine
    names = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert names and all(name.startswith("ember:") for name in names)


def _engine_stats(cache_tiers: dict) -> dict:
    """A whole EngineStats snapshot, as /metrics receives it."""
    return asdict(EngineStats.build(EngineCounters(), num_running=0, num_waiting=0, num_prefilling=0,
                                    kv_blocks_total=10, kv_blocks_used=0, kv_blocks_cached=0, kv_blocks_pinned=0,
                                    prefix_cache_queries=0, prefix_cache_hits=0, cache_tiers=cache_tiers))


def _tier_stats(**values):
    return {"bytes": 4096, "blocks": 2, "capacity_bytes": 65536, "evictions": 1, "hits": 5, "misses": 3,
            "read_seconds": 0.25, "write_seconds": 0.5, **values}


TIERS = {"host": _tier_stats(), "disk": _tier_stats(bytes=8192, blocks=4, hits=2, enabled=True, corrupt=1,
                                                    dropped_writes=0)}


def metric_samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label pairs): value} of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_expose_each_cache_tier_by_label():
    metrics = Metrics()
    admission = SimpleNamespace(num_running=0, num_waiting=0)
    samples = metric_samples(metrics.render(admission, _engine_stats(TIERS)).decode())
    assert samples[("ember:kv_cache_tier_bytes", (("tier", "host"),))] == 4096
    assert samples[("ember:kv_cache_tier_bytes", (("tier", "disk"),))] == 8192
    assert samples[("ember:kv_cache_tier_capacity_bytes", (("tier", "host"),))] == 65536
    assert samples[("ember:kv_cache_tier_hits_total", (("tier", "disk"),))] == 2
    assert samples[("ember:kv_cache_tier_misses_total", (("tier", "host"),))] == 3
    assert samples[("ember:kv_cache_tier_evictions_total", (("tier", "host"),))] == 1
    assert samples[("ember:kv_cache_tier_write_seconds_total", (("tier", "host"),))] == 0.5
    # what only the disk tier has is reported for it alone
    assert samples[("ember:kv_cache_tier_corrupt_blocks_total", (("tier", "disk"),))] == 1
    assert samples[("ember:kv_cache_tier_enabled", (("tier", "disk"),))] == 1
    assert ("ember:kv_cache_tier_corrupt_blocks_total", (("tier", "host"),)) not in samples
    without_tiers = metrics.render(admission, _engine_stats({})).decode()
    assert "kv_cache_tier" not in without_tiers


def test_metrics_label_each_workers_tiers_under_data_parallelism():
    worker = {"status": "ok", "worker_pid": 10, "worker_restarts": 0, "requests_running": 0, "requests_routed": 1,
              "routed_cached_tokens": 0, "cached_blocks": 0, "worker_exits": {}}
    workers = [{**worker, "worker": 0, "stats": _engine_stats({"host": _tier_stats(bytes=100)})},
               {**worker, "worker": 1, "stats": _engine_stats({"host": _tier_stats(bytes=200)}),
                "worker_restarts": 1, "worker_exits": {"stalled": 1}}]
    text = Metrics().render(SimpleNamespace(num_running=0, num_waiting=0), None, {"workers": workers}).decode()
    samples = metric_samples(text)
    assert samples[("ember:kv_cache_tier_bytes", (("tier", "host"), ("worker", "0")))] == 100
    assert samples[("ember:kv_cache_tier_bytes", (("tier", "host"), ("worker", "1")))] == 200
    assert samples[("ember:engine_worker_exits_total", (("cause", "stalled"), ("worker", "1")))] == 1
    assert not any(name == "ember:engine_worker_exits_total" and ("worker", "0") in labels for name, labels in samples)


def test_health_names_the_tiers_fields_with_zeros_for_those_off():
    off = cache_tier_fields({})
    assert off == {"cache_bytes": 0, "host_cache_bytes": 0, "host_cache_cap_bytes": 0, "host_cache_evictions": 0,
                   "disk_cache_bytes": 0, "disk_cache_cap_bytes": 0, "disk_cache_enabled": False, "cache_tiers": {}}
    both = cache_tier_fields(TIERS)
    assert both["cache_bytes"] == both["host_cache_bytes"] == 4096 and both["host_cache_cap_bytes"] == 65536
    assert both["host_cache_evictions"] == 1 and both["disk_cache_bytes"] == 8192
    assert both["disk_cache_cap_bytes"] == 65536 and both["disk_cache_enabled"] is True
    assert both["cache_tiers"] == TIERS
    host_only = cache_tier_fields({"host": TIERS["host"]})
    assert host_only["disk_cache_enabled"] is False and host_only["disk_cache_cap_bytes"] == 0


def _served(*by_tier: dict[str, int], batch: bool = False) -> RequestRecord:
    """A finished request whose choices found their cached tokens where `by_tier` says."""
    record = _record(*[None] * len(by_tier))
    record.params = SamplingParams()
    prompts = [[1] * 400 for _ in by_tier] if batch else None
    record.result = RunResult(len(by_tier), [1] * 400, batch_prompt_ids=prompts)
    for index, split in enumerate(by_tier):
        record.result.add(index, _output([7], finish=FinishReason.STOP, cached=sum(split.values()), by_tier=split))
    return record


@pytest.mark.parametrize("by_tier, path", [
    ({"device": 0}, "root"),
    ({"device": 32}, "device"),
    ({"device": 32, "host": 368}, "device+host"),
    ({"device": 0, "host": 16, "disk": 64}, "host+disk"),
    ({"device": 16, "disk": 48}, "device+disk"),
])
def test_the_request_log_says_where_the_reused_prefix_came_from(by_tier, path):
    record = _served(by_tier)
    entry = telemetry(record)
    assert entry["prefix_reuse_path"] == path
    assert entry["cached_tokens_details"] == {tier: by_tier.get(tier, 0) for tier in ("device", "host", "disk")}
    assert sum(entry["cached_tokens_details"].values()) == entry["cached_tokens"]
    assert f"cached={entry['cached_tokens']} reuse={path} " in log_line(record)


def test_a_batch_counts_every_prompts_cached_tokens_by_tier():
    record = _served({"device": 16, "host": 32}, {"device": 0, "disk": 16}, batch=True)
    entry = telemetry(record)
    assert entry["cached_tokens"] == 64
    assert entry["cached_tokens_details"] == {"device": 16, "host": 32, "disk": 16}
    assert entry["prefix_reuse_path"] == "device+host+disk"
