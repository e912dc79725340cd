"""What is said about one request, built from its RequestRecord: the server log's line, the
request log's events, the /debug/requests entry and the finish label of metrics.

Only ids, counts, settings and times: never prompt or output text, stop strings, tool names or keys,
except that a refused request's entry repeats the refusal's message (which names the field and
may quote the value at fault), cut at MAX_LOGGED_MESSAGE characters.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ember.protocols.neutral import GenerationRequest, cached_tokens_details
from ember.server.request_record import RequestRecord
from ember.types import FinishReason, SamplingParams

logger = logging.getLogger("ember.request")

_QUIET_PATHS = ("/health", "/v1/health", "/healthz", "/metrics")  # logged at debug level: probes would drown the rest

MAX_LOGGED_MESSAGE = 300
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs",
                    "skip_special_tokens", "include_stop_str_in_output", "priority")


def sampling_summary(params: SamplingParams) -> dict[str, Any]:
    """The resolved sampling settings; stop strings and logit biases are counted, not shown."""
    summary = {name: getattr(params, name) for name in _SAMPLING_FIELDS}
    summary["num_stop_strings"] = len(params.stop)
    summary["num_stop_token_ids"] = len(params.stop_token_ids)
    summary["num_logit_bias"] = len(params.logit_bias or {})
    return summary


def request_shape(job: GenerationRequest) -> dict[str, Any]:
    """The request's form: choices, streaming, messages, tools and thinking (counts and modes; a
    named tool choice is `function`, its name left out), extras."""
    messages = getattr(job.prompt, "messages", None)  # chat prompts only
    chat = job.chat  # chat dialects only
    chat_fields = {"tool_choice": None, "parallel_tool_calls": None, "thinking": None, "thinking_budget": None,
                   "reasoning_effort": None, "requested_reasoning_effort": None}
    if chat is not None:
        chat_fields = {name: getattr(chat, name) for name in chat_fields if name != "requested_reasoning_effort"}
        chat_fields["requested_reasoning_effort"] = chat.requested_effort
    return {
        "n": job.n,
        "stream": job.stream,
        "include_usage": job.include_usage,
        "num_messages": len(messages) if messages is not None else None,
        "num_tools": len(chat.tools) if chat is not None else 0,
        **chat_fields,
        "return_token_ids": job.return_token_ids,
        "return_progress": job.return_progress,
        "timings_per_token": job.timings_per_token,
        "echo": job.echo,
    }


def start_event(record: RequestRecord) -> dict[str, Any]:
    """The request log's request_start: called once the request was admitted, so job and params are set."""
    params, job = record.params, record.job
    return {
        "request_id": record.request_id,
        "protocol": record.route,
        "model": record.model,
        "tenant": record.tenant,
        "session": record.session,
        "prompt_tokens": record.prompt_tokens,
        "admission_wait_seconds": _span(record.received, record.admitted),
        "sampling": sampling_summary(params),
        "limits": {"max_tokens": params.max_tokens, "requested_max_tokens": job.params.max_tokens},
        "shape": request_shape(job),
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
        "model": record.model,
        "tenant": record.tenant,
        "session": record.session,
        "status": record.status,
        "received_unix": record.received,
        "prompt_tokens": record.prompt_tokens,
        "ignored_fields": record.ignored_fields,
    }
    if record.admitted is None:  # refused before it ran
        shape = request_shape(record.job) if record.job is not None else None
        return {**entry, "outcome": "rejected", **_error_fields(record), "message": _cut(record.error_message),
                "phase": record.phase, "shape": shape}
    entry["outcome"] = "done" if terminal_kind(record) == "request_done" else "error"
    entry["sampling"] = sampling_summary(record.params)  # the seed it ran with included: a reply can be redone
    result = record.result
    choices = result.choices if result is not None else []
    timings = result.timings() if result is not None else {}
    first = result.first_token_time() if result is not None else None
    details = result.cached_tokens_details if result is not None else cached_tokens_details({})
    entry.update({
        "n": len(choices),
        "stream": record.job is not None and record.job.stream,
        "finish_reasons": [c.finish_reason.value if c.finish_reason else None for c in choices],
        "cached_tokens": result.num_cached_tokens if result is not None else 0,
        "cached_tokens_details": details,
        "prefix_reuse_path": prefix_reuse_path(details),
        "completion_tokens": result.num_completion_tokens if result is not None else 0,
        "reasoning_tokens": getattr(result, "num_reasoning_tokens", None),
        **_speculation_fields(result),
        "seconds": {
            "admission_wait": _span(record.received, record.admitted),
            "queue": timings.get("queue_ms", 0.0) / 1000.0,
            "prefill": timings.get("prompt_ms", 0.0) / 1000.0,
            "decode": timings.get("predicted_ms", 0.0) / 1000.0,
            "ttft": _span(record.received, first) if first is not None else None,
            "total": _span(record.received, time.time()),
        },
        "engine_timing": engine_timing(result),
        "tool_call_parse": tool_call_parse(result),
        "thinking_budget": thinking_budget(result),
        "client_gone": record.client_gone,
    })
    if entry["outcome"] == "error":
        entry.update(_error_fields(record))
        if record.client_gone and not record.error_code:
            entry["code"] = "client_gone"
    return entry


