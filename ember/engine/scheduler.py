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
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int  # the step budget, in token costs
    max_model_len: int
    attention_cost_tokens: int | None = None  # K above; None: every token costs 1


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
    request: Request
    num_new_tokens: int
    start: int  # request.num_computed_tokens when scheduled
    # this chunk reaches the last token, so the runner samples one; fixed here, as the request grows
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        reaches_end = self.start + self.num_new_tokens == self.request.num_tokens
        self.samples = reaches_end and self.request.max_tokens > 0  # max_tokens 0: the prompt only


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted: list[Request]


class WaitingQueue:
    """Preempted requests first (the latest preempted in front), then new ones by (priority, arrival).

    Finished (aborted) requests are dropped lazily when they reach the front.
    """

    def __init__(self) -> None:
        self._preempted: deque[Request] = deque()
        self._new: list[tuple[int, float, int, Request]] = []  # heap
        self._order = itertools.count()

    def push(self, request: Request) -> None:
        heapq.heappush(self._new, (request.priority, request.arrival_time, next(self._order), request))

    def push_front(self, request: Request) -> None:
        self._preempted.appendleft(request)

    def peek(self) -> Request | None:
        while self._preempted and self._preempted[0].status.is_finished:
            self._preempted.popleft()
        if self._preempted:
            return self._preempted[0]
        while self._new and self._new[0][3].status.is_finished:
            heapq.heappop(self._new)
        return self._new[0][3] if self._new else None

    def pop(self) -> Request:
        """Remove the request peek() returned."""
        if self._preempted:
            return self._preempted.popleft()
        return heapq.heappop(self._new)[3]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []
        self._attention_cost_tokens: int | None = None  # this step's K: the config's while a request decodes
        self.waiting = WaitingQueue()

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
        self.waiting.push(request)

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        self._attention_cost_tokens = self.config.attention_cost_tokens if decoding else None
        budget = self._schedule_running(float(self.config.max_num_batched_tokens), scheduled, preempted)
        if not preempted:  # memory is short when something was preempted; admitting now would thrash
            self._admit_waiting(budget, scheduled)
        return SchedulerOutput(scheduled, sum(entry.num_new_tokens for entry in scheduled), preempted)

    def _cost(self, start: int, count: int) -> float:
        return chunk_cost(start, count, self._attention_cost_tokens)

    def _tokens_within(self, start: int, wanted: int, budget: float) -> int:
        return tokens_within(start, wanted, budget, self._attention_cost_tokens)

    def _schedule_running(self, budget: float, scheduled: list[ScheduledRequest], preempted: list[Request]) -> float:
        # Decodes first, then prompts still being prefilled: a long prompt never holds back the
        # next token of a request that is already streaming.
        self.running.sort(key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        index = 0
        while index < len(self.running):
            request = self.running[index]
            start = request.num_computed_tokens
            owed = request.num_tokens - start
            if budget <= 0 and owed > 1:
                break  # what is left prefills; every decode runs, even past the budget
            num_new_tokens = 1 if owed == 1 else self._tokens_within(start, owed, budget)
            if num_new_tokens == 0:  # only if the runner failed to sample for it; never schedule nothing
                index += 1
                continue
            while not self.kv_cache.allocate_slots(request, num_new_tokens):
                victim = max(self.running, key=_importance_rank)
                victim_index = self.running.index(victim)
                self._preempt(victim, victim_index)
                preempted.append(victim)
                if victim is request:
                    break
                if victim_index < index:  # already seen this step: take back what it was paid
                    index -= 1
                    for entry in scheduled:
                        if entry.request is victim:
                            scheduled.remove(entry)
                            budget += self._cost(entry.start, entry.num_new_tokens)
                            break
            else:
                scheduled.append(ScheduledRequest(request, num_new_tokens, start))
                budget -= self._cost(start, num_new_tokens)
                index += 1
        return budget

    def _admit_waiting(self, budget: float, scheduled: list[ScheduledRequest]) -> float:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request is None:
                break
            # waiting requests (new or preempted) have num_computed_tokens == 0
            hit_block_ids, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new_tokens = self._tokens_within(num_hit_tokens, request.num_tokens - num_hit_tokens, budget)
            if not self.kv_cache.allocate_slots(request, num_new_tokens, hit_block_ids, num_hit_tokens):
                break  # never preempt running requests to admit new ones
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = min(num_hit_tokens, request.num_prompt_tokens)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new_tokens, num_hit_tokens))
            budget -= self._cost(num_hit_tokens, num_new_tokens)
        return budget

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance each scheduled request and append its sampled tokens; returns those that finished (freed)."""
        finished: list[Request] = []
        for entry in output.scheduled:
            request = entry.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted since schedule()
            request.num_computed_tokens += entry.num_new_tokens
            self.kv_cache.cache_full_blocks(request)
            if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                self._finish(request, RequestStatus.FINISHED_LENGTH)  # prefilled, its full blocks cached
                finished.append(request)
                continue
            if not entry.samples:
                continue
            for token_id in sampled.get(request.request_id, ()):
                request.append_output_token(token_id)
                status = self._stop_status(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    finished.append(request)
                    break
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

    def _preempt(self, request: Request, running_index: int) -> None:
        del self.running[running_index]
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.push_front(request)


def _importance_rank(request: Request) -> tuple[int, float]:
    """Higher ranks are less important: a larger priority value, then a later arrival."""
    return request.priority, request.arrival_time
