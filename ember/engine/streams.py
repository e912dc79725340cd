"""The front end's side of an engine: each live request's queue of step outputs, and the one loop
that turns them into GenerationOutputs.

An engine that runs elsewhere (a worker process: engine.client; a thread: engine.engine) sends a
request as an `Add` and delivers its StepOutputs here; `follow` reads them, detokenizes and applies
stop strings (RequestTracker), and aborts the request in the engine when a stop string ends it or
its consumer leaves early.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import AsyncIterator, Callable, Iterable, Protocol

import msgspec

from ember.constraint_spec import ConstraintSpec
from ember.engine.messages import Abort, Add, MediaSpan
from ember.engine.outputs import RequestTracker
from ember.errors import EmberError
from ember.types import GenerationOutput, SamplingParams, StepOutput

class Screen(Protocol):
    """What `follow` makes of a queued item that is not a StepOutput (an engine client's news that
    its worker died), and of every StepOutput while `sees_steps`: the StepOutput to hand on, or
    None for nothing, given what the consumer has; it may raise to end the request."""

    sees_steps: bool

    async def __call__(self, item: object, tracker: RequestTracker) -> StepOutput | None: ...


class RequestStreams:
    """The live requests of one engine, by id. Lives on the front end's event loop."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()

    def new_request(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    cache_salt: str | None = None, constraint: ConstraintSpec | None = None,
                    report_progress: bool = False, media: Sequence[MediaSpan] = ()) -> Add:
        return Add(request_id or f"req-{next(self._ids)}", prompt_token_ids, params, cache_salt, time.time(),
                   constraint, report_progress, list(media))

    @property
    def num_live(self) -> int:
        return len(self._queues)

    def deliver(self, steps: Iterable[StepOutput]) -> None:
        """Hand each step to its request's queue (a request that has left drops what it missed)."""
        queues = self._queues
        for step in steps:
            queue = queues.get(step.request_id)
            if queue is not None:
                queue.put_nowait(step)

    def tell_all(self, news: object) -> None:
        """Put `news` in every live request's queue (its `screen` decides what it means)."""
        for queue in self._queues.values():
            queue.put_nowait(news)

    async def follow(self, add: Add, send: Callable[[msgspec.Struct], None],
                     screen: Screen | None = None) -> AsyncIterator[GenerationOutput]:
        """Send `add` to the engine and yield the request's outputs until it finishes.

        A stop string ends the request here and aborts it in the engine; so does leaving the
        iteration early (a client gone, a cancelled task).
        """
        if add.request_id in self._queues:
            raise EmberError(f"request id {add.request_id!r} is already running", param="request_id", status=400)
        queue = self._queues[add.request_id] = asyncio.Queue()
        tracker = RequestTracker(add.request_id, add.prompt_token_ids, add.params,
                                 self.tokenizer.hf.backend_tokenizer, add.arrival_time)
        send(add)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if type(item) is not StepOutput or (screen is not None and screen.sees_steps):
                    item = await screen(item, tracker)
                    if item is None:
                        continue
                output = tracker.update(item)
                finished = output.finished
                if tracker.stopped_by_string:
                    send(Abort([add.request_id]))
                yield output
        finally:
            del self._queues[add.request_id]
            if not finished:
                send(Abort([add.request_id]))
