"""The front end's engine: a supervised worker process (ember.engine.worker) behind ZeroMQ.

    event loop  --Add/Abort/Query-->  PUSH ipc://.../wN-in   --> worker (PULL)
    event loop  <--Outputs/Answer/Fatal--  PULL ipc://.../wN-out <-- worker (PUSH)

The supervisor thread launches the worker, reads what it sends while it loads (Ready or Fatal),
then hands both sockets to the event loop, which reads the worker's messages itself (a reader on
the socket's file descriptor: no thread between a step and its stream). The thread then only
waits for the process to end (a crash, SIGKILL, running out of memory, a fatal step), has the
event loop take the dead worker's last messages and close its sockets, and starts a fresh worker
with the same settings, on fresh sockets so nothing queued for the dead one reaches the new one.
Three deaths within a minute is a fault loop: the engine is then unavailable, with the reason,
instead of restarting forever.

A request whose worker died is sent again once, from the start, with the same id and seed, when
its consumer allows (`may_retry`: nothing of it has reached the client yet). The replay's tokens
that the consumer already has are checked against it and dropped, so the consumer sees one run;
a replay that differs ends the request with an error rather than a wrong reply. Otherwise the
request ends with EngineRestarted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import msgspec
import zmq

from ember.constraint_spec import ConstraintSpec
from ember.context_window import ContextWindow, fit_output
from ember.engine import messages
from ember.engine.messages import Add, Abort, Answer, EngineInfo, Fatal, Outputs, Query, Ready, Shutdown, WorkerSettings
from ember.engine.outputs import open_stream
from ember.engine.parent_death import child_environment
from ember.engine.stats import EngineCounters, EngineStats
from ember.errors import EngineRestarted, EngineUnavailable, InvalidRequest, ModelLoadError
from ember.types import GenerationOutput, SamplingParams, StepOutput

logger = logging.getLogger("ember.engine")

_POLL_MS = 100  # while a worker loads, how often its process is checked
# What a worker sent just before it died may still be on its way through ZeroMQ's I/O thread
# when its exit is seen: the event loop keeps reading this long before it closes the socket.
_LAST_WORDS_S = 0.05
_FATAL_EXIT_S = 5.0  # a worker that reported a fault and has not exited this long after is killed
# A worker that dies this soon after it was ready is a quick death; this many in a row (a load
# that fails counts as one) is a fault loop, and the engine stops restarting. Slow loads do not
# stretch the window: it runs from ready to death.
_FAULT_LOOP = (3, 60.0)
_QUERY_TIMEOUT = 30.0
# EngineStats fields that only grow: a restarted worker's start from the dead one's
_COUNTERS = tuple(f.name for f in dataclasses.fields(EngineCounters)) + ("prefix_cache_queries", "prefix_cache_hits")


class _WorkerFailed(Exception):
    def __init__(self, message: str, fatal: Fatal | None = None) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclass(slots=True)
class _Lost:
    """Put in a live request's queue when its worker died."""

    reason: str


@dataclass(slots=True)
class _Worker:
    """One worker generation: its process and its two sockets (the supervisor thread's while it
    loads, the event loop's once it is ready)."""

    process: subprocess.Popen
    push: zmq.Socket
    pull: zmq.Socket
    ready: Ready | None = None
    fatal: Fatal | None = None  # its last word, if it reported a fault
    watched: bool = False  # the event loop has a reader on `pull`


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