def engine_timing(result) -> dict[str, float] | None:
    """The first choice's time inside the engine, split: waiting for its first step (queue_wait),
    its prompt (prefill: to the first token), its reply (decode: first token to last); total is
    their sum. Times before the engine (admission, the template) are not in it."""
    stamps = result.choices[0].timings if result is not None and result.choices else None
    if stamps is None:
        return None
    end = stamps.finished if stamps.finished is not None else time.time()
    split = {"queue_wait_seconds": _span(stamps.arrival, stamps.scheduled) or 0.0,
             "prefill_seconds": _span(stamps.scheduled, stamps.first_token) or 0.0,
             "decode_seconds": _span(stamps.first_token, end) or 0.0}
    return {**split, "total_seconds": sum(split.values())}


def tool_call_parse(result) -> dict[str, Any] | None:
    """How the replies' tool-call markup was read (every choice together): `outcome` none (no call
    markup), parsed, recovered (some call read whole only once its block closed, or from an
    unclosed think block) or text_fallback (some block went out as text; `fallback_reasons` say
    why, in order: parsers.events.TEXT_FALLBACK_REASONS). Counts only: no names, no arguments."""
    if result is None or result.plan is None:
        return None
    replies = [choice.reply for choice in result.choices]
    fallbacks = [reason for reply in replies for reason in reply.text_fallbacks]
    counts = {"call_blocks": sum(r.num_call_blocks for r in replies),
              "calls": sum(len(r.tool_calls) for r in replies),
              "incomplete_calls": sum(not call.complete for r in replies for call in r.tool_calls),
              "recovered_calls": sum(r.num_recovered_calls for r in replies),
              "dropped_calls": sum(r.num_dropped_calls for r in replies)}
    outcome = ("text_fallback" if fallbacks else "recovered" if counts["recovered_calls"]
               else "parsed" if counts["call_blocks"] else "none")
    return {"outcome": outcome, **counts, "fallback_reasons": fallbacks}


def thinking_budget(result) -> dict[str, Any] | None:
    """The reasoning cap a chat reply ran under: its size, whose it was (the request's field or the
    server's --default-thinking-budget), and the closes it forced (every choice together); None
    without a budget."""
    plan = result.plan if result is not None else None
    if plan is None or plan.budget is None:
        return None
    return {"budget": plan.budget, "source": plan.budget_param or "server_default",
            "forced_closes": sum(choice.num_budget_closes for choice in result.choices)}


def prefix_reuse_path(details: dict[str, int]) -> str:
    """Where a prompt's reused prefix came from: "root" when nothing was reused (computed from the
    start), else the tiers that served some of it, nearest first, joined by "+" ("device+host").
    `details`: cached_tokens_details."""
    return "+".join(tier for tier, tokens in details.items() if tokens) or "root"


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


def log_line(record: RequestRecord) -> str:
    """The server log's one line per request: `id METHOD path status`, then counts and times."""
    parts = [f"{record.request_id} {record.method} {record.path} {record.status if record.status else '-'}"]
    if record.prompt_tokens is not None:
        parts.append(f"prompt={record.prompt_tokens}")
    result = record.result
    if result is not None:
        timings = result.timings()
        first = result.first_token_time()
        ttft = f"{(first - record.received) * 1000:.0f}ms" if first is not None else "-"
        reasons = ",".join(sorted({c.finish_reason.value for c in result.choices if c.finish_reason})) or "-"
        parts.append(f"cached={result.num_cached_tokens} reuse={prefix_reuse_path(result.cached_tokens_details)} "
                     f"completion={result.num_completion_tokens} "
                     f"ttft={ttft} tok/s={timings['predicted_per_second']:.1f} finish={reasons}")
        if len(result.choices) > 1:
            parts.append(f"n={len(result.choices)}")
    if record.session is not None:
        parts.append(f"session={record.session}")
    if record.client_gone:
        parts.append("client_gone")
    if record.error_code:
        parts.append(f"error={record.error_code}" + (f" param={record.error_param}" if record.error_param else ""))
    parts.append(f"{record.elapsed():.3f}s")
    return " ".join(parts)


def log_request(record: RequestRecord) -> None:
    level = logging.DEBUG if record.path in _QUIET_PATHS else logging.INFO
    if logger.isEnabledFor(level):
        logger.log(level, "%s", log_line(record))


def _error_fields(record: RequestRecord) -> dict[str, Any]:
    return {"type": record.error_type, "code": record.error_code, "param": record.error_param}


def _cut(message: str | None) -> str | None:
    """A refusal's message as logged: its first MAX_LOGGED_MESSAGE characters (a message may quote
    a long value, such as an image's data URL)."""
    if message is None or len(message) <= MAX_LOGGED_MESSAGE:
        return message
    return message[:MAX_LOGGED_MESSAGE] + "..."


def _span(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return max(end - start, 0.0)


def _speculation_fields(result) -> dict:
    """A drafted request's speculative counters (rounds, drafted and accepted tokens, rounds by tokens kept)."""
    counts = result.speculation if result is not None else None
    if counts is None:
        return {}
    return {"speculative": {"rounds": counts.rounds, "proposed": counts.proposed, "accepted": counts.accepted,
                            "accepted_per_round": list(counts.histogram)}}
