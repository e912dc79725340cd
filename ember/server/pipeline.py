"""The one template every generation endpoint follows:

    JSON body -> its model (server.model_pool: 404, or loaded and held) -> dialect.parse (validate;
    400 naming the field) -> prompt token ids (off the loop) -> max_tokens fitted to the window
    -> admission (429 / 503) -> the engine -> a JSON body or SSE.

Nothing reaches the engine before it has passed every check. The stream opens only once the
request is admitted, so every refusal is a plain HTTP status; after that, failures are events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.constraint_spec import ConstraintSpec
from ember.engine.messages import MediaSpan
from ember.errors import EmberError
from ember.loaders.serving_task import check_serves
from ember.protocols.errors import GenerationFailed
from ember.protocols.json_body import parse_body
from ember.protocols.stream_format import SSE, StreamFormat
from ember.protocols.neutral import Dialect, ResponseMeta, RunResult, choice_seeds, resolve_sampling
from ember.server.event_stream import EventStreamResponse, wait_for_disconnect
from ember.server.keys import DEFAULT_TENANT
from ember.server.middleware import ClientGone
from ember.server.request_record import RequestRecord, session_tag
from ember.server.state import ModelState
from ember.types import FinishReason, GenerationOutput, SamplingParams

logger = logging.getLogger("ember.server")

class ChoiceRun:
    """Runs a request's choices on the engine and merges their outputs in arrival order.

    Choice 0 starts first; when the choices share one prompt, the others start once it has produced
    a token, when its prompt is in the prefix cache for them to share (a batch starts them all). `stop` ends the run from outside (server shutdown).
    With `report_progress`, choice 0 also yields prefill progress outputs (no tokens) first.
    The choices run at most one output each ahead of the consumer: the rest wait in the engine's
    stream, where a consumer that stops (a client that reads nothing) has its request paused
    (engine.backlog).
    """

    def __init__(self, engine, prompts: list[list[int]], params: list[SamplingParams], request_id: str,
                 report_progress: bool = False, constraint: ConstraintSpec | None = None,
                 media: list[list[MediaSpan]] | None = None, session: str | None = None) -> None:
        self.engine = engine
        self.prompts = prompts  # one per choice: a request's n choices share one list, a batch's differ
        self.params = params
        self.media = media  # each choice's prompt's images (None: none at all)
        self.on_first_output: Callable[[], None] | None = None  # called once, when an output first arrives
        self.request_id = request_id
        self.report_progress = report_progress
        self.constraint = constraint  # the engine builds each choice a live constraint of its own from it
        self.session = session  # the client's session: a router keeps it on one worker
        self.shared_prompt = all(p is prompts[0] for p in prompts)
        self.delivered = False  # some of the reply reached the client: it can no longer run again
        self._queue: asyncio.Queue = asyncio.Queue()
        self._room = asyncio.Semaphore(len(params))  # outputs queued ahead of the consumer
        self._tasks: list[asyncio.Task] = []

    async def _pump(self, index: int) -> None:
        request_id = self.request_id if len(self.params) == 1 else f"{self.request_id}-{index}"
        extra = {"report_progress": True} if self.report_progress and index == 0 else {}
        if self.constraint is not None:
            extra["constraint"] = self.constraint
        if self.media is not None and self.media[index]:
            extra["media"] = self.media[index]
        if self.session is not None:
            extra["session"] = self.session
        try:
            async for output in self.engine.generate(self.prompts[index], self.params[index], request_id=request_id,
                                                     may_retry=self.may_retry, **extra):
                await self._room.acquire()
                self._queue.put_nowait((index, output, None))
        except Exception as exc:
            self._queue.put_nowait((index, None, exc))

    def may_retry(self) -> bool:
        """Whether a choice whose engine worker died may run again from the start."""
        return not self.delivered

    def _start(self, index: int) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._pump(index)))

    def stop(self, error: EmberError) -> None:
        for task in self._tasks:
            task.cancel()
        self._queue.put_nowait((None, None, error))

    async def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        for index in range(1 if self.shared_prompt else len(self.params)):
            self._start(index)
        unfinished = len(self.params)
        while unfinished:
            index, output, error = await self._queue.get()
            if output is not None:
                self._room.release()
            if self.on_first_output is not None:
                self.on_first_output()
                self.on_first_output = None
            if error is not None:
                raise error
            if len(self._tasks) < len(self.params) and (output.token_ids or output.finished):
                for i in range(1, len(self.params)):
                    self._start(i)
            if output.finish_reason is not None:
                unfinished -= 1
            yield index, output

    async def close(self) -> None:
        """Cancel whatever still runs; leaving `generate` early aborts it in the engine."""
        if self.on_first_output is not None:  # no output came: what it counted is given back all the same
            self.on_first_output()
            self.on_first_output = None
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def serve_generation(request: Request, dialect: Dialect) -> Response:
    record: RequestRecord = request.scope["ember.record"]
    record.route, record.errors = dialect.name, dialect.errors
    body = await request.body()
    raw = dialect.read_body(body) if dialect.read_body else parse_body(body)
    pool, name, began = request.app.state.pool, requested_model(raw), time.monotonic()
    was_ready = pool.resolve(name).status == "ok"
    async with pool.using(name) as state:
        record.model = state.names[0]
        load_seconds = 0.0 if was_ready else time.monotonic() - began  # the wait for its model to load
        return await _serve(request, dialect, state, record, raw, load_seconds)


def requested_model(body: Any) -> str | None:
    """The model a request body names, for routing (the dialect checks the field itself)."""
    name = body.get("model") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


async def _serve(request: Request, dialect: Dialect, state: ModelState, record: RequestRecord, raw: Any,
                 load_seconds: float) -> Response:
    check_serves(state.model.task, dialect.tasks)
    job = dialect.parse(raw, state.model)
    record.job, record.phase = job, "prepare"
    if job.session:  # the body's prompt_cache_key names the session more precisely than a header
        record.session = session_tag(job.session)
    if job.keep_alive is not None:
        state.keep_alive = job.keep_alive
    runs = job.prompt_runs()
    prompts = [await state.encode(run.prompt) for run in runs]
    prompt_token_ids = prompts[0]
    plan = state.reply_plan(job, prompt_token_ids)
    constraint = await state.constraint(job, plan)
    record.prompt_tokens = sum(len(ids) for ids in prompts)
    fitted = [resolve_sampling(job, len(ids), state.model, run.params, run.prompt_param)
              for run, ids in zip(runs, prompts)]
    if job.total_tokens_param is not None:  # after each input's own fit, which names its index
        state.model.check_total_input_tokens(prompts, job.total_tokens_param)
    params, fit = fitted[0]
    if plan is not None:
        plan.check_budget_room(params.max_tokens)
    num_sequences = len(runs) * job.n
    record.phase = "admission"
    ticket = await state.admission.acquire(num_sequences, record.tenant or DEFAULT_TENANT, params.priority > 0)
    try:
        record.phase = "run"
        request.app.state.observability.request_started(record, job, params)
        batch_prompt_ids = prompts if job.batch is not None else None
        result = RunResult(num_sequences, prompt_token_ids, record.received, plan, fit, batch_prompt_ids)
        result.load_seconds = load_seconds
        record.result = result
        meta = ResponseMeta(f"{dialect.id_prefix}{record.internal_id}", int(record.received), state.model.name,
                            state.fingerprint, state.decode, record.request_id)
        renderer = dialect.renderer(job, result, meta)
        media = [media_spans(run.prompt) for run in runs]
        if job.batch is not None:
            choice_prompts, choice_params = prompts, [p for p, _ in fitted]
        else:
            choice_prompts, choice_params = [prompt_token_ids] * job.n, choice_seeds(params, job.n)
            media *= job.n
        run = ChoiceRun(state.engine, choice_prompts, choice_params, record.internal_id,
                        report_progress=job.stream and job.return_progress, constraint=constraint,
                        media=media if any(media) else None, session=record.session)
        if run.media is not None:  # its images count as being encoded until its first output
            run.on_first_output = state.images_encoding.take(sum(map(len, media[:len(runs)])))
        if job.stream:
            frames = stream_frames(renderer, result, run, state, record, dialect.stream_format)
            response = EventStreamResponse(frames, ticket.release, state.config.sse_keepalive,
                                           state.config.stalled_client_timeout, dialect.stream_format)
            ticket = None  # the stream releases it when it ends
            return response
        await collect_unless_gone(request, run, result, state)
        if result.error is not None:
            raise GenerationFailed(result.error)
        body = renderer.response()
        if isinstance(body, bytes):  # JSON the dialect wrote itself
            return Response(body, media_type="application/json")
        return JSONResponse(body)
    except ClientGone:
        record.client_gone = True
        return Response(status_code=499)
    finally:
        if ticket is not None:
            ticket.release()


def media_spans(prompt) -> list[MediaSpan]:
    """The engine's view of an encoded prompt's images."""
    return [MediaSpan(item.image.sha256, item.image.data, item.start, item.stop)
            for item in getattr(prompt, "media", ())]


async def tokenize_only(request: Request, parse: Callable[[Any, Any], Any],
                        answer: Callable[[Any, list[int], ModelState], Any]) -> Any:
    """A counting route's answer: `answer(job, prompt token ids, the model)` for its request (parsed
    by `parse`) while the model is held; nothing runs."""
    raw = parse_body(await request.body())
    async with request.app.state.pool.using(requested_model(raw)) as state:
        job = parse(raw, state.model)
        prompt_token_ids = await state.encode(job.prompt)
        request.scope["ember.record"].prompt_tokens = len(prompt_token_ids)
        return answer(job, prompt_token_ids, state)


async def collect_unless_gone(request: Request, run: ChoiceRun, result: RunResult, state: ModelState) -> None:
    """Gather every output; if the client disconnects first, abort the run and raise ClientGone."""

    async def collect() -> None:
        async for index, output in run.outputs():
            result.add(index, output)

    state.runs.add(run)
    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientGone()
        work.result()
    finally:
        state.runs.discard(run)
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
        await run.close()


async def stream_frames(renderer, result: RunResult, run: ChoiceRun, state: ModelState,
                        record: RequestRecord, framing: StreamFormat = SSE) -> AsyncIterator[bytes]:
    """The stream of one request, framed: opening chunks, deltas, closing chunks; errors become events."""
    _frames = framing.frames
    state.runs.add(run)
    error: EmberError | None = None
    try:
        yield _frames(renderer.stream_start())
        async for index, output in run.outputs():
            choice = result.add(index, output)
            if output.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                error = GenerationFailed(output.error or "the request was cancelled")
                break
            frame = _frames(renderer.stream_output(choice, output))
            if frame:
                run.delivered = True
                yield frame
    except EmberError as exc:
        error = exc
    except Exception as exc:
        logger.exception("a stream failed")
        error = GenerationFailed(f"{type(exc).__name__}: {exc}")
    except (GeneratorExit, asyncio.CancelledError):
        record.client_gone = True
        raise
    finally:
        state.runs.discard(run)
        await run.close()
    if error is not None:
        record.note_error(error)
        yield _frames(renderer.stream_error(error))
    else:
        yield _frames(renderer.stream_end())

