"""The engine worker's supervisor: a thread that starts the worker process, waits for it, and starts
a fresh one when it dies.

It launches `python -m ember.engine.worker IN OUT` on two fresh ZeroMQ sockets, sends it its
WorkerSettings and reads what the worker sends while it loads (Ready or Fatal). A ready worker is
handed to the front end (`on_ready`), which reads its messages from then on; the thread then only
waits for the process to end (a crash, SIGKILL, running out of memory, a fatal step), has the front
end take the dead worker's last messages (`retire`), and starts the next one, on fresh sockets so
nothing queued for the dead one reaches it. A worker the front end's watchdog found stalled
(engine.watchdog) is killed there and comes back through this same path. Three deaths within a minute of starting is a fault
loop: the supervisor then gives up (`on_lost(reason, gave_up=True)`) instead of restarting forever.

The front end's callbacks run on its event loop once one is attached, and on this thread before
(LoopBridge), so the sockets a worker hands over are only ever used by one thread at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import zmq

from ember.engine import messages
from ember.engine.messages import Fatal, Ready, WorkerSettings
from ember.engine.parent_death import child_environment
from ember.errors import ModelLoadError

logger = logging.getLogger("ember.engine")

_POLL_MS = 100  # while a worker loads, how often its process is checked
# What a worker sent just before it died may still be on its way through ZeroMQ's I/O thread
# when its exit is seen: the event loop keeps reading this long before it closes the socket.
_LAST_WORDS_S = 0.05
# A worker that dies this soon after it was ready is a quick death; this many in a row (a load
# that fails counts as one) is a fault loop, and the supervisor stops restarting. Slow loads do
# not stretch the window: it runs from ready to death.
_FAULT_LOOP = (3, 60.0)


@dataclass(slots=True)
class Worker:
    """One worker generation: its process and its two sockets (the supervisor thread's while it
    loads, the event loop's once it is ready)."""

    process: subprocess.Popen
    push: zmq.Socket
    pull: zmq.Socket
    ready: Ready | None = None
    fatal: Fatal | None = None  # its last word, if it reported a fault
    stalled: str | None = None  # why the front end killed it for making no progress
    watched: bool = False  # the event loop has a reader on `pull`


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """Why a worker stopped. `cause`: "crashed" (a signal or an exit status, named in `reason`),
    "fault" (it reported one: a step raised), "stalled" (killed for making no progress), or
    "load" (a restarted worker failed to load)."""

    cause: str
    reason: str


class _LoadFailed(Exception):
    def __init__(self, message: str, fatal: Fatal | None = None) -> None:
        super().__init__(message)
        self.fatal = fatal


class LoopBridge:
    """Runs the front end's callbacks where its sockets live: on the calling thread until an event
    loop is attached, on that loop after."""

    def __init__(self, closing: threading.Event) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._closing = closing
        # Held while a callback runs off the loop and while `attach` runs: what ran before the
        # loop was attached is done by the time the loop takes over.
        self._attach = threading.Lock()

    def attach(self, then: Callable[[], None]) -> None:
        """Attach the running loop, then run `then` on it, before any callback can."""
        with self._attach:
            self.loop = asyncio.get_running_loop()
            then()

    def call(self, fn: Callable, *args) -> None:
        """fn(*args) on the loop, not waiting for it (here and now before one is attached)."""
        with self._attach:
            if self.loop is None:
                fn(*args)
                return
            try:
                self.loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop has closed: the server is stopping
                pass

    def run(self, fn: Callable, *args, wait: float | None = None) -> Any:
        """fn(*args) on the loop, and its result (before a loop is attached, or on the loop's own
        thread, here and now). None when it did not run in time: within `wait` seconds, or (None)
        before the server began to stop, or when the loop has closed."""
        with self._attach:
            loop = self.loop
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


class WorkerSupervisor:
    """Starts and restarts one engine worker. The front end's callbacks (run through `bridge`):
    `on_ready(worker)` when a worker serves, `retire(worker)` to take a dead one's last messages
    and close its output socket (returning why it stopped, when the front end knows: a fault it
    reported, a stall), and `on_lost(reason, gave_up)` when it is gone."""

    def __init__(self, settings: WorkerSettings, env: dict[str, str] | None, bridge: LoopBridge,
                 closing: threading.Event, *, on_ready: Callable[[Worker], None],
                 retire: Callable[[Worker], WorkerExit | None], on_lost: Callable[[str, bool], None]) -> None:
        self.settings = settings
        self.env = env  # the worker process's environment (None: this one's)
        self.bridge = bridge
        self.closing = closing
        self.worker: Worker | None = None  # the live (or last) worker
        self.restarts = 0
        self.last_exit: WorkerExit | None = None
        self.exits: dict[str, int] = {}  # workers stopped, by cause
        self.context = zmq.Context()
        self._on_ready, self._retire, self._on_lost = on_ready, retire, on_lost
        self._addresses = IpcAddresses()
        self._generation = itertools.count()
        self._quick_deaths = 0
        self._first: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._supervise, name="ember-supervisor", daemon=True)

    def launch(self) -> Ready:
        """Start the first worker and wait until its model is loaded (blocks). A load failure
        raises ModelLoadError with the worker's reason."""
        self._thread.start()
        return self._first.result()

    def stop(self, timeout: float) -> Worker | None:
        """After the front end has set `closing` and told the worker to shut down: wait for it to
        exit (killing it past `timeout`) and for this thread to end; returns the last worker."""
        worker = self.worker
        if worker is not None:
            stop_process(worker.process, timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        return worker

    def close(self) -> None:
        self.context.destroy(linger=0)
        self._addresses.close()

    # ---- the supervisor thread ----------------------------------------------------------------

    def _supervise(self) -> None:
        first = True
        while not self.closing.is_set():
            try:
                worker = self._start_worker(first)
            except _LoadFailed as exc:
                if first:
                    fatal = exc.fatal
                    self._first.set_exception(ModelLoadError(str(exc), param=fatal.param if fatal else None,
                                                             code=fatal.code if fatal else None))
                    return
                if self.closing.is_set() or self._record_death(WorkerExit("load", str(exc)), lived=0.0):
                    return
                continue
            self.worker = worker
            self.bridge.call(self._on_ready, worker)
            if first:
                first = False
                self._first.set_result(worker.ready)
            ready_at = time.monotonic()
            worker.process.wait()
            if self.closing.is_set():
                return
            self.closing.wait(_LAST_WORDS_S)
            ended = self.bridge.run(self._retire, worker) or WorkerExit("crashed",
                                                                        _describe_exit(worker.process.returncode))
            if self.closing.is_set():
                return
            logger.error("the engine worker (pid %d) stopped: %s", worker.process.pid, ended.reason)
            if self._record_death(ended, lived=time.monotonic() - ready_at):
                return
            self.restarts += 1
            logger.warning("starting the engine worker again (restart %d)", self.restarts)

    def _record_death(self, ended: WorkerExit, lived: float) -> bool:
        """Note a death after `lived` seconds of serving; True when it completes a fault loop
        (the supervisor then gives up)."""
        self.last_exit = ended
        self.exits[ended.cause] = self.exits.get(ended.cause, 0) + 1
        reason = ended.reason
        count, window = _FAULT_LOOP
        self._quick_deaths = self._quick_deaths + 1 if lived < window else 1
        gave_up = self._quick_deaths >= count
        if gave_up:
            reason = f"{count} engine workers in a row failed within {window:.0f} s of starting, the last: {reason}"
            logger.error("not starting the engine worker again: %s", reason)
        self.bridge.call(self._on_lost, reason, gave_up)
        return gave_up

    def _start_worker(self, first: bool) -> Worker:
        generation = next(self._generation)
        inbox, outbox = self._addresses.name(f"w{generation}-in"), self._addresses.name(f"w{generation}-out")
        push, pull = self.context.socket(zmq.PUSH), self.context.socket(zmq.PULL)
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
        worker = Worker(process, push, pull)
        try:
            while not self.closing.is_set():
                if pull.poll(_POLL_MS):
                    message = messages.from_worker.decode(pull.recv())
                    if isinstance(message, Ready):
                        worker.ready = message
                        return worker
                    if isinstance(message, Fatal):
                        raise _LoadFailed(message.message, message)
                elif process.poll() is not None:
                    raise _LoadFailed(f"the engine worker exited while loading ({_describe_exit(process.returncode)})")
            raise _LoadFailed("the server is stopping")
        except _LoadFailed:
            stop_process(process, 5.0)
            push.close(0)
            pull.close(0)
            raise


class IpcAddresses:
    """The ZeroMQ addresses of one supervisor's workers. On Linux they are abstract socket names
    (`ipc://@...`): no file stands for them, and the kernel frees them with the last socket, so a
    front end killed outright (SIGKILL, out of memory) leaves nothing behind. Elsewhere they are
    files in a temporary folder that `close` removes."""

    def __init__(self) -> None:
        self._folder = None if sys.platform == "linux" else tempfile.mkdtemp(prefix="ember-engine-")
        self._prefix = f"@ember-engine-{os.getpid()}-{secrets.token_hex(6)}"  # unique per supervisor

    def name(self, socket_name: str) -> str:
        if self._folder is None:
            return f"ipc://{self._prefix}-{socket_name}"
        return f"ipc://{os.path.join(self._folder, socket_name)}"

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def stop_process(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def kill_if_running(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
