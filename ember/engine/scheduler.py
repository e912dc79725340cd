"""One step's budget: each request owes num_tokens - num_computed_tokens, and the step pays.

There is no prefill or decode phase: a long prompt is paid in chunks, a decode owes one token,
and prefix-cache hits simply arrive already computed. Running requests are paid first; then
waiting requests are admitted by (priority, arrival) while budget, seats and blocks last.

Running requests that decode go before those still prefilling, and every one of them gets its
token each step, even past the budget. While any request decodes, the budget counts what tokens
cost, not only how many there are: with `attention_cost_tokens` (K) set, a token attending to c
keys costs 1 + c / K, K being the context at which its attention costs as much as the rest of
its layer. A step of max_num_batched_tokens short-context tokens and a step holding one chunk of
a 20,000-token prompt then take about the same time, so the streams running beside a long
prompt keep the pace of a short step while it prefills. With no stream to protect, every token
costs 1 and prompts prefill in full-budget chunks.

Priorities: 0 is foreground, larger values are background work (SamplingParams.priority). A step
serves decodes, then foreground prefills, then waiting foreground requests, and only then
background prefills and waiting background requests. A waiting request that finds no seat or no
blocks preempts running requests of a larger rank, the least important first, when that makes
the room; the victims wait again and later resume from what they had (their tokens are kept and
their prompt blocks usually come back from the prefix cache). Starvation bound: a background
request that has spent `background_wait_steps` steps waiting, summed over every time it waited,
is promoted: from the next step on it ranks as a foreground request that arrived when it did, so
no later foreground request passes it in the queue or preempts it for room.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus


DEFAULT_BACKGROUND_WAIT_STEPS = 256


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int  # the step budget, in token costs
    max_model_len: int
    attention_cost_tokens: int | None = None  # K above; None: every token costs 1
    # a background request that has waited this many steps in all is served as foreground (above)
    background_wait_steps: int = DEFAULT_BACKGROUND_WAIT_STEPS
    # every layer's sliding window is at most this: blocks behind it are given back as requests advance
    release_window: int | None = None


def rank(request: Request) -> int:
    """The priority a request is served at: its own, or 0 (foreground) once promoted."""
    return 0 if request.promoted else request.priority


def chunk_cost(start: int, count: int, attention_cost_tokens: int | None) -> float:
    """What `count` tokens from position `start` cost: each 1, plus its keys / K."""
    if attention_cost_tokens is None:
        return float(count)
    keys = count * start + count * (count + 1) / 2  # token i attends start + i + 1 keys
    return count + keys / attention_cost_tokens


def tokens_within(start: int, wanted: int, budget: float, attention_cost_tokens: int | None) -> int:
    """The most tokens of `wanted` from `start` that the budget pays for (at least one if any budget
    is left, so a lone long decode is never starved)."""
    if budget <= 0 or wanted <= 0:
        return 0
    if attention_cost_tokens is None:
        return max(1, min(wanted, int(budget)))
    k = attention_cost_tokens
    # count^2 / 2K + count (1 + (start + 1/2) / K) - budget = 0
    linear = 1 + (start + 0.5) / k
    count = int((-linear + math.sqrt(linear * linear + 2 * budget / k)) * k)
    count = max(1, min(wanted, count))
    while count > 1 and chunk_cost(start, count, k) > budget:
        count -= 1
    return count


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


class WaitingQueue:
    """Requests by rank; within a rank, preempted requests first (the latest preempted in front),
    then new ones by arrival.

    Each waiting request has one live heap entry; entries left behind by a promotion (reorder) and
    requests finished while waiting (aborted) are dropped lazily when they reach the front.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, float, int, Request]] = []  # (rank, group, key, seq, request)
        self._live: dict[str, tuple[int, int, float]] = {}  # request id -> its live entry's (seq, group, key)
        self._order = itertools.count()

    def push(self, request: Request) -> None:
        self._push(request, 1, request.arrival_time)

    def push_front(self, request: Request) -> None:
        self._push(request, 0, -next(self._order))

    def reorder(self, request: Request) -> None:
        """Its rank changed: the same place within its group, under the new rank."""
        _, group, key = self._live[request.request_id]
        self._push(request, group, key)

    def holds(self, request: Request) -> bool:
        return request.request_id in self._live and not request.status.is_finished

    def _push(self, request: Request, group: int, key: float) -> None:
        seq = next(self._order)
        self._live[request.request_id] = (seq, group, key)
        heapq.heappush(self._heap, (rank(request), group, key, seq, request))

    def peek(self) -> Request | None:
        while self._heap:
            _, _, _, seq, request = self._heap[0]
            live = self._live.get(request.request_id)
            if live is not None and live[0] == seq:
                if not request.status.is_finished:
                    return request
                del self._live[request.request_id]
            heapq.heappop(self._heap)
        return None

    def pop(self) -> Request:
        """Remove the request peek() returned."""
        request = heapq.heappop(self._heap)[4]
        del self._live[request.request_id]
        return request


