"""What the request log and /debug/requests say about one request, built from its RequestRecord.

Only counts, settings and times: never prompt or output text, stop strings, tool names or keys.
"""

from __future__ import annotations

import time
from typing import Any

from ember.server.reqlog import RequestRecord
from ember.types import FinishReason, SamplingParams

_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs",
                    "skip_special_tokens", "include_stop_str_in_output")


def sampling_summary(params: SamplingParams) -> dict[str, Any]:
    """The resolved sampling settings; stop strings and logit biases are counted, not shown."""
    summary = {name: getattr(params, name) for name in _SAMPLING_FIELDS}
    summary["num_stop_strings"] = len(params.stop)
    summary["num_stop_token_ids"] = len(params.stop_token_ids)
    summary["num_logit_bias"] = len(params.logit_bias or {})
    return summary


def request_shape(job: Any) -> dict[str, Any]:
    """The request's form: choices, streaming, messages, tools and thinking (counts and modes; a
    named tool choice is `function`, its name left out), extras."""
    messages = getattr(getattr(job, "prompt", None), "messages", None)
    chat = getattr(job, "chat", None)  # ChatOptions, on chat dialects
    return {
        "n": getattr(job, "n", 1),
        "stream": bool(getattr(job, "stream", False)),
        "include_usage": bool(getattr(job, "include_usage", False)),
        "num_messages": len(messages) if messages is not None else None,
        "num_tools": len(getattr(chat, "tools", ())),
        "tool_choice": getattr(chat, "tool_choice", None),
        "parallel_tool_calls": getattr(chat, "parallel_tool_calls", None),
        "thinking": getattr(chat, "thinking", None),
        "thinking_budget": getattr(chat, "thinking_budget", None),
        "reasoning_effort": getattr(chat, "reasoning_effort", None),
        "return_token_ids": bool(getattr(job, "return_token_ids", False)),
        "return_progress": bool(getattr(job, "return_progress", False)),
        "timings_per_token": bool(getattr(job, "timings_per_token", False)),
        "echo": bool(getattr(job, "echo", False)),
    }


def start_event(record: RequestRecord) -> dict[str, Any]:
    params = record.params
    requested = getattr(getattr(record.job, "params", None), "max_tokens", None)
    return {
        "request_id": record.request_id,
        "protocol": record.route,
        "prompt_tokens": record.prompt_tokens,
        "admission_wait_seconds": _span(record.received, record.admitted),
        "sampling": sampling_summary(params) if params is not None else None,
        "limits": {"max_tokens": getattr(params, "max_tokens", None), "requested_max_tokens": requested},
        "shape": request_shape(record.job),
    }


def terminal_kind(record: RequestRecord) -> str:
    """request_done when every choice ended with stop or length; request_error otherwise."""
    result = record.result
    if result is not None and result.finished and result.error is None and not record.error_code:
        return "request_done"
    return "request_error"


def telemetry(record: RequestRecord) -> dict[str, Any]:
    """One finished request in numbers: the body of request_done / request_error, and the entry
    /debug/requests lists."""
    entry: dict[str, Any] = {
        "request_id": record.request_id,
        "protocol": record.route,
        "status": record.status,
        "received_unix": record.received,
        "prompt_tokens": record.prompt_tokens,
    }
    if record.admitted is None:  # refused before it ran
        return {**entry, "outcome": "rejected", **_error_fields(record)}
    entry["outcome"] = "done" if terminal_kind(record) == "request_done" else "error"
    result = record.result
    choices = result.choices if result is not None else []
    timings = result.timings() if result is not None else {}
    first = result.first_token_time() if result is not None else None
    entry.update({
        "n": len(choices),
        "stream": bool(getattr(record.job, "stream", False)),
        "finish_reasons": [c.finish_reason.value if c.finish_reason else None for c in choices],
        "cached_tokens": result.num_cached_tokens if result is not None else 0,
        "completion_tokens": result.num_completion_tokens if result is not None else 0,
        "reasoning_tokens": getattr(result, "num_reasoning_tokens", None),
        "seconds": {
            "admission_wait": _span(record.received, record.admitted),
            "queue": timings.get("queue_ms", 0.0) / 1000.0,
            "prefill": timings.get("prompt_ms", 0.0) / 1000.0,
            "decode": timings.get("predicted_ms", 0.0) / 1000.0,
            "ttft": _span(record.received, first) if first is not None else None,
            "total": _span(record.received, time.time()),
        },
        "client_gone": record.client_gone,
    })
    if entry["outcome"] == "error":
        entry.update(_error_fields(record))
        if record.client_gone and not record.error_code:
            entry["code"] = "client_gone"
    return entry


def finish_label(record: RequestRecord) -> str:
    """One finish reason per request, for metrics: the most serious among its choices
    (error, then abort, then length, then stop); a request that never finished is `abort`."""
    result = record.result
    reasons = {c.finish_reason for c in result.choices} if result is not None else {None}
    for reason in (FinishReason.ERROR, FinishReason.ABORT):
        if reason in reasons:
            return reason.value
    if None in reasons or record.client_gone:
        return FinishReason.ABORT.value
    if record.error_code:
        return FinishReason.ERROR.value
    return FinishReason.LENGTH.value if FinishReason.LENGTH in reasons else FinishReason.STOP.value


def _error_fields(record: RequestRecord) -> dict[str, Any]:
    return {"type": record.error_type, "code": record.error_code, "param": record.error_param}


def _span(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return max(end - start, 0.0)
