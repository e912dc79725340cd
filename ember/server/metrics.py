"""Prometheus metrics, every name prefixed `ember:`.

Request metrics are observed when each HTTP request ends. Engine gauges and counters come from
one statistics snapshot per scrape, through a custom collector, so the engine's growing totals
are exposed as true counters. No label carries a key, a prompt or a request id: labels are the
route (the dialect), the HTTP status, the finish reason and, with API keys, the tenant (a name
from the key file, so a bounded set).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ember.server.request_record import RequestRecord
from ember.server.request_events import finish_label

_REMEMBERED_SESSIONS = 4096  # sessions kept to tell a new one from a returning one
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5)
# The route label of the other routes: a fixed set, since a path may be anything a client sends.
_ROUTE_LABELS = {"/health": "health", "/v1/health": "health", "/healthz": "health", "/metrics": "metrics",
                 "/v1/models": "models", "/openapi.json": "openapi", "/debug/requests": "debug",
                 "/v1/messages/count_tokens": "count_tokens", "/v1/responses/input_tokens": "input_tokens",
                 "/tokenize": "tokenize", "/detokenize": "detokenize"}

# name -> (EngineStats field, help)
ENGINE_GAUGES = {
    "ember:num_sequences_running": ("num_running", "Sequences the engine is running (a request with n choices runs n)"),
    "ember:num_sequences_waiting": ("num_waiting", "Sequences waiting inside the engine"),
    "ember:num_sequences_paused": ("num_paused", "Sequences the engine skips until their stream's reader catches up"),
    "ember:kv_cache_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool"),
    "ember:kv_cache_blocks_used": ("kv_blocks_used", "KV cache blocks held by live sequences"),
    "ember:kv_cache_blocks_cached": ("kv_blocks_cached", "KV cache blocks no sequence holds that keep reusable prefixes"),
    "ember:kv_cache_blocks_pinned": ("kv_blocks_pinned", "KV cache blocks kept by cache breakpoints (held or not)"),
}
# name (without _total) -> (EngineStats field, help)
ENGINE_COUNTERS = {
    "ember:prompt_tokens": ("admitted_prompt_tokens", "Prompt tokens of admitted sequences, prefix cache hits included"),
    "ember:prompt_tokens_cached": ("cached_prompt_tokens", "Prompt tokens found in the prefix cache at admission"),
    "ember:prompt_tokens_computed": ("prompt_tokens", "Prompt tokens computed (prefix cache hits excluded)"),
    "ember:generation_tokens": ("generation_tokens", "Tokens generated"),
    "ember:prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "ember:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "ember:num_preemptions": ("num_preemptions", "Sequences preempted, for KV cache blocks or for foreground requests"),
    "ember:engine_steps": ("num_steps", "Engine steps run"),
    "ember:prefill_seconds": ("prefill_seconds", "Engine step time spent on prefill tokens"),
    "ember:decode_seconds": ("decode_seconds", "Engine step time spent on decode tokens"),
    "ember:spec_decode_rounds": ("spec_rounds", "Speculative decoding: rounds of drafted tokens verified"),
    "ember:spec_decode_draft_tokens": ("spec_proposed_tokens", "Speculative decoding: tokens drafted"),
    "ember:spec_decode_accepted_tokens": ("spec_accepted_tokens", "Speculative decoding: drafted tokens accepted"),
}

# The tiers behind the KV pool, each sample labelled tier="host" or "disk" (a key only the disk
# tier has, only "disk"): name -> (CacheTiers.stats() key, help); counters without _total
TIER_GAUGES = {
    "ember:kv_cache_tier_bytes": ("bytes", "Bytes of KV blocks the tier holds"),
    "ember:kv_cache_tier_blocks": ("blocks", "KV blocks the tier holds"),
    "ember:kv_cache_tier_capacity_bytes": ("capacity_bytes", "The most bytes the tier holds"),
    "ember:kv_cache_tier_enabled": ("enabled", "1 while the disk tier can be written, 0 once it turned itself off"),
}
TIER_COUNTERS = {
    "ember:kv_cache_tier_hits": ("hits", "KV blocks a prompt asked of the tier and found there"),
    "ember:kv_cache_tier_misses": ("misses", "KV blocks a prompt asked of the tier and did not find"),
    "ember:kv_cache_tier_evictions": ("evictions", "KV blocks the tier dropped to stay within its capacity"),
    "ember:kv_cache_tier_read_seconds": ("read_seconds", "Time spent copying the tier's blocks into the pool "
                                                         "(the host's) or reading them from files (the disk's)"),
    "ember:kv_cache_tier_write_seconds": ("write_seconds", "Time spent copying blocks out of the pool (the host's) "
                                                           "or writing them to files (the disk's)"),
    "ember:kv_cache_tier_corrupt_blocks": ("corrupt", "Block files found damaged or foreign, and deleted"),
    "ember:kv_cache_tier_dropped_writes": ("dropped_writes", "KV blocks not written to disk because the writer "
                                                             "was too far behind"),
}


class LiveCollector:
    """Yields the admission gauges and one engine snapshot's metrics at each scrape."""

    def __init__(self) -> None:
        self.admission: Any = None
        self.engine_stats: dict[str, Any] | None = None
        self.worker: dict[str, Any] = {}  # the engine worker's pid and restarts (none in process)
        self.models: list[dict[str, Any]] = []  # every model's state (server.model_pool.ModelPool.model_states)

    def describe(self) -> list[Metric]:
        return []  # the names depend on whether the engine answered; skip the registry's name check

    def collect(self) -> Iterator[Metric]:
        if self.models:
            states = GaugeMetricFamily("ember:model_state", "1 for each model's present state (unloaded, loading, "
                                       "ready, unloading, failed)", labels=("model", "state"))
            for entry in self.models:
                states.add_metric((entry["model"], entry["state"]), 1)
            yield states
        if self.admission is not None:
            yield GaugeMetricFamily("ember:num_requests_running", "HTTP requests admitted and running",
                                    value=self.admission.num_running)
            yield GaugeMetricFamily("ember:num_requests_waiting", "HTTP requests waiting for a slot",
                                    value=self.admission.num_waiting)
        workers = self.worker.get("workers")
        if workers is not None:  # data parallel: every engine metric once per worker, labelled
            yield from _worker_metrics(workers)
            return
        if self.worker.get("worker_pid") is not None:
            yield GaugeMetricFamily("ember:engine_worker_pid", "Process id of the engine worker",
                                    value=self.worker["worker_pid"])
        if "worker_restarts" in self.worker:
            yield CounterMetricFamily("ember:engine_worker_restarts", "Times the engine worker was started again "
                                      "after a fault", value=self.worker["worker_restarts"])
            yield _exit_metric([((), self.worker["worker_exits"])], ())
        if self.engine_stats:
            yield from _engine_metrics([((), self.engine_stats)], ())