class EngineClient:
    """What the server calls `engine`: generate, abort, statistics, health; the model runs elsewhere."""

    def __init__(self, settings: WorkerSettings, tokenizer, env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.env = env  # the worker process's environment (None: this one's)
        # the live worker's cached prefix block hashes, when settings.report_cache_changes
        self.cached_blocks: set[bytes] = set()
        self.status = "loading"  # loading (first start or a restart) -> ok; unavailable after a fault loop
        self.failed: str | None = None  # why the engine is unavailable
        self.info: EngineInfo | None = None
        self.worker_pid: int | None = None
        self.worker_restarts = 0
        self._stats: EngineStats | None = None  # the live worker's, as of its last step
        self._base = dict.fromkeys(_COUNTERS, 0)  # the totals of workers that died, so totals never go back
        self._context = zmq.Context()
        self._folder = tempfile.mkdtemp(prefix="ember-engine-")
        self._generation = itertools.count()
        self._worker: _Worker | None = None
        self._push: zmq.Socket | None = None  # the live worker's inbox; the event loop's alone
        self._streams: dict[str, asyncio.Queue] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._ids = itertools.count()
        self._quick_deaths = 0
        self._closing = threading.Event()
        self._first: concurrent.futures.Future = concurrent.futures.Future()
        # Held while the supervisor thread calls into the front end and while `start` attaches the
        # event loop: before it, such calls run on the thread; after it, on the loop.
        self._attach = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._supervise, name="ember-supervisor", daemon=True)

    # ---- starting and stopping ----------------------------------------------------------------

    def launch(self) -> EngineInfo:
        """Start the first worker and wait until its model is loaded (blocks; the loading thread
        calls it). A load failure raises ModelLoadError with the worker's reason."""
        self._thread.start()
        ready: Ready = self._first.result()
        return ready.info

    def start(self) -> None:
        """Attach to the running event loop (call from inside it, after `launch`)."""
        if self._loop is not None:
            return
        with self._attach:
            self._loop = asyncio.get_running_loop()
            self._ready = asyncio.Event()
            if self.status == "ok":
                self._ready.set()
                self._watch(self._worker)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker (live requests are aborted there) and wait for it to exit."""
        self._closing.set()
        worker = self._worker
        # The sockets are the event loop's: it sends the last message and drops its reader (none
        # may outlive its socket).
        self._in_loop(self._send, Shutdown(), wait=timeout)
        if worker is not None:
            _stop_process(worker.process, timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if worker is not None:
            self._in_loop(self._unwatch, worker, wait=timeout)
        self._context.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)

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
                       may_retry: Callable[[], bool] | None = None) -> AsyncIterator[GenerationOutput]:
        """Submit a request and yield its outputs until it finishes (see AsyncEngine.generate).
        `may_retry()` says, when the worker dies, whether the request may run again from the
        start (None: always, once)."""
        if not await self.wait_ready(None):
            raise EngineUnavailable(f"the engine is not running: {self.failed}")
        window = ContextWindow(self.info.max_model_len, self.info.kv_capacity_tokens)
        fit_output(window, len(prompt_token_ids), params.max_tokens, over_room="refuse")
        request_id = request_id or f"req-{next(self._ids)}"
        stream, tracker = open_stream(self._streams, request_id, prompt_token_ids, params, self.tokenizer)
        add = Add(request_id, prompt_token_ids, params, cache_salt, tracker.timings.arrival, constraint, report_progress)
        self._send(add)
        replay: _Replay | None = None
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, _Lost):
                    if replay is not None or (may_retry is not None and not may_retry()):
                        raise EngineRestarted(f"the engine worker stopped while this request ran: {item.reason}")
                    if not await self.wait_ready(None):
                        raise EngineUnavailable(f"the engine is not running: {self.failed}")
                    replay = _Replay(list(tracker.token_ids))
                    logger.info("request %s runs again after the engine worker restarted", request_id)
                    self._send(add)
                    continue
                if replay is not None:
                    item = replay.trim(item)
                    if item is None:
                        continue
                output = tracker.update(item)
                finished = output.finished
                if tracker.stopped_by_string:
                    self._send(Abort([request_id]))
                yield output
        finally:
            del self._streams[request_id]
            if not finished:
                self._send(Abort([request_id]))

    def abort(self, request_id: str) -> None:
        self._send(Abort([request_id]))

    async def check_constraint(self, spec: ConstraintSpec) -> None:
        """Raise InvalidRequest (naming the field) unless the worker can compile the spec's
        grammar; it keeps the result in its cache for the request that follows."""
        await self.query("check_constraint", spec)

    async def query(self, name: str, constraint: ConstraintSpec | None = None):
        """Ask the worker between steps (messages.Query); its answer, or the error it raised."""
        if not await self.wait_ready(_QUERY_TIMEOUT):
            raise EngineUnavailable("the engine is not running")
        query_id = next(self._query_ids)
        future = self._loop.create_future()
        self._queries[query_id] = future
        self._send(Query(query_id, name, constraint))
        try:
            return await asyncio.wait_for(future, _QUERY_TIMEOUT)
        finally:
            self._queries.pop(query_id, None)

    def health(self) -> dict:
        return {"worker_pid": self.worker_pid, "worker_restarts": self.worker_restarts}

    def _send(self, message: msgspec.Struct) -> None:
        if self._push is None:
            return  # no worker: an abort has nothing to stop; an add is sent again once one is back
        try:
            self._push.send(messages.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the worker has just died (its queue has no bound): the same as no worker

    # ---- the event loop's side: the worker's messages ------------------------------------------

    def _watch(self, worker: _Worker) -> None:
        """Read the worker's messages on the event loop from now on."""
        self._loop.add_reader(worker.pull.getsockopt(zmq.FD), self._read, worker)
        worker.watched = True
        self._read(worker)  # the descriptor signals changes only: what came before is read now

    def _unwatch(self, worker: _Worker) -> None:
        if worker.watched:
            worker.watched = False
            self._loop.remove_reader(worker.pull.getsockopt(zmq.FD))

    def _read(self, worker: _Worker) -> None:
        """Deliver everything the worker has sent (the reader's callback)."""
        pull, streams = worker.pull, self._streams
        while True:
            try:
                message = messages.from_worker.decode(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if type(message) is Outputs:
                self._stats = message.stats
                if message.cache is not None:
                    self._apply_cache_changes(message.cache)
                for step in message.outputs:
                    stream = streams.get(step.request_id)
                    if stream is not None:
                        stream.put_nowait(step)
            elif type(message) is Answer:
                self._answer(message)
            elif type(message) is Fatal and worker.fatal is None:
                worker.fatal = message
                if self._loop is not None:
                    self._loop.call_later(_FATAL_EXIT_S, _kill_if_running, worker.process)

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

    def _retire(self, worker: _Worker) -> str | None:
        """Take a dead worker's last messages and close its output socket; the fault it reported, if any."""
        self._read(worker)
        self._unwatch(worker)
        worker.pull.close(0)
        return worker.fatal.message if worker.fatal is not None else None

    def _on_ready(self, worker: _Worker) -> None:
        ready = worker.ready
        self._push = worker.push
        self.info, self.worker_pid = ready.info, ready.pid
        self._stats = ready.stats
        self.status = "ok"
        if self._loop is not None and not self._closing.is_set():  # shutdown closes the sockets
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
        self.status = "unavailable" if gave_up else "loading"
        if gave_up:
            self.failed = reason
        if self._ready is not None and gave_up:
            self._ready.set()  # waiters wake to the news
        elif self._ready is not None:
            self._ready.clear()
        for stream in self._streams.values():
            stream.put_nowait(_Lost(reason))
        for future in self._queries.values():
            if not future.done():
                future.set_exception(EngineUnavailable(f"the engine worker stopped: {reason}"))

    @property
    def latest_stats(self) -> EngineStats | None:
        """The engine's statistics as of the worker's last step, totals counted across restarts
        (built when read, by health and metrics, not at every step)."""
        stats = self._stats
        if stats is None:
            return None
        return dataclasses.replace(stats, **{name: self._base[name] + getattr(stats, name) for name in _COUNTERS})

    def _call(self, fn, *args) -> None:
        """Run fn on the event loop; before one is attached (the first start), here and now."""
        with self._attach:
            if self._loop is None:
                fn(*args)
                return
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop has closed: the server is stopping
                pass

    def _in_loop(self, fn, *args, wait: float | None = None):
        """fn(*args) run on the event loop, and its result (before a loop is attached, or on the
        loop's own thread, here and now). None when it did not run in time: within `wait` seconds,
        or (None) before the server began to stop, or when the loop has closed."""
        with self._attach:
            loop = self._loop
            if loop is None or _running_loop() is loop:
                return fn(*args)
            future: concurrent.futures.Future = concurrent.futures.Future()

            def run() -> None:
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)

            try:
                loop.call_soon_threadsafe(run)
            except RuntimeError:  # the loop has closed
                return None
        deadline = None if wait is None else time.monotonic() + wait
        while not loop.is_closed():
            try:
                return future.result(_POLL_MS / 1000)
            except concurrent.futures.TimeoutError:
                if (self._closing.is_set() if deadline is None else time.monotonic() > deadline):
                    break
        return None

    # ---- the supervisor thread ----------------------------------------------------------------

    def _supervise(self) -> None:
        first = True
        while not self._closing.is_set():
            try:
                worker = self._launch(first)
            except _WorkerFailed as exc:
                if first:
                    fatal = exc.fatal
                    self._first.set_exception(ModelLoadError(str(exc), param=fatal.param if fatal else None,
                                                             code=fatal.code if fatal else None))
                    return
                if self._closing.is_set() or self._record_death(str(exc), lived=0.0):
                    return
                continue
            self._worker = worker
            self._call(self._on_ready, worker)
            if first:
                first = False
                self._first.set_result(worker.ready)
            ready_at = time.monotonic()
            worker.process.wait()
            if self._closing.is_set():
                return
            self._closing.wait(_LAST_WORDS_S)
            reason = self._in_loop(self._retire, worker) or _describe_exit(worker.process.returncode)
            if self._closing.is_set():
                return
            logger.error("the engine worker (pid %d) stopped: %s", worker.process.pid, reason)
            if self._record_death(reason, lived=time.monotonic() - ready_at):
                return
            self.worker_restarts += 1
            logger.warning("starting the engine worker again (restart %d)", self.worker_restarts)

    def _record_death(self, reason: str, lived: float) -> bool:
        """Note a death after `lived` seconds of serving; True when it completes a fault loop
        (the engine then gives up)."""
        count, window = _FAULT_LOOP
        self._quick_deaths = self._quick_deaths + 1 if lived < window else 1
        gave_up = self._quick_deaths >= count
        if gave_up:
            reason = f"{count} engine workers in a row failed within {window:.0f} s of starting, the last: {reason}"
            logger.error("not starting the engine worker again: %s", reason)
        self._call(self._on_lost, reason, gave_up)
        return gave_up

    def _launch(self, first: bool) -> _Worker:
        generation = next(self._generation)
        inbox = f"ipc://{os.path.join(self._folder, f'w{generation}-in')}"
        outbox = f"ipc://{os.path.join(self._folder, f'w{generation}-out')}"
        push, pull = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 0)  # a send waits for no one: it fails only when the worker is gone
        push.bind(inbox)
        pull.bind(outbox)
        process = subprocess.Popen([sys.executable, "-m", "ember.engine.worker", inbox, outbox],
                                   stdin=subprocess.DEVNULL, env=child_environment(self.env))
        settings = self.settings
        if not first and settings.fault and not settings.fault.endswith(",always"):
            settings = msgspec.structs.replace(settings, fault=None)  # an injected fault strikes once
        push.send(messages.encode(settings))
        worker = _Worker(process, push, pull)
        try:
            while not self._closing.is_set():
                if pull.poll(_POLL_MS):
                    message = messages.from_worker.decode(pull.recv())
                    if isinstance(message, Ready):
                        worker.ready = message
                        return worker
                    if isinstance(message, Fatal):
                        raise _WorkerFailed(message.message, message)
                elif process.poll() is not None:
                    raise _WorkerFailed(f"the engine worker exited while loading ({_describe_exit(process.returncode)})")
            raise _WorkerFailed("the server is stopping")
        except _WorkerFailed:
            _stop_process(process, 5.0)
            push.close(0)
            pull.close(0)
            raise


def _stop_process(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _kill_if_running(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
