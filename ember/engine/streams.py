"""The front end's side of an engine: each live request's queue of step outputs, and the one loop
that turns them into GenerationOutputs.

An engine that runs elsewhere (a worker process: engine.client; a thread: engine.engine) sends a
request as an `Add` and delivers its StepOutputs here; `follow` reads them, detokenizes and applies
stop strings (RequestTracker), and aborts the request in the engine when a stop string ends it or
its consumer leaves early. A consumer that falls behind has its request paused in the engine
until it catches up (engine.backlog).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterable, Protocol

import msgspec

from ember.constraint_spec import ConstraintSpec
from ember.engine.backlog import Backlog
from ember.engine.messages import Abort, Add, MediaSpan, Pause, Resume
from ember.engine.outputs import RequestTracker
from ember.errors import EmberError
from ember.types import GenerationOutput, SamplingParams, StepOutput

class Screen(Protocol):
    """What `follow` makes of a queued item that is not a StepOutput (an engine client's news that
    its worker died), and of every StepOutput while `sees_steps`: the StepOutput to hand on, or
    None for nothing, given what the consumer has; it may raise to end the request."""

    sees_steps: bool

    async def __call__(self, item: object, tracker: RequestTracker) -> StepOutput | None: ...


@dataclass(slots=True)
class _Stream:
    """One live request: its queue of step outputs (and news), its backlog, and how to reach its engine."""

    send: Callable[[msgspec.Struct], None]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    backlog: Backlog = field(default_factory=Backlog)


class RequestStreams:
    """The live requests of one engine, by id. Lives on the front end's event loop."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()

    def new_request(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    cache_salt: str | None = None, constraint: ConstraintSpec | None = None,
                    report_progress: bool = False, media: Sequence[MediaSpan] = ()) -> Add:
        return Add(request_id or f"req-{next(self._ids)}", prompt_token_ids, params, cache_salt, time.time(),
                   constraint, report_progress, list(media))

    @property
    def num_live(self) -> int:
        return len(self._streams)

    def deliver(self, steps: Iterable[StepOutput]) -> None:
        """Hand each step to its request's queue (a request that has left drops what it missed);
        pause a request whose consumer has too much unread."""
        streams = self._streams
        for step in steps:
            stream = streams.get(step.request_id)
            if stream is not None:
                stream.queue.put_nowait(step)
                if stream.backlog.delivered(len(step.new_token_ids)):
                    stream.send(Pause([step.request_id]))

    def tell_all(self, news: object) -> None:
        """Put `news` in every live request's queue (its `screen` decides what it means)."""
        for stream in self._streams.values():
            stream.queue.put_nowait(news)

    def forget_pauses(self) -> None:
        """The engine that paused requests is gone (its worker died): a request still behind is
        paused again in the next one."""
        for stream in self._streams.values():
            stream.backlog.engine_forgot()

    async def follow(self, add: Add, send: Callable[[msgspec.Struct], None],
                     screen: Screen | None = None) -> AsyncIterator[GenerationOutput]:
        """Send `add` to the engine and yield the request's outputs until it finishes.

        A stop string ends the request here and aborts it in the engine; so does leaving the
        iteration early (a client gone, a cancelled task).
        """
        if add.request_id in self._streams:
            raise EmberError(f"request id {add.request_id!r} is already running", param="request_id", status=400)
        stream = self._streams[add.request_id] = _Stream(send)
        queue, backlog = stream.queue, stream.backlog
        tracker = RequestTracker(add.request_id, add.prompt_token_ids, add.params,
                                 self.tokenizer.hf.backend_tokenizer, add.arrival_time)
        send(add)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if type(item) is StepOutput and backlog.taken(len(item.new_token_ids)):
                    send(Resume([add.request_id]))
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
            del self._streams[add.request_id]
            if not finished:
                send(Abort([add.request_id]))
