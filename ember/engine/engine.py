"""The in-process asyncio engine: the core runs in a thread of this process.

The front end's event loop never waits on model work. It sends the engine worker's own messages
(Add, Abort, Pause, Resume, Shutdown: engine.messages) and CallInEngine into the engine thread's inbox, which
applies them as the worker does (engine.driver); step outputs come back through
`loop.call_soon_threadsafe`. Detokenizing and stop strings happen on the front end's side
(engine.streams). The server runs its engine in a supervised worker process instead
(engine.client, the same contract: engine.contract); this one serves the Python API, offline
benchmarks and `--no-engine-worker`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, AsyncIterator, Callable, TypeVar

from ember.constraint_spec import ConstraintSpec
from ember.engine.core import EngineCore
from ember.engine.driver import EngineDriver
from ember.engine.messages import Abort, Add, EngineInfo, MediaSpan, Pause, Resume, Shutdown, engine_info
from ember.engine.streams import RequestStreams
from ember.errors import EngineUnavailable
from ember.types import FinishReason, GenerationOutput, SamplingParams, StepOutput

logger = logging.getLogger("ember.engine")


@dataclass(slots=True)
class CallInEngine:
    """Run fn(core) on the engine thread between steps (statistics, invariant checks, cache reset)."""

    fn: Callable[[EngineCore], Any]
    future: concurrent.futures.Future


T = TypeVar("T")


def build_off_thread(factory: Callable[[], T]) -> T:
    """`factory()` run on a short-lived thread, for what builds a model an AsyncEngine will run.

    Loading runs parallel torch operations, and each thread that does gets its own OpenMP thread
    team, which lives as long as that thread. With two teams on a small machine (the loading
    thread's and the engine thread's), libgomp counts more threads than cores and lets idle workers
    sleep between parallel regions instead of spinning: a decode step on 2 cores then runs about 3x
    slower. A team built on a thread that has ended is gone, so the engine thread's is the only one.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = factory()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=work, name="ember-build")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class AsyncEngine:
    def __init__(self, core: EngineCore, tokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.driver = EngineDriver(core, tokenizer)
        self.info: EngineInfo = engine_info(core)
        self.failed: str | None = None  # the fault that stopped the engine, if any
        self.streams = RequestStreams(tokenizer)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # The engine's counters as of its last step or message, published by the engine thread so
        # that readers (health, metrics) never wait for a step to end.
        self.latest_stats = core.stats()

    # ---- front end side (the event loop) -------------------------------------------------------

    def launch(self) -> EngineInfo:
        """Nothing to load: the core was built before this engine."""
        return self.info

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None, cache_salt: str | None = None,
                       constraint: ConstraintSpec | None = None, report_progress: bool = False,
                       may_retry: Callable[[], bool] | None = None, media: Sequence[MediaSpan] = (),
                       session: str | None = None) -> AsyncIterator[GenerationOutput]:
        """engine.contract.Engine.generate (a thread never restarts: `may_retry` has nothing to decide)."""
        if self.failed:
            raise EngineUnavailable(f"the engine stopped after a fault: {self.failed}")
        self.start()
        self.core.resolve_max_tokens(len(prompt_token_ids), params.max_tokens)
        add = self.streams.new_request(prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt,
                                       constraint=constraint, report_progress=report_progress, media=media)
        async for output in self.streams.follow(add, self._inbox.put):
            yield output

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort([request_id]))

    async def check_constraint(self, spec: ConstraintSpec) -> None:
        """Raise InvalidRequest (naming the field) unless the spec's grammar compiles (cached)."""
        await asyncio.to_thread(self.driver.constraints.compile, spec)

    @property
    def status(self) -> str:
        return "unavailable" if self.failed else "ok"

    async def wait_ready(self, timeout: float | None) -> bool:
        return not self.failed

    def health(self) -> dict:
        return {}

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the engine thread and return its result."""
        self.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(CallInEngine(fn, future))
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; live requests are aborted and their blocks returned."""
        if self._thread is None:
            return
        self._inbox.put(Shutdown())
        self._thread.join(timeout)
        self._thread = None

    # ---- engine side (the engine thread) -------------------------------------------------------

    def _run(self) -> None:
        core, driver = self.core, self.driver
        while True:
            try:
                message = self._inbox.get(block=not core.has_schedulable())
            except queue.Empty:
                message = None
            outputs: list[StepOutput] = []
            while message is not None:
                if type(message) is Shutdown:
                    self._send(outputs + driver.abort_all())
                    core.close()
                    return
                outputs += self._call(message) if type(message) is CallInEngine else self._handle(message)
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    message = None
            self.latest_stats = core.stats()
            self._send(outputs)
            if not core.has_schedulable():
                continue
            try:
                outputs = core.step()
            except Exception as exc:  # a fault in the model or sampler: fail what is live, stop
                logger.exception("engine step failed")
                self.failed = f"{type(exc).__name__}: {exc}"
                outputs = core.fail_all(self.failed)
            self.latest_stats = core.stats()
            self._send(outputs)

    def _send(self, outputs: list[StepOutput]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self.streams.deliver, outputs)

    def _handle(self, message: Add | Abort | Pause | Resume) -> list[StepOutput]:
        if self.failed and type(message) is Add:
            return [StepOutput(message.request_id, [], None, FinishReason.ERROR, len(message.prompt_token_ids), 0,
                               error=self.failed)]
        # A stream that left already is gone; one aborted from elsewhere learns it ended.
        return self.driver.handle(message)

    def _call(self, message: CallInEngine) -> list[StepOutput]:
        # The caller may have given up waiting (a timed-out statistics read): then there is nothing to do.
        if message.future.set_running_or_notify_cancel():
            try:
                message.future.set_result(message.fn(self.core))
            except Exception as exc:
                message.future.set_exception(exc)
        return []
