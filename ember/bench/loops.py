"""How requests are issued within a level: closed loop, open loop (Poisson) or conversations.

Each loop only decides when to call `send(spec)`; `send` does the request and records it.
`run_with_limits` cancels whatever is still in flight at the deadline or on Ctrl-C, which closes
the open streams (the server sees a disconnect and frees the request).
"""

from __future__ import annotations

import asyncio
import random
from typing import Awaitable, Callable

from ember.bench.records import LevelClock
from ember.bench.workload import Conversation, RequestSpec

Send = Callable[[RequestSpec], Awaitable[str | None]]  # the reply text, or None when the request failed


async def closed_loop(specs: list[RequestSpec], concurrency: int, send: Send) -> None:
    """`concurrency` workers; each sends its next request as soon as its last one ends."""
    queue = iter(specs)  # shared: each spec goes to exactly one worker

    async def worker() -> None:
        for spec in queue:
            await send(spec)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def poisson_arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """Send times in seconds: the first at 0, then exponential gaps of mean 1 / rate."""
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def open_loop(specs: list[RequestSpec], arrivals: list[float], clock: LevelClock, send: Send) -> None:
    """Each request leaves at its arrival time, whether or not earlier ones have finished."""
    in_flight: list[asyncio.Task] = []
    try:
        for spec, at in zip(specs, arrivals):
            delay = at - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            in_flight.append(asyncio.ensure_future(send(spec)))
        await asyncio.gather(*in_flight)
    finally:  # cancelled, or a bug: no stream may outlive the level
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)


async def conversation_loop(conversations: list[Conversation], turns: int, send: Send) -> None:
    """All conversations at once; within one, each turn waits for the previous reply."""

    async def talk(conversation: Conversation) -> None:
        for _ in range(turns):
            reply = await send(conversation.next_request())
            if reply is None:  # a failed turn has no reply to build on: the conversation ends
                return
            conversation.add_reply(reply)

    await asyncio.gather(*(talk(c) for c in conversations))


async def run_with_limits(work: Awaitable[None], max_seconds: float | None, interrupt: asyncio.Event) -> str | None:
    """Run a level's work to its end; None, or why it was cut short: "max_seconds" or "interrupt"."""
    work_task = asyncio.ensure_future(work)
    interrupted = asyncio.ensure_future(interrupt.wait())
    try:
        done, _ = await asyncio.wait({work_task, interrupted}, timeout=max_seconds,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel(work_task)
        raise
    finally:
        interrupted.cancel()
    if work_task in done:
        work_task.result()  # re-raises a bug in the loop
        return None
    await _cancel(work_task)
    return "interrupt" if interrupt.is_set() else "max_seconds"


async def _cancel(task: asyncio.Future) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
