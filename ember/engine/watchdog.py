"""The front end's watch on an engine worker that stops making progress without dying: a stuck
kernel, a stopped process, a deadlock in a collective.

Progress is any message from the worker: a step's Outputs, an Answer, or the Heartbeat it sends
while it waits with nothing to step (engine.worker). A worker that holds work (`holds_work()`) and
has sent nothing for `timeout` seconds is stalled: `on_stall(seconds)` is called once, and the
caller kills it, so the supervisor restarts it through the same path as a crash.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

# Well above the slowest legitimate step: one long prefill chunk of a large model on a slow CPU
# (a 70B model at a few tokens a second makes a 2,048-token chunk a matter of minutes), or the
# compilation of a large grammar between steps. A false stall costs a restart; a true one only waits.
DEFAULT_STALL_TIMEOUT_S = 300.0
_MAX_CHECK_INTERVAL_S = 1.0


class StallWatchdog:
    """Checks on the event loop, every quarter of the timeout (at most every second)."""

    def __init__(self, timeout: float, holds_work: Callable[[], bool], on_stall: Callable[[float], None]) -> None:
        self.timeout = timeout
        self.holds_work = holds_work
        self.on_stall = on_stall
        self.last_progress = time.monotonic()
        self._interval = min(timeout / 4, _MAX_CHECK_INTERVAL_S)
        self._timer: asyncio.TimerHandle | None = None

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None:
            self._timer = loop.call_later(self._interval, self._check, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        silent = time.monotonic() - self.last_progress
        if silent >= self.timeout and self.holds_work():
            self.progress()  # the next verdict waits a whole timeout (the caller restarts the worker meanwhile)
            self.on_stall(silent)
        self._timer = loop.call_later(self._interval, self._check, loop)
