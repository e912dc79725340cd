"""The requests waiting to run, in the order they are served, and the starvation bound.

Priorities: 0 is foreground, larger values are background work (SamplingParams.priority). The
queue serves the smallest served priority first; within one, preempted requests (the latest
preempted in front), then new ones by arrival. Starvation bound: a background request that has
spent `background_wait_steps` steps waiting, summed over every time it waited, is promoted: from
the next step on it is served as a foreground request that arrived when it did, so no later
foreground request passes it in the queue or preempts it for room.
"""

from __future__ import annotations

import heapq
import itertools

from ember.engine.request import Request


def served_priority(request: Request) -> int:
    """The priority a request is served at: its own, or 0 (foreground) once promoted."""
    return 0 if request.promoted else request.priority


class WaitingQueue:
    """Each waiting request has one live heap entry; entries left behind by a promotion and
    requests finished while waiting (aborted) are dropped lazily when they reach the front.

    `step` arguments are the scheduler's step count: a request's waiting steps are counted from them.
    """

    def __init__(self, background_wait_steps: int) -> None:
        self.background_wait_steps = background_wait_steps
        self._heap: list[tuple[int, int, float, int, Request]] = []  # (served priority, group, key, seq, request)
        self._live: dict[str, tuple[int, int, float]] = {}  # request id -> its live entry's (seq, group, key)
        self._promotions: list[tuple[int, int, int, Request]] = []  # heap of (due step, waiting since, seq, request)
        self._order = itertools.count()

    def push(self, request: Request, step: int) -> None:
        """A new request, in arrival order."""
        self._start_waiting(request, step)
        self._push(request, 1, request.arrival_time)

    def push_front(self, request: Request, step: int) -> None:
        """A preempted request, ahead of the new ones and of those preempted before it."""
        self._start_waiting(request, step)
        self._push(request, 0, -next(self._order))

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

    def pop(self, step: int) -> Request:
        """Remove the request peek() returned, as it is admitted at `step`."""
        request = heapq.heappop(self._heap)[4]
        del self._live[request.request_id]
        request.num_waiting_steps += step - request.waiting_since_step - 1
        return request

    def promote_due(self, step: int) -> None:
        """Promote each waiting background request that has waited its bound, in all, before `step`."""
        while self._promotions and self._promotions[0][0] <= step:
            _, since, _, request = heapq.heappop(self._promotions)
            if request.waiting_since_step == since and not request.promoted and self._holds(request):
                request.promoted = True
                _, group, key = self._live[request.request_id]
                self._push(request, group, key)  # the same place within its group, served as foreground

    def _start_waiting(self, request: Request, step: int) -> None:
        request.waiting_since_step = step
        if served_priority(request) > 0:
            # promoted at the start of the step by which it will have waited the bound in all
            due = step + 1 + self.background_wait_steps - request.num_waiting_steps
            heapq.heappush(self._promotions, (due, step, next(self._order), request))

    def _push(self, request: Request, group: int, key: float) -> None:
        seq = next(self._order)
        self._live[request.request_id] = (seq, group, key)
        heapq.heappush(self._heap, (served_priority(request), group, key, seq, request))

    def _holds(self, request: Request) -> bool:
        return request.request_id in self._live and not request.status.is_finished
