"""What Chat Completions and Completions share: sampling fields, the model check, refusals of
features ember cannot honour, usage, timings and finish reasons."""

from __future__ import annotations

import math
from typing import Any, Callable

from ember.errors import EmberError, InvalidRequest
from ember.protocols.errors import ModelNotFound, openai_error_body
from ember.protocols.fields import Fields, as_integer, as_number
from ember.protocols.neutral import GenerationRequest, ModelInfo, ResponseMeta, RunResult, build_sampling_params
from ember.protocols.progress import PromptProgress, running_timings
from ember.protocols.sampling_fields import read_max_tokens, read_priority, read_sampling_fields
from ember.protocols.sse import DONE, ServerEvent
from ember.types import FinishReason, GenerationOutput, SamplingParams, TokenLogprob

MAX_CHOICES = 8
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}

def check_model(f: Fields, model: ModelInfo) -> None:
    """`model` may be left out (the served model); any other id than the served one is a 404."""
    name = f.string("model")
    if name and not model.accepts(name):
        raise ModelNotFound(name, model.name)


def read_sampling(f: Fields, model: ModelInfo, *, logprobs: int | None,
                  rename: dict[str, str] | None = None, thinking: bool | None = None) -> SamplingParams:
    """The sampling fields both endpoints honour, validated into SamplingParams, over the defaults
    of the turn's thinking mode (None: not settled, or not a chat)."""
    values: dict[str, Any] = dict(model.sampling_defaults_for(thinking))
    values["max_tokens"], max_tokens_param = read_max_tokens(f, ("max_completion_tokens", "max_tokens"))
    names = read_shared_sampling(f, values)
    values["stop_token_ids"] = read_token_ids(f, "stop_token_ids", model.vocab_size)
    values["logit_bias"] = read_logit_bias(f, model.vocab_size)
    values["ignore_eos"] = f.boolean("ignore_eos", False)
    values["min_tokens"] = f.integer("min_tokens", 0, low=0)
    values["skip_special_tokens"] = f.boolean("skip_special_tokens", True)
    values["logprobs"] = logprobs
    values["priority"] = read_priority(f)
    return build_sampling_params(values, {"max_tokens": max_tokens_param, **names, **(rename or {})})


def read_shared_sampling(f: Fields, values: dict[str, Any]) -> dict[str, str]:
    """The sampling fields every OpenAI-style route reads alike (temperature, top_p, top_k, min_p, the
    penalties, seed, stop under both its names) into `values`; returns renames for refusals."""
    return read_sampling_fields(f, values, stop_names=("stop", "stop_sequences"), stop_limit=MAX_STOP_STRINGS)


def read_token_ids(f: Fields, name: str, vocab_size: int) -> list[int]:
    items = f.array(name)
    if items is None:
        return []
    return [as_integer(t, f"{name}[{i}]", low=0, high=vocab_size - 1) for i, t in enumerate(items)]


def read_logit_bias(f: Fields, vocab_size: int) -> dict[int, float] | None:
    bias = f.object("logit_bias")
    if bias is None or not bias.obj:
        return None
    result = {}
    for key, value in bias.obj.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids; '{key}' is not", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"logit_bias names token {token_id}, outside the vocabulary (0..{vocab_size - 1})",
                                 param="logit_bias")
        result[token_id] = as_number(value, f"logit_bias.{key}", low=-100, high=100)
    return result


def read_choices(f: Fields) -> int:
    return f.integer("n", 1, low=1, high=MAX_CHOICES)


def read_stream(f: Fields) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = f.boolean("stream", False)
    options = f.object("stream_options")
    include_usage = options.boolean("include_usage", False) if options is not None else False
    return stream, bool(stream and include_usage)


def read_accepted(f: Fields) -> None:
    """Fields taken for compatibility that change nothing here; still type-checked."""
    f.string("user")
    f.object("metadata")


def usage_body(result: RunResult) -> dict[str, Any]:
    prompt, completion = result.num_prompt_tokens, result.num_completion_tokens
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens}}
    reasoning = result.num_reasoning_tokens
    if reasoning is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    body["reasoning_tokens"] = reasoning or 0  # the flat spelling some clients read
    body.update(result.speculative_usage())
    return body


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, "stop")


def finite_logprob(value: float) -> float:
    """JSON has no -Infinity; a token of zero probability is reported as -9999."""
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str]) -> list[dict[str, Any]]:
    """Chat Completions' `logprobs.content` entries."""
    content = []
    for entry in entries:
        text = token_text(entry.token_id)
        content.append({
            "token": text, "logprob": finite_logprob(entry.logprob), "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := token_text(tid)), "logprob": finite_logprob(lp), "bytes": list(t.encode())}
                             for tid, lp in entry.top],
        })
    return content


