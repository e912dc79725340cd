"""Neutral types shared by every layer: sampling settings, requests, outputs, finish reasons."""

from __future__ import annotations

import dataclasses
import enum
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ember.errors import InvalidRequest


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the end of the context window
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # the engine failed while running the request


MAX_CACHE_PINS = 8
# How a prompt's final hidden states become one vector: its last token's row, the mean of all its
# rows, or its first token's row (CLS)
POOLING_METHODS = ("last", "mean", "cls")
# A classifier's reading of a prompt (a cross-encoder's pair): its last token's row through the
# model's classification head, one logit per label
CLASSIFY = "classify"
MAX_PIN_TTL_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class CachePin:
    """Keep the prompt's first `num_tokens` tokens in the prefix cache for `ttl_s` seconds (whole
    KV blocks only), safe from other requests' pressure (engine.kv_pins)."""

    num_tokens: int
    ttl_s: float


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, and how the engine schedules and caches the request.
    Validated on construction; plain data, so that it can cross to an engine process."""

    max_tokens: int | None = 16  # None: up to the end of the context window; 0: the prompt is only prefilled
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token plus k alternatives
    logprob_token_ids: list[int] | None = None  # with logprobs: these ids' log probabilities at every position too
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0  # 0: foreground; above 0: background work that yields to lower values (engine.scheduler)
    cache_pins: list[CachePin] = field(default_factory=list)
    draft: bool = True  # False: never speculated (the serial reference a drafted reply must equal)
    # with max_tokens 0: the prompt's final hidden states pooled this way (POOLING_METHODS, or
    # CLASSIFY on a classifier) into the final output's `pooled` vector
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_int("max_tokens", self.max_tokens, low=0, optional=True)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_int("top_k", self.top_k, low=-1)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequest("top_p must be greater than 0", param="top_p")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0)
        if self.repetition_penalty == 0.0:
            raise InvalidRequest("repetition_penalty must be greater than 0", param="repetition_penalty")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, optional=True)
        _check_int("min_tokens", self.min_tokens, low=0)
        _check_int("logprobs", self.logprobs, low=0, high=20, optional=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens must not exceed max_tokens", param="min_tokens")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a non-empty string or a list of non-empty strings", param="stop")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be a list of token ids", param="stop_token_ids")
        if self.logprob_token_ids is not None:
            if not isinstance(self.logprob_token_ids, list) or not all(_is_int(t) and t >= 0
                                                                       for t in self.logprob_token_ids):
                raise InvalidRequest("logprob_token_ids must be a list of token ids", param="logprob_token_ids")
            if self.logprobs is None:
                raise InvalidRequest("logprob_token_ids needs logprobs (0 or more)", param="logprob_token_ids")
        _check_int("priority", self.priority, low=0)
        if not isinstance(self.draft, bool):
            raise InvalidRequest("draft must be true or false", param="draft")
        _check_cache_pins(self.cache_pins)
        if self.pooling is not None:
            if self.pooling not in POOLING_METHODS + (CLASSIFY,):
                raise InvalidRequest(f"pooling must be one of {', '.join(POOLING_METHODS + (CLASSIFY,))}",
                                     param="pooling")
            if self.max_tokens != 0:
                raise InvalidRequest("pooling runs the prompt only: max_tokens must be 0", param="max_tokens")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequest("logit_bias must map token ids to numbers", param="logit_bias")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise InvalidRequest(f"logit_bias key {token!r} is not a token id", param="logit_bias")
                _check_float("logit_bias", bias, -100.0, 100.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def seeded(self, default_seed: int | None) -> SamplingParams:
        """These settings as they run. A sampled request without a seed of its own takes
        `default_seed` (`--seed`, EngineConfig.seed) or, when there is none, a fresh seed drawn
        here, so that the seed used can be logged and the reply redone. Greedy requests need none.
        The server and the Python API both decide a request's seed here, and nowhere else."""
        if self.seed is not None or self.greedy:
            return self
        return dataclasses.replace(self, seed=default_seed if default_seed is not None else secrets.randbits(63))


class TokenConstraint(Protocol):
    """Token-level control of one request's output (a thinking budget's close, a forced tool-call
    opener, a name held to declared tools, a grammar). The front end builds it; the engine calls it
    from its own thread inside the sampling step, with the request's output so far."""

    def allowed_token_ids(self, output_token_ids: Sequence[int]) -> Sequence[int] | None:
        """The ids the next token may take, or None for no restriction. One id forces that token."""
        ...

    # A constraint that steers reasoning also counts `num_budget_closes`: the times a thinking
    # budget closed the think block (the engine reports it on the request's final output).