class Scheduler:
    """Not thread-safe: the engine's one thread calls it."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []
        self._attention_cost_tokens: int | None = None  # this step's K: the config's while a request decodes
        self.waiting = WaitingQueue()
        self.num_steps = 0  # schedule() calls so far
        self._promotions: list[tuple[int, int, int, Request]] = []  # (due step, waiting since, seq, request)
        self._order = itertools.count()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_prefilling(self) -> int:
        return sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._start_waiting(request)
        self.waiting.push(request)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self._promote_due()
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
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
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            start = request.num_computed_tokens
            owed = request.num_tokens - start
            if budget <= 0 and owed > 1:
                break  # what is left prefills; every decode runs, even past the budget
            num_new_tokens = 1 if owed == 1 else self._tokens_within(start, owed, budget)
            if num_new_tokens == 0:  # only if the runner failed to sample for it; never schedule nothing
                continue
            drafts, request.draft_token_ids = request.draft_token_ids, []
            if owed == 1 and drafts:
                drafts = self._affordable_drafts(request, drafts, budget - self._cost(start, 1))
                if drafts:
                    scheduled.append(ScheduledRequest(request, 1 + len(drafts), start, drafts))
                    budget -= self._cost(start, 1 + len(drafts))
                    continue
            while not self.kv_cache.allocate_slots(request, num_new_tokens):
                victim = max(self.running, key=_importance_rank)
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
            if request is None or (foreground_only and rank(request) > 0):
                break
            # waiting requests (new or preempted) have num_computed_tokens == 0
            while True:
                hit_block_ids, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
                num_new_tokens = self._tokens_within(num_hit_tokens, request.num_tokens - num_hit_tokens, budget)
                if len(self.running) < self.config.max_num_seqs and self.kv_cache.allocate_slots(
                        request, num_new_tokens, hit_block_ids, num_hit_tokens):
                    break
                # Only less important requests yield, and only when that can make the room.
                victim = self._yielding_victim(request, num_hit_tokens + num_new_tokens, len(hit_block_ids))
                if victim is None:
                    return budget
                budget += self._preempt(victim, scheduled)
                preempted.append(victim)
            self.waiting.pop()
            request.num_waiting_steps += self.num_steps - request.waiting_since_step - 1
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = min(num_hit_tokens, request.num_prompt_tokens)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new_tokens, num_hit_tokens))
            budget -= self._cost(num_hit_tokens, num_new_tokens)
        return budget

    def _yielding_victim(self, request: Request, num_tokens: int, num_hit_blocks: int) -> Request | None:
        """The running request that gives way to `request`: the least important of those of a
        larger rank (background, not promoted), if giving way can seat it and cover its blocks."""
        weaker = [r for r in self.running if rank(r) > rank(request)]
        if not weaker:
            return None
        needed = -(-num_tokens // self.kv_cache.block_size) - num_hit_blocks
        if self.kv_cache.num_free_blocks + self.kv_cache.num_blocks_freed_by(weaker) < needed:
            return None  # even all of them would not free enough: none is preempted for nothing
        return max(weaker, key=_importance_rank)

    def _start_waiting(self, request: Request) -> None:
        request.waiting_since_step = self.num_steps
        if rank(request) > 0:
            # promoted at the start of the step by which it will have waited the bound in all
            due = self.num_steps + 1 + self.config.background_wait_steps - request.num_waiting_steps
            heapq.heappush(self._promotions, (due, self.num_steps, next(self._order), request))

    def _promote_due(self) -> None:
        while self._promotions and self._promotions[0][0] <= self.num_steps:
            _, since, _, request = heapq.heappop(self._promotions)
            if request.waiting_since_step == since and not request.promoted and self.waiting.holds(request):
                request.promoted = True
                self.waiting.reorder(request)

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
        self._start_waiting(request)
        self.waiting.push_front(request)
        return refund


def _step_order(request: Request) -> int:
    """0: it decodes; 1: a foreground prompt prefilling; 2: a background one."""
    if request.num_tokens - request.num_computed_tokens <= 1:
        return 0
    return 1 if rank(request) == 0 else 2


def _importance_rank(request: Request) -> tuple[int, float]:
    """Higher is less important: a larger rank, then a later arrival."""
    return rank(request), request.arrival_time
