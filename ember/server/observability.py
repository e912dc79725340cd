"""Where a request's life is recorded: Prometheus metrics, the structured request log, the ring of
recent requests behind /debug/requests, and the finished-request count /health reports.

The pipeline calls `request_started` once a request is admitted; the request-context middleware
calls `request_ended` exactly once per HTTP request, however it ended. So every started request
gets exactly one terminal log event, and a request refused before it ran gets `request_rejected`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict
from typing import Any

import ember
from ember.server.metrics import Metrics
from ember.server.request_record import RequestRecord
from ember.server.request_events import start_event, telemetry, terminal_kind
from ember.server.request_log import RequestLog

RECENT_REQUESTS = 100


class Observability:
    def __init__(self, pool, metrics: Metrics, request_log: RequestLog | None = None,
                 argv: list[str] | None = None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.request_log = request_log
        self.argv = list(argv or [])
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self.requests_finished = 0  # generation requests that ran and ended, whatever the outcome
        self.started = False  # server_start is written once, when the first model is ready
        if request_log is not None:
            self._hide(pool.keys.texts())
            pool.keys.listeners.append(self._hide)
        pool.ready_hooks.append(self.model_ready)
        pool.unload_hooks.append(self.model_unloaded)

    def _hide(self, keys: list[str]) -> None:
        for key in keys:
            self.request_log.hide(key)

    # ---- server -------------------------------------------------------------------------------

    def model_ready(self, state) -> None:
        """The first model ready: server_start (and the ember:model info metric, of the first model
        only); any later load of a model: model_loaded."""
        loaded = state.loaded
        identity = model_identity(state, loaded)
        engine = engine_settings(state.config.engine, loaded)
        if state is self.pool.default:
            self.metrics.set_info({**identity, **engine, "batch_invariant": loaded.batch_invariance.get("holds")})
        if self.request_log is None:
            return
        config = state.config
        details = dict(model=identity, engine=engine, memory=memory_budget(loaded),
                       batch_invariance=loaded.batch_invariance, sampling_defaults=sampling_settings(config, loaded),
                       thinking_defaults=thinking_settings(loaded))
        if self.started:
            self.request_log.write("model_loaded", load_seconds=round(state.load_seconds, 3), **details)
            return
        self.started = True
        self.request_log.write(
            "server_start", ember_version=ember.__version__, **details,
            models=[self.pool.label(other) for other in self.pool.states],
            server={
                "host": config.host, "port": config.port, "api_key_required": self.pool.keys.required,
                "max_pending": config.max_pending, "pending_timeout_seconds": config.pending_timeout,
                "max_request_bytes": config.max_request_bytes, "default_max_tokens": config.default_max_tokens,
                "log_stats_interval_seconds": config.log_stats_interval},
            argv=self.argv)

    def model_unloaded(self, state, reason: str) -> None:
        if self.request_log is not None:
            self.request_log.write("model_unloaded", model=self.pool.label(state), reason=reason)

    def close(self) -> None:
        if self.request_log is not None:
            self.request_log.close()

    # ---- requests -----------------------------------------------------------------------------

    def request_started(self, record: RequestRecord, job: Any, params: Any) -> None:
        record.job, record.params, record.admitted = job, params, time.time()
        if self.request_log is not None:
            self.request_log.write("request_start", **start_event(record))

    def request_ended(self, record: RequestRecord) -> None:
        self.metrics.observe(record)
        if record.route is None:  # not a generation route
            return
        if record.admitted is not None:
            self.requests_finished += 1
            event = terminal_kind(record)
        elif record.status is not None and record.status >= 400:
            event = "request_rejected"
        else:
            return
        entry = telemetry(record)
        self.recent.append(entry)
        if self.request_log is not None:
            self.request_log.write(event, **entry)


def model_identity(state, loaded) -> dict[str, Any]:
    model = state.model
    return {"model": model.name, "aliases": list(model.aliases), "source": loaded.name,
            "path": loaded.path or state.config.model, "dtype": loaded.dtype, "max_model_len": loaded.max_model_len,
            "vocab_size": loaded.vocab_size, "fingerprint": state.fingerprint}


def engine_settings(config, loaded) -> dict[str, Any]:
    settings = asdict(config)
    info = loaded.engine.info  # what the engine resolved from "auto" and None
    settings.update(max_model_len=info.max_model_len, device=info.device, dtype=info.dtype,
                    max_num_batched_tokens=info.max_num_batched_tokens,
                    attention_cost_tokens=info.attention_cost_tokens)
    return settings


def sampling_settings(config, loaded) -> dict[str, Any]:
    """The sampling defaults requests start from: the top level (no settled thinking, or no chat)
    and each thinking mode's, as resolved, and the process's own layers over the model's."""
    modes = loaded.mode_sampling_defaults
    return {"default": loaded.sampling_defaults, "thinking": modes.get(True), "non_thinking": modes.get(False),
            "override_generation_config": config.override_generation_config, "flags": config.sampling_flags}


def thinking_settings(loaded) -> dict[str, Any]:
    """The thinking defaults of requests that leave them open (protocols.chat_reply.ChatFeatures)."""
    chat = loaded.chat
    return {"reasoning": chat.think is not None, "default_thinking": chat.default_thinking,
            "default_reasoning_effort": chat.default_reasoning_effort, "efforts": chat.efforts,
            "default_thinking_budget": chat.default_thinking_budget, "preserve_thinking": chat.preserve_thinking,
            "tool_calls": chat.tool_format is not None}


def memory_budget(loaded) -> dict[str, Any]:
    info = loaded.engine.info
    return {"kv_cache_blocks": info.kv_cache_blocks, "block_size": info.block_size,
            "kv_capacity_tokens": info.kv_capacity_tokens, "kv_cache_bytes": info.kv_cache_bytes}
