"""The in-process asyncio engine: the core runs in a thread of this process.

The front end's event loop never waits on model work. It sends AddRequest / AbortRequest /
CallInEngine / Shutdown into the engine thread's inbox, and step outputs come back through
`loop.call_soon_threadsafe`. Detokenizing and stop strings happen on the front end's side.
The server runs its engine in a supervised worker process instead (ember.engine.client, with the
same `generate`); this one serves the Python API, offline benchmarks and `--no-engine-worker`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

from ember.constraint_spec import ConstraintSpec
from ember.engine.core import EngineCore
from ember.engine.messages import EngineInfo, engine_info
from ember.engine.outputs import open_stream
from ember.errors import EmberError, EngineUnavailable
from ember.types import FinishReason, GenerationOutput, SamplingParams, StepOutput

logger = logging.getLogger("ember.engine")


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.time)
    constraint: ConstraintSpec | None = None
    report_progress: bool = False


@dataclass(slots=True)
class AbortRequest:
    request_ids: list[str]


@dataclass(slots=True)
class CallInEngine:
    """Run fn(core) on the engine thread between steps (statistics, invariant checks, cache reset)."""

    fn: Callable[[EngineCore], Any]
    future: concurrent.futures.Future


@dataclass(slots=True)
class Shutdown:
    pass


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
    def __init__(self, core: EngineCore, tokenizer, constraints=None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.constraints = constraints  # a grammar.realize.ConstraintBuilder; built when first needed
        self.info: EngineInfo = engine_info(core)
        self.failed: str | None = None  # the fault that stopped the engine, if any
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        # The engine's counters as of its last step or message, published by the engine thread so
        # that readers (health, metrics) never wait for a step to end.
        self.latest_stats = core.stats()
        self._handlers = {
            AddRequest: self._handle_add,
            AbortRequest: self._handle_abort,
            CallInEngine: self._handle_call,
        }

    # ---- front end side (the event loop) -------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None,
                       cache_salt: str | None = None,
                       constraint: ConstraintSpec | None = None,
                       report_progress: bool = False,
                       may_retry: Callable[[], bool] | None = None) -> AsyncIterator[GenerationOutput]:
        """Submit a request and yield its outputs until it finishes.

        Refusals (context length, cache size) raise before the first output. Leaving the
        iteration early (a client gone, a cancelled task) aborts the request in the engine.
        With `report_progress`, prefill chunks that produce no token also yield an output, with
        no new tokens and `num_computed_prompt_tokens` set.
        """
        if self.failed:
            raise EngineUnavailable(f"the engine stopped after a fault: {self.failed}")
        self.start()
        self.core.resolve_max_tokens(len(prompt_token_ids), params.max_tokens)
        request_id = request_id or f"req-{next(self._ids)}"
        stream, tracker = open_stream(self._streams, request_id, prompt_token_ids, params, self.tokenizer)
        self._inbox.put(AddRequest(request_id, prompt_token_ids, params, cache_salt,
                                   tracker.timings.arrival, constraint, report_progress))
        finished = False
        try:
            while not finished:
                step: StepOutput = await stream.get()
                output = tracker.update(step)
                finished = output.finished
                if tracker.stopped_by_string:
                    self._inbox.put(AbortRequest([request_id]))
                yield output
        finally:
            del self._streams[request_id]
            if not finished:
                self._inbox.put(AbortRequest([request_id]))

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest([request_id]))

    async def check_constraint(self, spec: ConstraintSpec) -> None:
        """Raise InvalidRequest (naming the field) unless the spec's grammar compiles (cached)."""
        await asyncio.to_thread(self._constraint_builder().compile, spec)

    def _constraint_builder(self):
        if self.constraints is None:
            from ember.grammar.realize import load_constraint_builder

            self.constraints = load_constraint_builder(self.tokenizer, self.core.model_config.vocab_size,
                                                       self.core.eos_token_ids)
        return self.constraints

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

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for step in outputs:
            stream = self._streams.get(step.request_id)
            if stream is not None:
                stream.put_nowait(step)

    # ---- engine side (the engine thread) -------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        while True:
            try:
                message = self._inbox.get(block=not core.has_unfinished())
            except queue.Empty:
                message = None
            while message is not None:
                if isinstance(message, Shutdown):
                    self._send(core.abort(list(core.scheduler.requests)))
                    return
                self._handlers[type(message)](message)
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    message = None
            self.latest_stats = core.stats()
            if not core.has_unfinished():
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
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _handle_add(self, message: AddRequest) -> None:
        if self.failed:
            self._reject(message, self.failed)
            return
        try:
            constraint = self._constraint_builder().build(message.constraint) if message.constraint else None
            self.core.add_request(message.request_id, message.prompt_token_ids, message.params,
                                  message.cache_salt, message.arrival_time,
                                  constraint, message.report_progress)
        except EmberError as exc:
            self._reject(message, exc.message)

    def _reject(self, message: AddRequest, error: str) -> None:
        self._send([StepOutput(message.request_id, [], None, FinishReason.ERROR, len(message.prompt_token_ids), 0,
                               error=error)])

    def _handle_abort(self, message: AbortRequest) -> None:
        # A stream that left already is gone; one aborted from elsewhere learns it ended.
        self._send(self.core.abort(message.request_ids))

    def _handle_call(self, message: CallInEngine) -> None:
        # The caller may have given up waiting (a timed-out statistics read): then there is nothing to do.
        if not message.future.set_running_or_notify_cancel():
            return
        try:
            result = message.fn(self.core)
        except Exception as exc:
            message.future.set_exception(exc)
        else:
            message.future.set_result(result)
