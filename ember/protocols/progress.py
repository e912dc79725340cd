"""llama.cpp's observation extras on OpenAI streams: `return_progress` (prompt_progress chunks while
the prompt is processed) and `timings_per_token` (running timings on each delta chunk)."""

from __future__ import annotations

import time
from typing import Any

from ember.protocols.fields import Fields
from ember.protocols.neutral import RunResult, per_token_ms
from ember.types import FinishReason, GenerationOutput


def read_stream_extras(f: Fields) -> tuple[bool, bool]:
    """(return_progress, timings_per_token). Both only change streams; a whole response already
    ends with its timings, and has no moment to report progress in."""
    return f.boolean("return_progress", False), f.boolean("timings_per_token", False)


class PromptProgress:
    """The prompt_progress objects of one streamed request.

    The first reports the prefix-cache hit (processed == cache); each prefill chunk the engine
    finishes adds one; the last has processed == total and comes with the first token, before its
    text. `processed` never goes backwards (a recomputation after preemption is not reported).
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.processed: int | None = None
        self.done = False

    def update(self, output: GenerationOutput) -> list[dict[str, Any]]:
        if self.done:
            return []
        if output.new_token_ids or output.finish_reason == FinishReason.LENGTH:  # a token, or a prompt-only end
            processed, self.done = self.total, True
        elif output.finished:  # ended without a token (an error, an abort): nothing more to report
            self.done = True
            return []
        elif output.num_computed_prompt_tokens is not None:
            processed = min(output.num_computed_prompt_tokens, self.total)
        else:
            return []
        cache = min(output.num_cached_tokens, self.total)
        started = output.timings.scheduled
        reports = []
        if self.processed is None:
            reports.append(self._report(cache, cache, 0.0))
            self.processed = cache
        if processed > self.processed:
            elapsed = time.time() - started if started is not None else 0.0
            reports.append(self._report(cache, processed, max(elapsed, 0.0) * 1000.0))
            self.processed = processed
        return reports

    def _report(self, cache: int, processed: int, time_ms: float) -> dict[str, Any]:
        return {"total": self.total, "cache": cache, "processed": processed, "time_ms": time_ms}


def running_timings(result: RunResult) -> dict[str, float | int]:
    """The timings block as of now: while a request runs, generation time runs up to the present."""
    timings = result.timings()
    first = result.first_token_time()
    if result.finished or first is None:
        return timings
    seconds = max(time.time() - first, 0.0)
    decoded = max(timings["predicted_n"] - sum(1 for c in result.choices if c.token_ids), 0)
    timings["predicted_ms"] = seconds * 1000.0
    timings["predicted_per_token_ms"] = per_token_ms(seconds, decoded)
    timings["predicted_per_second"] = decoded / seconds if seconds > 0 else 0.0
    return timings
