"""One request's state inside the engine: its tokens, how many have KV in the cache, its blocks."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from ember.engine.messages import MediaSpan, media_key
from ember.types import FinishReason, SamplingParams, TokenConstraint


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, its KV dropped; recomputed (often from the prefix cache)
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Token ids are one list, prompt then output, appended in place.

    Invariants: num_computed_tokens <= num_tokens; block_ids cover at least num_computed_tokens
    tokens while running; block_hashes[i] is the hash of block_ids[i] (full, computed blocks only).
    """

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "sampling_params", "max_tokens",
        "eos_token_ids", "arrival_time", "priority", "cache_salt", "num_computed_tokens",
        "num_cached_tokens", "cached_tokens_by_tier", "block_ids", "block_hashes", "status", "finish_reason",
        "stop_reason", "num_preemptions", "constraint", "num_waiting_steps", "waiting_since_step", "promoted",
        "num_pinned_tokens", "draft_token_ids", "media", "unready_spans", "bidirectional_spans",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                 max_tokens: int, eos_token_ids: Iterable[int], arrival_time: float, priority: int = 0,
                 cache_salt: str | None = None, constraint: TokenConstraint | None = None,
                 media: Sequence[MediaSpan] = ()) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved by the engine; prompt + max_tokens <= max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = arrival_time
        self.priority = priority  # lower is more important
        self.cache_salt = cache_salt
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at its first admission
        self.cached_tokens_by_tier: dict[str, int] = {}  # those tokens by where they were found (kv_cache.tokens_by_tier)
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None  # the stop token id that ended it
        self.num_preemptions = 0
        self.constraint = constraint
        # the scheduler's starvation bound: steps spent waiting, summed over preemptions; while
        # waiting, since which step; promoted once a background request has waited its bound
        self.num_waiting_steps = 0
        self.waiting_since_step = 0
        self.promoted = False
        self.num_pinned_tokens = 0  # leading prompt tokens its cache pins keep (set by the KV manager)
        # speculative decoding: tokens proposed to follow token_ids, verified by the next step (engine.spec)
        self.draft_token_ids: list[int] = []
        self.media = tuple(media)  # its prompt's images (spans of positions), in order
        # positions [start, stop) whose inputs are not ready yet (an image still being encoded):
        # the scheduler ends the request's chunk before them
        self.unready_spans: list[tuple[int, int]] = []
        # runs of positions [start, stop), ascending, whose tokens attend to each other both ways in
        # prefill (Gemma 3's image tokens): no prefill chunk ends inside one, so that its keys are
        # all there when its queries attend
        self.bidirectional_spans: list[tuple[int, int]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt row must be computed here, none served by the prefix cache (a mean or
        first-row pooling request reads them all: engine.pooling)."""
        return self.sampling_params.pooling in ("mean", "cls")

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def end_token_ids(self) -> frozenset[int]:
        """The tokens that end the request when sampled: its stop token ids, and its end-of-sequence
        tokens unless it ignores them."""
        params = self.sampling_params
        if params.ignore_eos:
            return frozenset(params.stop_token_ids)
        return self.eos_token_ids.union(params.stop_token_ids)

    def media_key(self, start: int, stop: int) -> bytes | None:
        return media_key(self.media, start, stop) if self.media else None

    def computable(self, start: int, count: int) -> int:
        """How many tokens from `start` a chunk computes, `count` (what the step budget pays for)
        allowing: none from an unready span on. No chunk ends inside a bidirectional span: one that
        would ends before the span, and one that starts at or inside it (a prefix-cache hit may end
        there) covers it whole, past `count` if need be, so a step may go over its budget by less
        than one span, as decodes may go over it."""
        for span_start, span_stop in self.unready_spans:
            if span_stop > start:
                count = min(count, span_start - start)
                break
        if count <= 0:
            return 0
        end = start + count
        for span_start, span_stop in self.bidirectional_spans:
            if span_start < end < span_stop:
                return (span_stop if start >= span_start else span_start) - start
        return count

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")
