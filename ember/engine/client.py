"""The front end's engine when the model runs in a supervised worker process (engine.worker).

    event loop  --Add/Abort/Query-->  PUSH ipc://.../wN-in   --> worker (PULL)
    event loop  <--Outputs/Answer/Fatal--  PULL ipc://.../wN-out <-- worker (PUSH)

A WorkerSupervisor (engine.supervisor) starts the worker and starts it again after it dies; once a
worker is ready, the event loop reads its messages itself (a reader on the socket's file
descriptor: no thread between a step and its stream).

A request whose worker died is sent again once, from the start, with the same id and seed, when
its consumer allows (`may_retry`: nothing of it has reached the client yet). The replay's tokens
that the consumer already has are checked against it and dropped, so the consumer sees one run;
a replay that differs ends the request with an error rather than a wrong reply. Otherwise the
request ends with EngineRestarted. A worker that holds work and sends nothing for the stall
timeout (engine.watchdog) is killed here, and its requests are handled the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from dataclasses import dataclass
from collections.abc import Sequence
from typing import AsyncIterator, Callable

import msgspec
import zmq

from ember.constraint_spec import ConstraintSpec
from ember.context_window import ContextWindow, fit_output
from ember.engine import messages
from ember.engine.messages import (Abort, Add, Answer, EngineInfo, Fatal, MediaSpan, Outputs, Query, QueryKind, Shutdown,
                                  WorkerSettings)
from ember.engine.outputs import RequestTracker
from ember.engine.stats import EngineCounters, EngineStats
from ember.engine.streams import RequestStreams
from ember.engine.supervisor import LoopBridge, Worker, WorkerExit, WorkerSupervisor, kill_if_running
from ember.engine.watchdog import DEFAULT_STALL_TIMEOUT_S, StallWatchdog
from ember.errors import EngineRestarted, EngineUnavailable, InvalidRequest
from ember.types import GenerationOutput, SamplingParams, StepOutput

logger = logging.getLogger("ember.engine")

_FATAL_EXIT_S = 5.0  # a worker that reported a fault and has not exited this long after is killed
_QUERY_TIMEOUT = 30.0
# EngineStats fields that only grow: a restarted worker's start from the dead one's
_COUNTERS = tuple(f.name for f in dataclasses.fields(EngineCounters)) + ("prefix_cache_queries", "prefix_cache_hits")


@dataclass(slots=True)
class WorkerLost:
    """Put in every live request's queue when the worker died."""

    reason: str


class _Replay:
    """A resubmitted request's first tokens, which the consumer already has: checked, then dropped."""

    def __init__(self, delivered: list[int]) -> None:
        self.expected = delivered
        self.position = 0

    def trim(self, step: StepOutput) -> StepOutput | None:
        """The step without what was delivered before; None when nothing new is left in it."""
        if self.position >= len(self.expected):
            return step
        ids = step.new_token_ids
        overlap = min(len(ids), len(self.expected) - self.position)
        if ids[:overlap] != self.expected[self.position:self.position + overlap]:
            raise EngineRestarted("the engine worker restarted and the request's second run differs from its first")
        self.position += overlap
        if step.finish_reason is not None and self.position < len(self.expected):
            if step.error:
                return step
            raise EngineRestarted("the engine worker restarted and the request's second run ended early")
        if overlap == len(ids) and step.finish_reason is None:
            return None
        logprobs = step.logprobs[overlap:] if step.logprobs is not None else None
        return dataclasses.replace(step, new_token_ids=ids[overlap:], logprobs=logprobs)


class _Resubmission:
    """One request's `screen` (engine.streams): when its worker dies, it sends the request again
    once, if the consumer allows, and drops what the replay repeats."""

    def __init__(self, client: EngineClient, add: Add, may_retry: Callable[[], bool] | None) -> None:
        self.client = client
        self.add = add
        self.may_retry = may_retry
        self.replay: _Replay | None = None

    @property
    def sees_steps(self) -> bool:
        return self.replay is not None  # its steps repeat what the consumer may have already

    async def __call__(self, item: StepOutput | WorkerLost, tracker: RequestTracker) -> StepOutput | None:
        if type(item) is not WorkerLost:
            return self.replay.trim(item)
        if self.replay is not None or (self.may_retry is not None and not self.may_retry()):
            raise EngineRestarted(f"the engine worker stopped while this request ran: {item.reason}")
        client = self.client
        if not await client.wait_ready(None):
            raise EngineUnavailable(f"the engine is not running: {client.failed}")
        self.replay = _Replay(list(tracker.token_ids))
        logger.info("request %s runs again after the engine worker restarted", self.add.request_id)
        client.send(self.add)
        return None


