"""The periodic throughput line on stderr (`--log-stats-interval`), and its `throughput` event in
the request log. Quiet while the server is idle: an interval with no tokens and nothing running
or waiting writes nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger("ember.stats")


class ThroughputReporter:
    """One line per loaded model and interval (naming the model when the server has several)."""

    def __init__(self, pool, interval: float, request_log=None) -> None:
        self.pool = pool
        self.interval = interval
        self.request_log = request_log
        self._last: dict[int, tuple[dict[str, Any], float]] = {}  # id(state) -> its last snapshot and when

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for state in self.pool.states:
                stats = await state.engine_stats()
                if stats is None:
                    self._last.pop(id(state), None)
                    continue
                now = time.monotonic()
                last = self._last.get(id(state))
                if last is not None:
                    model = self.pool.label(state) if self.pool.several else None
                    self.report(last[0], stats, now - last[1], state.admission, model)
                self._last[id(state)] = stats, now

    def report(self, before: dict[str, Any], after: dict[str, Any], seconds: float, admission,
               model: str | None = None) -> dict[str, Any] | None:
        """Log the interval between two engine snapshots; returns what was reported, or None when idle."""
        delta = {name: after[name] - before[name] for name in (
            "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
            "prefill_seconds", "decode_seconds")}
        busy = admission.num_running or admission.num_waiting or after["num_running"] or after["num_waiting"]
        if not busy and not delta["prompt_tokens"] and not delta["generation_tokens"]:
            return None
        seconds = max(seconds, 1e-9)
        kv_usage = after["kv_blocks_used"] / after["kv_blocks_total"] if after["kv_blocks_total"] else 0.0
        hit_rate = (delta["prefix_cache_hits"] / delta["prefix_cache_queries"]
                    if delta["prefix_cache_queries"] else None)
        summary = {
            "interval_seconds": seconds,
            "prompt_tokens_per_second": delta["prompt_tokens"] / seconds,
            "generation_tokens_per_second": delta["generation_tokens"] / seconds,
            "requests_running": admission.num_running, "requests_waiting": admission.num_waiting,
            "sequences_running": after["num_running"], "sequences_waiting": after["num_waiting"],
            "kv_cache_usage": kv_usage, "prefix_cache_hit_rate": hit_rate,
            **{f"{name}_delta": value for name, value in delta.items()},
        }
        if model is not None:
            summary["model"] = model
        logger.info(
            "%sthroughput: prompt %.1f tok/s, generation %.1f tok/s; running %d, waiting %d; KV cache %.1f%% used; "
            "prefix cache hits %s", f"{model}: " if model is not None else "", summary["prompt_tokens_per_second"], summary["generation_tokens_per_second"],
            admission.num_running, admission.num_waiting, 100.0 * kv_usage,
            "-" if hit_rate is None else f"{100.0 * hit_rate:.1f}%")
        if self.request_log is not None:
            self.request_log.write("throughput", **summary)
        return summary
