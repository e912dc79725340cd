"""A whole run: resolve the model, calibrate prompt lengths, warm up, then measure level by level.

`run(config)` is the Python entry point; `ember bench` calls it and prints the report.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import signal
from typing import Awaitable, Callable, Protocol, TextIO

from ember.bench.config import BenchConfig, Level
from ember.bench.limits import Bounds
from ember.bench.loops import (Send, closed_loop, conversation_loop, open_loop, poisson_arrivals,
                               run_with_limits)
from ember.bench.progress import ProgressBar
from ember.bench.records import LevelClock, RequestRecord
from ember.bench.result import BenchResult, LevelResult
from ember.bench.stats import summarize, wall_time
from ember.bench.workload import (Calibration, Prompt, RequestSpec, as_prompt, calibrate, conversations,
                                  seeded_words, single_requests)

_WARM_UP_TOKENS = 4


class Transport(Protocol):
    """Where requests go: a server over HTTP (http_client) or the in-process engine (offline)."""

    @property
    def target(self) -> str: ...

    async def model_name(self) -> str: ...

    async def count_prompt_tokens(self, prompt: Prompt) -> int: ...

    async def send(self, spec: RequestSpec, record: RequestRecord, clock: LevelClock) -> str | None: ...

    async def bounds(self) -> Bounds | None: ...

    async def close(self) -> None: ...


def make_transport(config: BenchConfig) -> Transport:
    if config.offline is not None:
        from ember.bench.offline import EngineTransport
        return EngineTransport(config)
    from ember.bench.http_client import HttpTransport
    return HttpTransport(config)


def run(config: BenchConfig, *, progress_stream: TextIO | None = None) -> BenchResult:
    """Run every level to its end, its limits, or Ctrl-C (then the levels so far are returned)."""
    return asyncio.run(run_async(config, progress_stream=progress_stream))


async def run_async(config: BenchConfig, transport: Transport | None = None, *,
                    progress_stream: TextIO | None = None) -> BenchResult:
    transport = transport or make_transport(config)
    interrupt = asyncio.Event()
    release_ctrl_c = _catch_ctrl_c(interrupt)
    try:
        preparing = asyncio.ensure_future(_prepare(transport, config))
        if await run_with_limits(preparing, None, interrupt) is not None:
            raise KeyboardInterrupt  # nothing measured yet, nothing to report
        model, calibration = preparing.result()
        run_id = secrets.token_hex(3)  # keeps request ids unique in a server log across runs
        levels: list[LevelResult] = []
        for index, level in enumerate(config.levels):
            if interrupt.is_set():
                break
            levels.append(await _run_level(config, transport, calibration, index, level, interrupt, run_id,
                                           progress_stream))
        bounds = await transport.bounds() if levels and not interrupt.is_set() else None
        return BenchResult(config, transport.target, model, calibration, levels, bounds)
    finally:
        release_ctrl_c()
        await transport.close()


async def _prepare(transport: Transport, config: BenchConfig) -> tuple[str, Calibration]:
    """The model id and the prompt calibration, then a warm-up."""
    model = await transport.model_name()
    calibration = await calibrate(transport.count_prompt_tokens, config)
    await _warm_up(transport, config, calibration)
    return model, calibration


async def _warm_up(transport: Transport, config: BenchConfig, calibration: Calibration) -> None:
    """One short unrecorded request, so the first measured one does not pay for cold paths."""
    text = seeded_words(config.seed, "warm-up", calibration.words_for(min(config.input_len.low, 32)))
    spec = RequestSpec("warm-up", as_prompt(text, config.endpoint), 0, _WARM_UP_TOKENS)
    await transport.send(spec, RequestRecord("bench-warm-up", -1, 0, 0, _WARM_UP_TOKENS), LevelClock())


async def _run_level(config: BenchConfig, transport: Transport, calibration: Calibration, index: int, level: Level,
                     interrupt: asyncio.Event, run_id: str, progress_stream: TextIO | None) -> LevelResult:
    records: list[RequestRecord] = []
    progress = ProgressBar(level.label, config.requests_for(level), stream=progress_stream,
                           enabled=ProgressBar.wanted(config.quiet, progress_stream))
    start_work = _workload(config, calibration, index, level)  # prompts are built before the clock starts
    clock = LevelClock()

    async def send(spec: RequestSpec) -> str | None:
        record = RequestRecord(f"bench-{run_id}-{spec.key}", index, len(records), spec.input_len, spec.output_len,
                               spec.conversation, spec.turn)
        records.append(record)
        reply = await transport.send(spec, record, clock)
        progress.finished(record)
        return reply

    ticker = asyncio.ensure_future(_keep_drawing(progress))
    try:
        stopped_by = await run_with_limits(start_work(send, clock), config.max_seconds, interrupt)
    finally:
        ticker.cancel()
    progress.close()
    summary = summarize(records, wall_time(records, clock.now()))
    return LevelResult(index, level, clock.started_at, records, stopped_by, summary)


async def _keep_drawing(progress: ProgressBar) -> None:
    """Redraws between finished requests, so elapsed time moves during long ones."""
    while progress.enabled:
        progress.draw(force=True)
        await asyncio.sleep(0.5)


def _workload(config: BenchConfig, calibration: Calibration, index: int,
              level: Level) -> Callable[[Send, LevelClock], Awaitable[None]]:
    if config.workload == "multiturn":
        dialogues = conversations(config, calibration, index, level)
        return lambda send, clock: conversation_loop(dialogues, config.turns, send)
    specs = single_requests(config, calibration, index, level)
    if level.request_rate is not None:
        arrivals = poisson_arrivals(len(specs), level.request_rate, random.Random(f"{config.seed}/arrivals/{index}"))
        return lambda send, clock: open_loop(specs, arrivals, clock, send)
    return lambda send, clock: closed_loop(specs, level.concurrency, send)


def _catch_ctrl_c(interrupt: asyncio.Event) -> Callable[[], None]:
    """The first Ctrl-C ends the run gracefully (in-flight requests cancelled, results kept); a second
    one raises KeyboardInterrupt as usual. Returns the function that removes the handler."""
    loop = asyncio.get_running_loop()

    def on_ctrl_c() -> None:
        interrupt.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_ctrl_c)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or a loop without signals
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGINT)