class EngineClient:
    """engine.contract.Engine over a supervised worker process: the model runs elsewhere."""

    def __init__(self, settings: WorkerSettings, tokenizer, env: dict[str, str] | None = None,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.streams = RequestStreams(tokenizer)
        # the live worker's cached prefix block hashes, when settings.report_cache_changes
        self.cached_blocks: set[bytes] = set()
        self.status = "loading"  # loading (first start or a restart) -> ok; unavailable after a fault loop
        self.failed: str | None = None  # why the engine is unavailable
        self.info: EngineInfo | None = None
        self.worker_pid: int | None = None
        self._stats: EngineStats | None = None  # the live worker's, as of its last step
        self._base = dict.fromkeys(_COUNTERS, 0)  # the totals of workers that died, so totals never go back
        self._push: zmq.Socket | None = None  # the live worker's inbox; the event loop's alone
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._closing = threading.Event()
        self._bridge = LoopBridge(self._closing)
        self._ready: asyncio.Event | None = None
        self._supervisor = WorkerSupervisor(settings, env, self._bridge, self._closing, on_ready=self._on_ready,
                                            retire=self._retire, on_lost=self._on_lost)
        # 0: no watchdog (a hung worker then waits for its clients to give up)
        self._watchdog = StallWatchdog(stall_timeout, self._holds_work, self._on_stall) if stall_timeout > 0 else None

    @property
    def worker_restarts(self) -> int:
        return self._supervisor.restarts

    # ---- starting and stopping ----------------------------------------------------------------

    def launch(self) -> EngineInfo:
        """Start the first worker and wait until its model is loaded (blocks; the loading thread
        calls it). A load failure raises ModelLoadError with the worker's reason."""
        return self._supervisor.launch().info

    def start(self) -> None:
        """Attach to the running event loop (call from inside it, after `launch`)."""
        if self._bridge.loop is not None:
            return

        def attached() -> None:
            self._ready = asyncio.Event()
            if self.status == "ok":
                self._ready.set()
                self._watch(self._supervisor.worker)
            if self._watchdog is not None:
                self._watchdog.start(self._bridge.loop)

        self._bridge.attach(attached)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker (live requests are aborted there) and wait for it to exit."""
        self._closing.set()
        # The sockets are the event loop's: it sends the last message and drops its reader (none
        # may outlive its socket).
        self._bridge.run(self.send, Shutdown(), wait=timeout)
        if self._watchdog is not None:
            self._bridge.run(self._watchdog.stop, wait=timeout)
        worker = self._supervisor.stop(timeout)
        if worker is not None:
            self._bridge.run(self._unwatch, worker, wait=timeout)
        self._supervisor.close()

    # ---- requests -----------------------------------------------------------------------------

    async def wait_ready(self, timeout: float | None) -> bool:
        """True once a worker serves; False when it is not back within `timeout` (None: no limit)
        or the engine gave up."""
        if self.status == "loading" and self._ready is not None:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return False
        return self.status == "ok"

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None, cache_salt: str | None = None,
                       constraint: ConstraintSpec | None = None, report_progress: bool = False,
                       may_retry: Callable[[], bool] | None = None, media: Sequence[MediaSpan] = (),
                       session: str | None = None) -> AsyncIterator[GenerationOutput]:
        """engine.contract.Engine.generate."""
        if not await self.wait_ready(None):
            raise EngineUnavailable(f"the engine is not running: {self.failed}")
        window = ContextWindow(self.info.max_model_len, self.info.kv_capacity_tokens)
        fit_output(window, len(prompt_token_ids), params.max_tokens, over_room="refuse")
        add = self.streams.new_request(prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt,
                                       constraint=constraint, report_progress=report_progress, media=media)
        async for output in self.streams.follow(add, self.send, _Resubmission(self, add, may_retry)):
            yield output

    def abort(self, request_id: str) -> None:
        self.send(Abort([request_id]))

    async def check_constraint(self, spec: ConstraintSpec) -> None:
        """Raise InvalidRequest (naming the field) unless the worker can compile the spec's
        grammar; it keeps the result in its cache for the request that follows."""
        await self.query(QueryKind.CHECK_CONSTRAINT, spec)

    async def query(self, kind: QueryKind, constraint: ConstraintSpec | None = None):
        """Ask the worker between steps (messages.Query); its answer, or the error it raised."""
        if not await self.wait_ready(_QUERY_TIMEOUT):
            raise EngineUnavailable("the engine is not running")
        query_id = next(self._query_ids)
        future = self._bridge.loop.create_future()
        self._queries[query_id] = future
        self.send(Query(query_id, kind, constraint))
        try:
            return await asyncio.wait_for(future, _QUERY_TIMEOUT)
        finally:
            self._queries.pop(query_id, None)

    def health(self) -> dict:
        last = self._supervisor.last_exit
        return {"worker_pid": self.worker_pid, "worker_restarts": self.worker_restarts,
                "worker_exits": dict(self._supervisor.exits),
                "last_worker_exit": {"cause": last.cause, "reason": last.reason} if last is not None else None}

    def send(self, message: msgspec.Struct) -> None:
        if self._push is None:
            return  # no worker: an abort has nothing to stop; an add is sent again once one is back
        try:
            self._push.send(messages.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the worker has just died (its queue has no bound): the same as no worker

    @property
    def latest_stats(self) -> EngineStats | None:
        """The engine's statistics as of the worker's last step, totals counted across restarts
        (built when read, by health and metrics, not at every step)."""
        stats = self._stats
        if stats is None:
            return None
        return dataclasses.replace(stats, **{name: self._base[name] + getattr(stats, name) for name in _COUNTERS})

    # ---- the event loop's side: the worker's messages ------------------------------------------

    def _watch(self, worker: Worker) -> None:
        """Read the worker's messages on the event loop from now on."""
        self._bridge.loop.add_reader(worker.pull.getsockopt(zmq.FD), self._read, worker)
        worker.watched = True
        self._read(worker)  # the descriptor signals changes only: what came before is read now

    def _unwatch(self, worker: Worker) -> None:
        if worker.watched:
            worker.watched = False
            self._bridge.loop.remove_reader(worker.pull.getsockopt(zmq.FD))

    def _read(self, worker: Worker) -> None:
        """Deliver everything the worker has sent (the reader's callback)."""
        pull = worker.pull
        while True:
            try:
                message = messages.from_worker.decode(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if self._watchdog is not None:
                self._watchdog.progress()  # a Heartbeat says no more than this
            if type(message) is Outputs:
                self._stats = message.stats
                if message.cache is not None:
                    self._apply_cache_changes(message.cache)
                self.streams.deliver(message.outputs)
            elif type(message) is Answer:
                self._answer(message)
            elif type(message) is Fatal and worker.fatal is None:
                worker.fatal = message
                if self._bridge.loop is not None:
                    self._bridge.loop.call_later(_FATAL_EXIT_S, kill_if_running, worker.process)

    def _apply_cache_changes(self, changes: messages.CacheChanges) -> None:
        cached = self.cached_blocks
        if changes.cleared:
            cached.clear()
        cached.difference_update(changes.removed)
        cached.update(changes.stored)

    def _answer(self, message: Answer) -> None:
        future = self._queries.get(message.query_id)
        if future is None or future.done():
            return
        if message.code is not None:
            future.set_exception(InvalidRequest(message.error, param=message.param, code=message.code))
        elif message.error:
            future.set_exception(AssertionError(message.error))
        else:
            future.set_result(message.value)

    # ---- the supervisor's callbacks (on the event loop once one is attached) -------------------

    def _retire(self, worker: Worker) -> WorkerExit | None:
        """Take a dead worker's last messages and close its output socket; why it stopped, when
        this side knows (the watchdog killed it, or it reported a fault)."""
        self._read(worker)
        self._unwatch(worker)
        worker.pull.close(0)
        if worker.stalled is not None:
            return WorkerExit("stalled", worker.stalled)
        return WorkerExit("fault", worker.fatal.message) if worker.fatal is not None else None

    # ---- the watchdog's callbacks (on the event loop) -------------------------------------------

    def _holds_work(self) -> bool:
        return self.status == "ok" and not self._closing.is_set() and bool(self.streams.num_live or self._queries)

    def _on_stall(self, silent: float) -> None:
        """Kill the live worker: the supervisor restarts it as after a crash."""
        worker = self._supervisor.worker
        if worker is None or worker.stalled is not None or worker.process.poll() is not None:
            return
        worker.stalled = (f"the engine worker made no progress for {silent:.0f} s while it held work "
                          f"(--worker-stall-timeout {self._watchdog.timeout:g}): killed")
        logger.error("engine worker %d: %s", worker.process.pid, worker.stalled)
        worker.process.kill()

    def _on_ready(self, worker: Worker) -> None:
        ready = worker.ready
        self._push = worker.push
        self.info, self.worker_pid = ready.info, ready.pid
        self._stats = ready.stats
        self.status = "ok"
        if self._watchdog is not None:
            self._watchdog.progress()  # a fresh worker's clock starts now
        if self._bridge.loop is not None and not self._closing.is_set():  # shutdown closes the sockets
            self._watch(worker)
        if self._ready is not None:
            self._ready.set()

    def _on_lost(self, reason: str, gave_up: bool) -> None:
        if self._push is not None:
            self._push.close(0)
            self._push = None
        if self._stats is not None:
            self._base = {name: getattr(self.latest_stats, name) for name in _COUNTERS}
        self.worker_pid = None
        self.cached_blocks.clear()
        self.streams.forget_pauses()
        self.status = "unavailable" if gave_up else "loading"
        if gave_up:
            self.failed = reason
        if self._ready is not None and gave_up:
            self._ready.set()  # waiters wake to the news
        elif self._ready is not None:
            self._ready.clear()
        self.streams.tell_all(WorkerLost(reason))
        for future in self._queries.values():
            if not future.done():
                future.set_exception(EngineUnavailable(f"the engine worker stopped: {reason}"))
