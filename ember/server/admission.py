"""Admission: at most `capacity` sequences run, at most `max_pending` requests wait; a full queue
answers 429 at once, a wait longer than the timeout answers 503.

Requests carry their tenant (the owner of their API key). With `max_pending_per_tenant`, one
tenant's waiting requests are capped too (429 naming that limit), and a freed slot goes to the
waiting request whose tenant holds the fewest running requests, then to the tenant served least
recently, then to the earliest: tenants take turns, a tenant that floods the queue cannot starve
the others, and with one tenant it is first come, first served.

Background requests (priority above 0) take their slots from a pool of their own, the same size,
so a flood of them never keeps a foreground request waiting here: the engine's scheduler decides
between the two (background requests yield to foreground ones there, within its starvation
bound), and it holds at most `capacity` of each.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass

from ember.protocols.errors import QueueTimeout, ServerOverloaded

RETRY_AFTER_S = 2


@dataclass(slots=True)
class _Waiter:
    weight: int
    future: asyncio.Future
    tenant: str
    background: bool


class Ticket:
    """A held slot (of `weight` sequences); release it exactly once, when the request ends."""

    def __init__(self, admission: "Admission", weight: int, tenant: str, background: bool) -> None:
        self._admission = admission
        self.weight = weight
        self.tenant = tenant
        self.background = background
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release(self.weight, self.tenant, self.background)


class Admission:
    def __init__(self, capacity: int, max_pending: int, timeout: float, max_pending_per_tenant: int = 0) -> None:
        self.capacity = capacity
        self.max_pending = max_pending
        self.max_pending_per_tenant = max_pending_per_tenant  # 0: no share per tenant
        self.timeout = timeout  # seconds; 0: wait without limit
        self.in_use = 0
        self.in_use_by_pool = {False: 0, True: 0}  # keyed by background
        self.num_running = 0  # requests holding a ticket
        self.running_by_tenant: Counter[str] = Counter()
        self._last_grant: dict[str, int] = {}  # tenant -> the grant number it last received
        self._grants = itertools.count()
        self._waiters: deque[_Waiter] = deque()  # in arrival order
        self._closed: Exception | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, weight: int = 1, tenant: str = "default", background: bool = False) -> Ticket:
        """A ticket for `weight` sequences (a request's choices), once they fit in their pool."""
        weight = max(1, min(weight, self.capacity))
        if self._closed is not None:
            raise self._closed
        if not any(w.background == background for w in self._waiters) and self._fits(weight, background):
            return self._grant(weight, tenant, background)
        if len(self._waiters) >= self.max_pending:
            raise ServerOverloaded(len(self._waiters), RETRY_AFTER_S)
        if self.max_pending_per_tenant:
            mine = sum(1 for w in self._waiters if w.tenant == tenant)
            if mine >= self.max_pending_per_tenant:
                raise ServerOverloaded(mine, RETRY_AFTER_S, tenant=tenant)
        waiter = _Waiter(weight, asyncio.get_running_loop().create_future(), tenant, background)
        self._waiters.append(waiter)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout or None)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(weight, tenant, background)  # granted at the last moment: give it back
            else:
                waiter.future.cancel()
                self._remove(waiter)
            if isinstance(exc, asyncio.TimeoutError):
                raise QueueTimeout(time.monotonic() - started, RETRY_AFTER_S) from None
            raise
        return Ticket(self, weight, tenant, background)

    def close(self, error: Exception) -> None:
        """Refuse every waiting and future request with `error` (the server is stopping)."""
        self._closed = error
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _fits(self, weight: int, background: bool) -> bool:
        return self.in_use_by_pool[background] + weight <= self.capacity

    def _grant(self, weight: int, tenant: str, background: bool) -> Ticket:
        self._take(weight, tenant, background)
        return Ticket(self, weight, tenant, background)

    def _take(self, weight: int, tenant: str, background: bool) -> None:
        self.in_use += weight
        self.in_use_by_pool[background] += weight
        self.num_running += 1
        self.running_by_tenant[tenant] += 1
        self._last_grant[tenant] = next(self._grants)

    def _release(self, weight: int, tenant: str, background: bool) -> None:
        self.in_use -= weight
        self.in_use_by_pool[background] -= weight
        self.num_running -= 1
        self.running_by_tenant[tenant] -= 1
        if not self.running_by_tenant[tenant]:
            del self.running_by_tenant[tenant]
        self._wake()

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        self._wake()  # the head may have been what held the others back

    def _wake(self) -> None:
        for background in (False, True):
            while True:
                pool = [w for w in self._waiters if w.background == background]
                if not pool:
                    break
                # min keeps the earliest of equals
                waiter = min(pool, key=lambda w: (self.running_by_tenant[w.tenant],
                                                  self._last_grant.get(w.tenant, -1)))
                if waiter.future.done():
                    self._waiters.remove(waiter)
                    continue
                if not self._fits(waiter.weight, background):
                    break  # it waits for room; no one in its pool passes it, so a large request is never starved
                self._waiters.remove(waiter)
                self._take(waiter.weight, waiter.tenant, background)
                waiter.future.set_result(None)
