"""Admission: at most `capacity` sequences run, at most `max_pending` requests wait, first come first
served; a full queue answers 429 at once, a wait longer than the timeout answers 503."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from ember.protocols.errors import QueueTimeout, ServerOverloaded

RETRY_AFTER_S = 2


@dataclass(slots=True)
class _Waiter:
    weight: int
    future: asyncio.Future


class Ticket:
    """A held slot (of `weight` sequences); release it exactly once, when the request ends."""

    def __init__(self, admission: "Admission", weight: int) -> None:
        self._admission = admission
        self.weight = weight
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release(self.weight)


class Admission:
    def __init__(self, capacity: int, max_pending: int, timeout: float) -> None:
        self.capacity = capacity
        self.max_pending = max_pending
        self.timeout = timeout  # seconds; 0: wait without limit
        self.in_use = 0
        self.num_running = 0  # requests holding a ticket
        self._waiters: deque[_Waiter] = deque()
        self._closed: Exception | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, weight: int = 1) -> Ticket:
        """A ticket for `weight` sequences (a request's choices), once they fit."""
        weight = max(1, min(weight, self.capacity))
        if self._closed is not None:
            raise self._closed
        if not self._waiters and self.in_use + weight <= self.capacity:
            return self._grant(weight)
        if len(self._waiters) >= self.max_pending:
            raise ServerOverloaded(len(self._waiters), RETRY_AFTER_S)
        waiter = _Waiter(weight, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout or None)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(weight)  # granted at the last moment: give it back
            else:
                waiter.future.cancel()
                self._remove(waiter)
            if isinstance(exc, asyncio.TimeoutError):
                raise QueueTimeout(time.monotonic() - started, RETRY_AFTER_S) from None
            raise
        return Ticket(self, weight)

    def close(self, error: Exception) -> None:
        """Refuse every waiting and future request with `error` (the server is stopping)."""
        self._closed = error
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _grant(self, weight: int) -> Ticket:
        self.in_use += weight
        self.num_running += 1
        return Ticket(self, weight)

    def _release(self, weight: int) -> None:
        self.in_use -= weight
        self.num_running -= 1
        self._wake()

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        self._wake()  # the head may have been what held the others back

    def _wake(self) -> None:
        while self._waiters and self.in_use + self._waiters[0].weight <= self.capacity:
            waiter = self._waiters.popleft()
            if waiter.future.done():
                continue
            self.in_use += waiter.weight
            self.num_running += 1
            waiter.future.set_result(None)