class MaskingConstraint(TokenConstraint, Protocol):
    """A constraint that allows most of the vocabulary at a step (a grammar) speaks in a packed
    bitmask instead of a list of ids. The sampler gives every such row of the batch one bitmask and
    applies them all at once."""

    def fill_token_bitmask(self, output_token_ids: Sequence[int], bitmask, row: int) -> bool:
        """Write the ids the next token may take into row `row` of `bitmask` and return True, or
        return False to leave this step to `allowed_token_ids`. `bitmask` is an int32 tensor of
        shape (rows, ceil(vocab_size / 32)), every bit set on entry; bit j of word i stands for id
        32 * i + j (xgrammar's layout)."""
        ...


class ConstraintFailed(Exception):
    """Raised by a constraint when the reply can no longer satisfy it (a grammar that rejects the
    sampled token). The engine ends that request alone, with an error."""


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first
    requested: list[tuple[int, float]] = field(default_factory=list)  # SamplingParams.logprob_token_ids, in order


@dataclass(slots=True)
class StepOutput:
    """What the engine produced for one request in one step (token ids only; text comes later)."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    scheduled_time: float | None = None  # when the engine first gave the request a step
    stop_token_id: int | None = None  # the stop token id that ended it, if one did
    error: str | None = None
    # set only on prefill progress outputs (no new tokens), for requests that asked for them
    num_computed_prompt_tokens: int | None = None
    num_pinned_tokens: int = 0  # leading prompt tokens kept pinned by the request's cache_pins
    # speculative decoding this step: tokens drafted for the request, and how many of them it kept
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # num_cached_tokens by where they were found: "device" (the KV pool), "host", "disk"
    cached_tokens_by_tier: dict[str, int] | None = None
    num_preemptions: int = 0  # times the request was preempted (its KV freed) so far
    num_budget_closes: int = 0  # times a thinking budget closed the think block (final outputs)
    pooled: list[float] | None = None  # a pooling request's vector (float32 values), in its final output


@dataclass(slots=True)
class SpeculationCounts:
    """One request's speculative decoding: rounds verified, tokens drafted and accepted."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)  # histogram[n]: rounds that kept n drafted tokens

    def add(self, proposed: int, accepted: int) -> None:
        """One verified round."""
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        self._count_rounds(accepted, 1)

    def merge(self, other: "SpeculationCounts") -> None:
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted
        for accepted, rounds in enumerate(other.histogram):
            self._count_rounds(accepted, rounds)

    def _count_rounds(self, accepted: int, rounds: int) -> None:
        if len(self.histogram) <= accepted:
            self.histogram.extend([0] * (accepted + 1 - len(self.histogram)))
        self.histogram[accepted] += rounds

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verified round: the kept drafts plus the token the model adds."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass(slots=True)
class RequestTimings:
    """Seconds since the epoch (time.time()) at each milestone of a request."""

    arrival: float
    scheduled: float | None = None  # first time the request got a step
    first_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class GenerationOutput:
    """A request's result as the front end sees it: token ids plus the text they decode to.

    Streaming consumers read `text_delta` and `new_token_ids` of each output; `text` holds the
    whole text on the final output only (joining it every step would cost quadratic time).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprob] | None  # every token's so far, when requested
    new_logprobs: list[TokenLogprob] | None  # this output's tokens only
    finish_reason: FinishReason | None
    num_cached_tokens: int
    timings: RequestTimings
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    num_computed_prompt_tokens: int | None = None  # prefill progress outputs only (see StepOutput)
    num_pinned_tokens: int = 0  # see StepOutput
    speculation: SpeculationCounts | None = None  # set once a round of drafted tokens was verified
    cached_tokens_by_tier: dict[str, int] | None = None  # see StepOutput
    num_preemptions: int = 0  # see StepOutput
    num_budget_closes: int = 0  # see StepOutput
    pooled: list[float] | None = None  # see StepOutput
    dp_rank: int | None = None  # the data-parallel worker that ran it; None: one engine

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value, low: int | None = None, high: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value):
        raise InvalidRequest(f"{name} must be an integer", param=name)
    if low is not None and value < low:
        raise InvalidRequest(f"{name} must be at least {low}, got {value}", param=name)
    if high is not None and value > high:
        raise InvalidRequest(f"{name} must be at most {high}, got {value}", param=name)


def _check_cache_pins(pins) -> None:
    if not isinstance(pins, list) or len(pins) > MAX_CACHE_PINS or not all(isinstance(p, CachePin) for p in pins):
        raise InvalidRequest(f"cache_pins must be a list of at most {MAX_CACHE_PINS} CachePin", param="cache_pins")
    for pin in pins:
        _check_int("cache_pins.num_tokens", pin.num_tokens, low=1)
        _check_float("cache_pins.ttl_s", pin.ttl_s, 1.0, MAX_PIN_TTL_S)


def _check_float(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number", param=name)
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low} and {high}, got {value}", param=name)
