"""One step's budget: each request owes num_tokens - num_computed_tokens, and the step pays.

There is no prefill or decode phase: a long prompt is paid in chunks, a decode owes one token,
and prefix-cache hits simply arrive already computed. Running requests are paid first; then
waiting requests are admitted in the waiting queue's order (engine.waiting_queue) while budget,
seats and blocks last. What a chunk costs is engine.step_budget's arithmetic; its attention term
counts only while some request decodes.

Running requests that decode go before those still prefilling, and every one of them gets its
token each step, even past the budget. A step serves decodes, then foreground prefills, then
waiting foreground requests, and only then background prefills and waiting background requests.
A waiting request that finds no seat or no blocks preempts running requests of a larger served
priority, the least important first, when that makes the room; the victims wait again and later
resume from what they had (their tokens are kept and their prompt blocks usually come back from
the prefix cache).

A paused request (its stream's reader is behind: engine.backlog) is skipped while running: it
keeps its blocks and takes no budget, and under memory pressure it is preempted like any other.
Preempted, it waits in the queue as usual and is admitted again, then skipped.

A chunk never ends inside a request's bidirectional span (one image's tokens on Gemma 3;
Request.computable): it ends before the span, or covers it whole, past the budget if need be,
its KV blocks allocated for all of it. A prefix-cache hit that ends inside a span (its cached
keys were computed with the whole span) makes the first chunk start there and cover the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ember.engine.kv_cache import KVCacheManager, tokens_by_tier
from ember.engine.request import Request, RequestStatus
from ember.engine.step_budget import chunk_cost, tokens_within
from ember.engine.waiting_queue import WaitingQueue, served_priority


DEFAULT_BACKGROUND_WAIT_STEPS = 256


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int  # the step budget, in token costs
    max_model_len: int
    attention_cost_tokens: int | None = None  # K of engine.step_budget; None: every token costs 1
    # a background request that has waited this many steps in all is served as foreground (engine.waiting_queue)
    background_wait_steps: int = DEFAULT_BACKGROUND_WAIT_STEPS
    # every layer's sliding window is at most this: blocks behind it are given back as requests advance
    release_window: int | None = None


@dataclass(slots=True)
class ScheduledRequest:
    """num_new_tokens tokens from position `start`: the request's own, then its drafted tokens
    (speculative decoding), whose KV is kept only as far as the model accepts them."""

    request: Request
    num_new_tokens: int
    start: int  # request.num_computed_tokens when scheduled
    draft_token_ids: list[int] = field(default_factory=list)
    # this chunk reaches the last token, so the runner samples one; fixed here, as the request grows
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        reaches_end = self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens
        self.samples = reaches_end and self.request.max_tokens > 0  # max_tokens 0: the prompt only

    @property
    def input_token_ids(self) -> list[int]:
        """The tokens this step feeds the model: (num_new_tokens,)."""
        own = self.request.token_ids[self.start:self.start + self.num_new_tokens - len(self.draft_token_ids)]
        return own + self.draft_token_ids if self.draft_token_ids else own


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted: list[Request]


class Scheduler:
    """Not thread-safe: the engine's one thread calls it."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []
        self.paused: set[str] = set()  # ids of unfinished requests steps skip
        self._attention_cost_tokens: int | None = None  # this step's K: the config's while a request decodes
        self.waiting = WaitingQueue(config.background_wait_steps)
        self.num_steps = 0  # schedule() calls so far

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_prefilling(self) -> int:
        return sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    @property
    def num_paused(self) -> int:
        return len(self.paused)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_schedulable(self) -> bool:
        return len(self.requests) > len(self.paused)  # paused is a subset of requests

    def pause(self, request_ids: Iterable[str]) -> None:
        """Skip these requests' steps until resumed (unknown or finished ids are ignored)."""
        self.paused.update(request_id for request_id in request_ids if request_id in self.requests)

    def resume(self, request_ids: Iterable[str]) -> None:
        self.paused.difference_update(request_ids)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request, self.num_steps)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self.waiting.promote_due(self.num_steps)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in self.paused
                       for r in self.running)
        self._attention_cost_tokens = self.config.attention_cost_tokens if decoding else None
        # Decodes first (a long prompt never holds back the next token of a request that is already
        # streaming), then foreground prompts still prefilling, then waiting foreground requests,
        # and only then background prefills and waiting background requests.
        self.running.sort(key=_step_order)
        first = [r for r in self.running if _step_order(r) < 2]
        background_prefills = self.running[len(first):]
        budget = self._schedule_running(float(self.config.max_num_batched_tokens), first, scheduled, preempted)
        if not preempted:  # memory is short when something was preempted; admitting now would thrash
            budget = self._admit_waiting(budget, scheduled, preempted, foreground_only=True)
        budget = self._schedule_running(budget, background_prefills, scheduled, preempted)
        if not preempted:
            self._admit_waiting(budget, scheduled, preempted, foreground_only=False)
        return SchedulerOutput(scheduled, sum(entry.num_new_tokens for entry in scheduled), preempted)

    def _cost(self, start: int, count: int) -> float:
        return chunk_cost(start, count, self._attention_cost_tokens)

    def _tokens_within(self, start: int, wanted: int, budget: float) -> int:
        return tokens_within(start, wanted, budget, self._attention_cost_tokens)

    def _schedule_running(self, budget: float, requests: list[Request], scheduled: list[ScheduledRequest],
                          preempted: list[Request]) -> float:
        for request in requests:
            if request.status is not RequestStatus.RUNNING or request.request_id in self.paused:
                continue  # preempted earlier in this step, or paused
            start = request.num_computed_tokens
            owed = request.num_tokens - start
            if budget <= 0 and owed > 1:
                break  # what is left prefills; every decode runs, even past the budget
            num_new_tokens = 1 if owed == 1 else request.computable(start, self._tokens_within(start, owed, budget))
            if num_new_tokens == 0:  # its next input is not ready, or the runner failed to sample for it
                continue
            drafts, request.draft_token_ids = request.draft_token_ids, []
            if owed == 1 and drafts:
                drafts = self._affordable_drafts(request, drafts, budget - self._cost(start, 1))
                if drafts:
                    scheduled.append(ScheduledRequest(request, 1 + len(drafts), start, drafts))
                    budget -= self._cost(start, 1 + len(drafts))
                    continue
            while not self.kv_cache.allocate_slots(request, num_new_tokens):
                victim = max(self.running, key=_preemption_order)
                budget += self._preempt(victim, scheduled)  # a victim already paid this step is refunded
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new_tokens, start))
                budget -= self._cost(start, num_new_tokens)
        return budget

    def _affordable_drafts(self, request: Request, drafts: list[int], budget: float) -> list[int]:
        """The drafted tokens the budget left after the request's own token pays for, if the pool
        has room for them without preempting anyone (a draft is never worth a preemption)."""
        if budget <= 0:
            return []
        drafts = drafts[:self._tokens_within(request.num_computed_tokens + 1, len(drafts), budget)]
        return drafts if self.kv_cache.allocate_slots(request, 1 + len(drafts)) else []

    def _admit_waiting(self, budget: float, scheduled: list[ScheduledRequest], preempted: list[Request], *,
                       foreground_only: bool) -> float:
        while budget > 0:
            request = self.waiting.peek()
            if request is None or (foreground_only and served_priority(request) > 0):
                break
            # waiting requests (new or preempted) have num_computed_tokens == 0
            while True:
                hit_block_ids, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
                num_new_tokens = request.computable(num_hit_tokens, self._tokens_within(
                    num_hit_tokens, request.num_tokens - num_hit_tokens, budget))
                if num_new_tokens == 0:
                    return budget  # its next input is not ready yet: it stays at the queue's head
                if len(self.running) < self.config.max_num_seqs and self.kv_cache.allocate_slots(
                        request, num_new_tokens, hit_block_ids, num_hit_tokens):
                    break
                # Only less important requests yield, and only when that can make the room.
                num_pool_hits = sum(1 for hit in hit_block_ids if isinstance(hit, int))
                victim = self._yielding_victim(request, num_hit_tokens + num_new_tokens, num_pool_hits)
                if victim is None:
                    return budget
                budget += self._preempt(victim, scheduled)
                preempted.append(victim)
            self.waiting.pop(self.num_steps)
            if request.status is RequestStatus.WAITING:  # its first admission: a preempted one waits as PREEMPTED
                request.num_cached_tokens = min(num_hit_tokens, request.num_prompt_tokens)
                request.cached_tokens_by_tier = tokens_by_tier(hit_block_ids, self.kv_cache.block_size)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new_tokens, num_hit_tokens))
            budget -= self._cost(num_hit_tokens, num_new_tokens)
        return budget

    def _yielding_victim(self, request: Request, num_tokens: int, num_hit_blocks: int) -> Request | None:
        """The running request that gives way to `request`: the least important of those of a
        larger served priority, if giving way can seat it and cover its blocks."""
        weaker = [r for r in self.running if served_priority(r) > served_priority(request)]
        if not weaker:
            return None
        needed = -(-num_tokens // self.kv_cache.block_size) - num_hit_blocks
        if self.kv_cache.num_free_blocks + self.kv_cache.num_blocks_freed_by(weaker) < needed:
            return None  # even all of them would not free enough: none is preempted for nothing
        return max(weaker, key=_preemption_order)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]],
                           accepted: dict[str, int] | None = None) -> list[Request]:
        """Advance each scheduled request and append its sampled tokens; returns those that finished (freed).

        `accepted`: how many of a request's drafted tokens the model kept (they lead its sampled
        tokens). Only those keep their KV: the rejected ones' slots are written again later and their
        blocks, if they hold nothing else, go back to the pool; prefix hashes cover accepted tokens only.
        """
        finished: list[Request] = []
        for entry in output.scheduled:
            request = entry.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted since schedule()
            status = None
            if entry.samples:
                for token_id in sampled.get(request.request_id, ()):
                    request.append_output_token(token_id)
                    status = self._stop_status(request, token_id)
                    if status is not None:
                        break
            num_kept = entry.num_new_tokens
            if entry.draft_token_ids:
                num_kept -= len(entry.draft_token_ids) - (accepted or {}).get(request.request_id, 0)
            # a stop inside a drafted round drops the tokens after it, and their KV
            request.num_computed_tokens = min(request.num_computed_tokens + num_kept, request.num_tokens)
            self.kv_cache.cache_full_blocks(request)
            if entry.draft_token_ids:
                self.kv_cache.trim_blocks(request, request.num_computed_tokens)
            if self.config.release_window:  # the next token's window starts here
                self.kv_cache.release_blocks_before(request, request.num_computed_tokens + 1 - self.config.release_window)
            if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                status = RequestStatus.FINISHED_LENGTH  # prefilled, its full blocks cached
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.status.is_finished]
        return finished

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (abort, a stop string); unknown ids are ignored."""
        assert status.is_finished, f"{status} is not a finished status"
        finished = []
        any_running = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            any_running |= request.status is RequestStatus.RUNNING
            self._finish(request, status)
            finished.append(request)
        if any_running:
            self.running = [r for r in self.running if not r.status.is_finished]
        return finished

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free; the caller drops it from self.running (once per batch)."""
        request.status = status
        request.finish_reason = status.finish_reason
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self.paused.discard(request.request_id)

    def _preempt(self, request: Request, scheduled: list[ScheduledRequest]) -> float:
        """Send a running request back to wait, its KV dropped; returns the budget it was paid this step."""
        self.running.remove(request)
        refund = 0.0
        for entry in scheduled:
            if entry.request is request:
                scheduled.remove(entry)
                refund = self._cost(entry.start, entry.num_new_tokens)
                break
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.push_front(request, self.num_steps)
        return refund


def _step_order(request: Request) -> int:
    """0: it decodes; 1: a foreground prompt prefilling; 2: a background one."""
    if request.num_tokens - request.num_computed_tokens <= 1:
        return 0
    return 1 if served_priority(request) == 0 else 2


def _preemption_order(request: Request) -> tuple[int, float]:
    """The largest is preempted first: a larger served priority, then a later arrival."""
    return served_priority(request), request.arrival_time