def _engine_metrics(snapshots: list[tuple[tuple[str, ...], dict[str, Any]]], labels: tuple[str, ...]
                    ) -> Iterator[Metric]:
    """The engine gauges and counters, one sample per (label values, EngineStats as a dict)."""
    def family(kind, name: str, text: str, value_of) -> Metric:
        metric = kind(name, text, labels=labels)
        for label_values, stats in snapshots:
            metric.add_metric(label_values, value_of(stats))
        return metric

    for name, (field, text) in ENGINE_GAUGES.items():
        yield family(GaugeMetricFamily, name, text, lambda stats: stats[field])
    yield family(GaugeMetricFamily, "ember:kv_cache_usage_ratio", "Share of KV cache blocks in use, 0 to 1",
                 lambda stats: stats["kv_blocks_used"] / stats["kv_blocks_total"] if stats["kv_blocks_total"] else 0.0)
    for name, (field, text) in ENGINE_COUNTERS.items():
        yield family(CounterMetricFamily, name, text, lambda stats: stats[field])
    yield from _tier_metrics(snapshots, labels)


def _tier_metrics(snapshots: list[tuple[tuple[str, ...], dict[str, Any]]], labels: tuple[str, ...]
                  ) -> Iterator[Metric]:
    """The tiers behind the KV pool, one sample per snapshot and tier that is on; none when no tier is."""
    tiers = [(label_values + (tier,), values) for label_values, stats in snapshots
             for tier, values in stats["cache_tiers"].items()]
    if not tiers:
        return

    def family(kind, name: str, text: str, key: str) -> Metric:
        metric = kind(name, text, labels=labels + ("tier",))
        for label_values, values in tiers:
            if key in values:
                metric.add_metric(label_values, float(values[key]))
        return metric

    for name, (key, text) in TIER_GAUGES.items():
        yield family(GaugeMetricFamily, name, text, key)
    for name, (key, text) in TIER_COUNTERS.items():
        yield family(CounterMetricFamily, name, text, key)