def completion_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str],
                        offset: int = 0) -> dict[str, Any]:
    """Completions' logprobs object; `offset` is where this run of tokens starts in the text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(finite_logprob(entry.logprob))
        top.append({token_text(tid): finite_logprob(lp) for tid, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class OpenAIRenderer:
    """The streaming bookkeeping both OpenAI dialects share."""

    chunk_object = ""

    def __init__(self, request: GenerationRequest, result: RunResult, meta: ResponseMeta) -> None:
        self.request = request
        self.result = result
        self.meta = meta
        self.progress = PromptProgress(result.num_prompt_tokens) if request.return_progress else None

    def envelope(self, obj: str) -> dict[str, Any]:
        meta = self.meta
        return {"id": meta.response_id, "object": obj, "created": meta.created, "model": meta.model,
                "system_fingerprint": meta.system_fingerprint}

    def choice_body(self, choice) -> dict[str, Any]:
        """The dialect's fields of one finished choice (message or text, logprobs)."""
        raise NotImplementedError

    # Streaming: the dialect's fields of a chunk carrying new text, and of the closing chunk.
    empty_delta: dict[str, Any] = {}

    def delta_body(self, choice, output: GenerationOutput, with_logprobs: bool) -> dict[str, Any]:
        raise NotImplementedError

    def stream_output(self, choice, output: GenerationOutput) -> list[ServerEvent]:
        events = self.progress_chunks(choice, output)
        with_logprobs = bool(self.request.params.logprobs is not None and output.new_logprobs)
        with_ids = bool(self.request.return_token_ids and output.new_token_ids)
        for k, body in enumerate(self.delta_bodies(choice, output, with_logprobs, with_ids)):
            entry = {"index": choice.index, **body, "finish_reason": None}
            if self.request.return_token_ids:
                entry["token_ids"] = output.new_token_ids if k == 0 else []
            events.append(self.chunk([entry], **self.delta_extra()))
        if choice.finish_reason is not None and output.finish_reason is not None:
            events.append(self.chunk([{"index": choice.index, **self.empty_delta, "logprobs": None,
                                       "finish_reason": self.finish_reason(choice), **self.finish_extra(choice)}],
                                     **self.closing_extra()))
        return events

    def delta_bodies(self, choice, output: GenerationOutput, with_logprobs: bool,
                     with_ids: bool) -> list[dict[str, Any]]:
        """The bodies of the chunks one output makes (logprobs on the first)."""
        if output.text_delta or with_logprobs or with_ids:
            return [self.delta_body(choice, output, with_logprobs)]
        return []

    def finish_reason(self, choice) -> str | None:
        return finish_reason(choice.finish_reason)

    def finish_extra(self, choice) -> dict[str, Any]:
        """The fields beside a finished choice's finish_reason (whole and streamed)."""
        return {"token_sha": choice.token_sha}

    def whole_response(self, obj: str) -> dict[str, Any]:
        """The non-streamed body: every choice, usage and timings."""
        choices = []
        for choice in self.result.choices:
            entry = {"index": choice.index, **self.choice_body(choice), "finish_reason": self.finish_reason(choice),
                     **self.finish_extra(choice)}
            if self.request.return_token_ids:
                entry["token_ids"] = choice.token_ids
            choices.append(entry)
        body = {**self.envelope(obj), "choices": choices, "usage": usage_body(self.result),
                "timings": self.result.timings()}
        if self.request.return_token_ids:
            body["prompt_token_ids"] = self.result.prompt_token_ids
        return body

    def progress_chunks(self, choice, output: GenerationOutput) -> list[ServerEvent]:
        """return_progress: prompt_progress chunks (no choices), from choice 0, whose prompt the others share."""
        if self.progress is None or choice.index != 0:
            return []
        return [self.chunk([], prompt_progress=report) for report in self.progress.update(output)]

    def delta_extra(self) -> dict[str, Any]:
        """timings_per_token: the running timings ride on every delta chunk."""
        return {"timings": running_timings(self.result)} if self.request.timings_per_token else {}

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> ServerEvent:
        return ServerEvent({**self.envelope(self.chunk_object), "choices": choices, **extra})

    def closing_extra(self) -> dict[str, Any]:
        """timings ride on the last JSON chunk: the last finish chunk, unless a usage chunk follows."""
        if self.result.finished and not self.request.include_usage:
            return {"timings": self.result.timings()}
        return {}

    def stream_end(self) -> list[ServerEvent]:
        events = []
        if self.request.include_usage:
            events.append(self.chunk([], usage=usage_body(self.result), timings=self.result.timings()))
        events.append(ServerEvent(DONE))
        return events

    def stream_error(self, error: EmberError) -> list[ServerEvent]:
        """An error event that names the request (its x-request-id), then [DONE]."""
        body = {**openai_error_body(error), "request_id": self.meta.request_id}
        return [ServerEvent(body), ServerEvent(DONE)]
