"""What Ollama's routes share: the model name check, `keep_alive`, error bodies, timestamps, the
closing fields of a reply (done_reason and the durations in nanoseconds) and the NDJSON lines.

Ollama names a model `name[:tag]` with `latest` as the tag left out, so `NAME:latest` stands for a
served NAME. Errors are `{"error": "..."}` with the status ember gives the refusal.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

from ember.errors import EmberError, InvalidRequest
from ember.protocols.errors import ErrorShape, ModelNotFound
from ember.protocols.fields import Fields
from ember.protocols.neutral import ModelInfo, RunResult
from ember.protocols.sse import ServerEvent
from ember.types import FinishReason

LATEST = ":latest"
NS = 1_000_000_000
# Go's time.ParseDuration units, as Ollama reads a keep_alive string.
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# What Go's largest duration adds to now: how Ollama dates a model kept loaded for good.
FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)


def ollama_error_body(error: EmberError, request_id: str | None = None) -> dict[str, Any]:
    return {"error": error.message}


OLLAMA_ERRORS = ErrorShape(body=ollama_error_body, status=lambda error: error.status)


def served_name(name: str, model: ModelInfo) -> str:
    """The name of `model` a request's `model` stands for (its id or an alias, `:latest` allowed);
    404 otherwise. (Which model a name reaches is server.model_pool's; this checks the name against
    the model it reached.)"""
    for candidate in (name, name.removesuffix(LATEST)):
        if model.accepts(candidate):
            return candidate
    raise ModelNotFound(name, model.name)


def read_model(f: Fields, model: ModelInfo) -> str:
    """The request's `model` (required), checked against the served one; returned as sent (replies echo it)."""
    name = f.string("model", non_empty=True)
    if name is None:
        raise InvalidRequest("model is required", param="model")
    served_name(name, model)
    return name


def read_keep_alive(f: Fields) -> float | None:
    """`keep_alive` in seconds (negative: for good), None when absent: how long the model stays
    loaded once idle (server.model_pool). Numbers are seconds; strings are Go durations ("5m",
    "1h30m", "0")."""
    raw = f.raw("keep_alive")
    if raw is None:
        return None
    if isinstance(raw, str):
        return parse_duration(raw)
    return f.number("keep_alive")


def parse_duration(text: str) -> float:
    """A Go duration ("300ms", "1.5h", "2h45m", "-1m", "0") in seconds; 400 naming keep_alive otherwise."""
    body = text[1:] if text[:1] in "+-" else text
    if body == "0":
        return 0.0
    parts = _DURATION_PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise InvalidRequest(f"keep_alive '{text}' is not a duration: a number of seconds, or a string such as "
                             "'5m', '1h30m', '0' or '-1m'", param="keep_alive")
    seconds = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    return -seconds if text.startswith("-") else seconds


def read_stream(f: Fields) -> bool:
    """Ollama streams unless told `stream: false`."""
    return f.boolean("stream", True)


def timestamp(moment: datetime | None = None) -> str:
    """RFC 3339 in UTC, as Ollama's created_at and modified_at."""
    return (moment or datetime.now(timezone.utc)).isoformat().replace("+00:00", "Z")


def done_reason(finish: FinishReason | None) -> str:
    return "length" if finish == FinishReason.LENGTH else "stop"


def durations(result: RunResult) -> dict[str, int]:
    """Ollama's closing numbers: the prompt's tokens and the time to its first output token, the
    reply's tokens and the time after it, and the wait for its model to load; every duration in
    nanoseconds."""
    timings = result.timings()
    total_s = max(_finished(result) - result.received, 0.0)
    return {"total_duration": int(total_s * NS), "load_duration": int(result.load_seconds * NS),
            "prompt_eval_count": result.num_prompt_tokens,
            "prompt_eval_duration": int(timings["prompt_ms"] * 1e6),
            "eval_count": result.num_completion_tokens,
            "eval_duration": int(timings["predicted_ms"] * 1e6)}


def _finished(result: RunResult) -> float:
    ends = [c.timings.finished for c in result.choices if c.timings is not None and c.timings.finished]
    return max(ends) if ends else result.dispatched


def line(data: dict[str, Any]) -> ServerEvent:
    """One NDJSON line (the dialect's stream format frames it)."""
    return ServerEvent(data)


def error_line(error: EmberError) -> list[ServerEvent]:
    """A failure once the stream has begun: a line the Ollama clients raise as an error."""
    return [line(ollama_error_body(error))]