def _exit_metric(exits: list[tuple[tuple[str, ...], dict[str, int]]], labels: tuple[str, ...]) -> Metric:
    """Engine workers stopped, by cause (engine.supervisor.WorkerExit), one sample per (label values, cause)."""
    metric = CounterMetricFamily("ember:engine_worker_exits", "Engine workers that stopped, by cause: crashed (a "
                                 "signal or exit status), fault (a step raised), stalled (no progress for "
                                 "--worker-stall-timeout: killed), load (a restart failed to load)",
                                 labels=labels + ("cause",))
    for label_values, by_cause in exits:
        for cause, count in sorted(by_cause.items()):
            metric.add_metric(label_values + (cause,), count)
    return metric


def _worker_metrics(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    """Under data parallelism (engine.router): each worker's process, routing and engine metrics,
    labelled worker="0", "1", ..."""
    def family(kind, name: str, text: str, key: str) -> Metric:
        metric = kind(name, text, labels=("worker",))
        for worker in workers:
            if worker[key] is not None:
                metric.add_metric((str(worker["worker"]),), worker[key])
        return metric

    yield family(GaugeMetricFamily, "ember:engine_worker_pid", "Process id of the engine worker", "worker_pid")
    yield family(CounterMetricFamily, "ember:engine_worker_restarts",
                 "Times the engine worker was started again after a fault", "worker_restarts")
    yield _exit_metric([((str(worker["worker"]),), worker["worker_exits"]) for worker in workers], ("worker",))
    up = GaugeMetricFamily("ember:engine_worker_up", "1 while the engine worker serves, else 0", labels=("worker",))
    for worker in workers:
        up.add_metric((str(worker["worker"]),), 1 if worker["status"] == "ok" else 0)
    yield up
    yield family(GaugeMetricFamily, "ember:router_requests_running", "Requests the router has running on the worker",
                 "requests_running")
    yield family(CounterMetricFamily, "ember:router_requests", "Requests the router sent to the worker",
                 "requests_routed")
    yield family(CounterMetricFamily, "ember:router_cached_prompt_tokens",
                 "Prompt tokens the worker's prefix cache held when the router chose it", "routed_cached_tokens")
    yield family(GaugeMetricFamily, "ember:router_cached_blocks",
                 "Prefix blocks the worker reported cached", "cached_blocks")
    yield from _engine_metrics([((str(w["worker"]),), w["stats"]) for w in workers if w["stats"]], ("worker",))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.live = LiveCollector()
        r.register(self.live)
        self.info = Info("ember:model", "The served model and the engine's settings", registry=r)
        self.http_requests = Counter("ember:http_requests", "HTTP requests answered", ["route", "status"],
                                     registry=r)
        # models are the configured ones, a bounded set
        self.model_requests = Counter("ember:model_requests", "HTTP requests routed to a model, by its public id",
                                      ["model", "route", "status"], registry=r)
        self.tenant_requests = Counter("ember:tenant_requests", "HTTP requests answered, by the tenant of their key",
                                       ["tenant", "route", "status"], registry=r)
        # Sessions are unbounded in number, so they are counted, never a label (the request log names each)
        self.session_requests = Counter("ember:session_requests", "Generation requests that named a session "
                                        "(prompt_cache_key or X-Session-Id)", ["route"], registry=r)
        self.sessions_seen = Counter("ember:sessions", "Sessions seen for the first time (of the last "
                                     f"{_REMEMBERED_SESSIONS} remembered)", registry=r)
        self._recent_sessions: OrderedDict[str, None] = OrderedDict()
        self.finished = Counter("ember:requests_finished", "Generation requests that ran and ended",
                                ["route", "finished_reason"], registry=r)
        self.ttft = Histogram("ember:time_to_first_token_seconds", "From arrival to the first generated token",
                              ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("ember:time_per_output_token_seconds",
                              "Mean time between a choice's tokens after its first", ["route"],
                              buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.queue = Histogram("ember:request_queue_time_seconds", "From arrival to the engine's first step for it",
                               ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ember:e2e_request_latency_seconds", "From arrival to the end of the response",
                             ["route"], buckets=_LATENCY_BUCKETS, registry=r)

    def set_info(self, labels: dict[str, Any]) -> None:
        self.info.info({name: ",".join(value) if isinstance(value, (list, tuple)) else str(value)
                        for name, value in labels.items() if value is not None})

    def observe(self, record: RequestRecord) -> None:
        route = record.route or route_label(record.path)
        self.http_requests.labels(route, str(record.status or 0)).inc()
        if record.model is not None:
            self.model_requests.labels(record.model, route, str(record.status or 0)).inc()
        if record.tenant is not None:
            self.tenant_requests.labels(record.tenant, route, str(record.status or 0)).inc()
        if record.admitted is None:  # not a generation request, or refused before it ran
            return
        if record.session is not None:
            self._count_session(record.session, route)
        self.finished.labels(route, finish_label(record)).inc()
        self.e2e.labels(route).observe(record.elapsed())
        result = record.result
        if result is None:
            return
        if any(c.timings is not None and c.timings.scheduled is not None for c in result.choices):
            self.queue.labels(route).observe(result.timings()["queue_ms"] / 1000.0)
        first = result.first_token_time()
        if first is not None:
            self.ttft.labels(route).observe(max(first - record.received, 0.0))
        for choice in result.choices:
            stamps = choice.timings
            if stamps is None or stamps.first_token is None or stamps.finished is None or len(choice.token_ids) < 2:
                continue
            self.tpot.labels(route).observe(max(stamps.finished - stamps.first_token, 0.0)
                                            / (len(choice.token_ids) - 1))

    def _count_session(self, session: str, route: str) -> None:
        self.session_requests.labels(route).inc()
        if session in self._recent_sessions:
            self._recent_sessions.move_to_end(session)
            return
        self.sessions_seen.inc()
        self._recent_sessions[session] = None
        if len(self._recent_sessions) > _REMEMBERED_SESSIONS:
            self._recent_sessions.popitem(last=False)

    def render(self, admission, engine_stats: dict[str, Any] | None, worker: dict[str, Any] | None = None,
               models: list[dict[str, Any]] | None = None) -> bytes:
        """The text exposition, with the gauges and engine counters as of now."""
        self.live.admission, self.live.engine_stats, self.live.worker = admission, engine_stats, worker or {}
        self.live.models = models or []
        try:
            return generate_latest(self.registry)
        finally:
            self.live.engine_stats = None


def route_label(path: str) -> str:
    if path.startswith("/v1/models/"):
        return "models"
    if path.startswith("/v1/responses/") and path not in _ROUTE_LABELS:
        return "responses_store"  # retrieve, delete, input items, and the refused cancel and compact
    return _ROUTE_LABELS.get(path, "other")
