"""The engine worker: one process that owns the model and runs the engine loop.

Started by ember.engine.client as `python -m ember.engine.worker IN OUT`: it connects a PULL socket
to IN and a PUSH socket to OUT (the front end binds both), reads its WorkerSettings, loads the
model, says Ready, then runs: take every waiting message, run one step when work is live, send
the step's outputs with the engine's statistics. While it waits with nothing to step it sends a
Heartbeat every half second, so the front end's watchdog (engine.watchdog) knows it is alive. A fault in a step is Fatal: the worker reports it
and exits, and the front end starts a fresh one (a device in an unknown state is not reused).
The worker exits with its parent, never orphaned.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import zmq

from ember.engine import messages
from ember.engine.parent_death import die_with_parent
from ember.engine.driver import EngineDriver
from ember.engine.messages import CacheChanges, Fatal, Heartbeat, Outputs, Query, Ready, Shutdown, WorkerSettings
from ember.errors import EmberError
from ember.types import SamplingParams, StepOutput

logger = logging.getLogger("ember.worker")
_HEARTBEAT = messages.encode(Heartbeat())

_IDLE_POLL_MS = 500  # how often an idle worker checks that its parent is alive and sends a heartbeat


def load_engine(settings: WorkerSettings) -> EngineDriver:
    """The settings' engine, ready to drive: the model built and warmed up, counters zeroed, the
    constraint builder made (so the first structured request does not wait for it)."""

    from ember.engine.core import EngineCore
    from ember.loaders import source_opener

    open_source = source_opener(settings.cache_dir, settings.ollama_models)
    source = open_source(settings.model, settings.revision, settings.engine.mmproj)
    if settings.chat_template is not None:
        source.tokenizer.chat_template = settings.chat_template
    group = None
    if settings.engine.tensor_parallel_size > 1:  # this worker is rank 0 (torch.distributed is imported only then)
        from ember.engine.ranks import start_leader

        group = start_leader(settings)
    driver = EngineDriver(EngineCore.from_source(source, settings.engine, open_source, group), source.tokenizer)
    _ = driver.constraints
    warm_up(driver.core, source.tokenizer)
    return driver


def warm_up(core, tokenizer) -> None:
    """One tiny request before serving, so the first client does not pay for the kernels' first run."""
    prompt = tokenizer.encode("Hello", add_special_tokens=False) or [0]
    core.add_request("ember-warm-up", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while core.has_unfinished():
        core.step()
    core.reset_counters()  # statistics count clients' work only


class Worker:
    def __init__(self, driver: EngineDriver, inbox: zmq.Socket, outbox: zmq.Socket, fault=None,
                 report_cache_changes: bool = False) -> None:
        self.driver = driver
        self.core = driver.core
        self.inbox = inbox
        self.outbox = outbox
        self.fault = fault
        self.num_model_steps = 0
        self.parent = os.getppid()
        self.report_cache_changes = report_cache_changes
        if report_cache_changes:
            self.core.kv_manager.record_cache_changes()

    def serve(self) -> None:
        core, driver = self.core, self.driver
        while True:
            if not core.has_schedulable():
                while not self.inbox.poll(_IDLE_POLL_MS):
                    if os.getppid() != self.parent:
                        return  # the front end is gone
                    if core.group is not None:
                        core.group.heartbeat()  # raises when a rank is gone: the group restarts
                    self.outbox.send(_HEARTBEAT)
            outputs: list[StepOutput] = []
            while True:
                try:
                    message = messages.to_worker.decode(self.inbox.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if type(message) is Shutdown:
                    self._send(outputs + driver.abort_all())
                    return
                if type(message) is Query:
                    self.outbox.send(messages.encode(driver.answer(message)))
                else:
                    outputs += driver.handle(message)
            if core.has_schedulable():
                self.num_model_steps += 1
                if self.fault is not None:
                    self.fault.at_step(self.num_model_steps)
                outputs += core.step()
            self._send(outputs)

    def _send(self, outputs: list[StepOutput]) -> None:
        cache = None
        if self.report_cache_changes:
            cleared, stored, removed = self.core.kv_manager.take_cache_changes()
            if cleared or stored or removed:
                cache = CacheChanges(cleared, stored, removed)
        self.outbox.send(messages.encode(Outputs(outputs, self.core.stats(), cache)))


def main(argv: list[str]) -> int:
    inbox_address, outbox_address = argv[0], argv[1]
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front end decides
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for socket in (inbox, outbox):
        socket.setsockopt(zmq.LINGER, 2000)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)
    settings = messages.settings_decoder.decode(inbox.recv())
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    fault = None
    if settings.fault:
        from ember.engine.faults import FaultPlan

        fault = FaultPlan.parse(settings.fault)
        fault.at_load()
    began = time.monotonic()
    try:
        driver = load_engine(settings)
    except Exception as exc:
        logger.error("loading the model failed: %s", exc, exc_info=not isinstance(exc, EmberError))
        error = exc if isinstance(exc, EmberError) else None
        outbox.send(messages.encode(Fatal(str(exc), loading=True, code=error.code if error else None,
                                          param=error.param if error else None)))
        return 1
    logger.info("engine worker %d ready in %.1f s", os.getpid(), time.monotonic() - began)
    core = driver.core
    outbox.send(messages.encode(Ready(os.getpid(), messages.engine_info(core), core.stats())))
    worker = Worker(driver, inbox, outbox, fault, settings.report_cache_changes)
    try:
        worker.serve()
        if core.group is not None:
            core.group.close()
    except Exception as exc:  # a fault in the model or sampler: report it and let the front end restart us
        logger.exception("engine step failed")
        outbox.send(messages.encode(Fatal(f"{type(exc).__name__}: {exc}")))
        return 1
    finally:
        core.close()
        inbox.close(0)
        outbox.close()
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
