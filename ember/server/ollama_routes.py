"""Ollama's API on ember's server: /api/chat and /api/generate through the one generation pipeline
(NDJSON streams; an empty one loads or, with keep_alive 0, unloads its model), /api/tags, /api/show,
/api/ps and /api/version from the server's models, /api/pull
through `ember pull`, /api/delete refused, /api/embed and /api/embeddings on an embedding model.
Every refusal on /api paths is Ollama's `{"error"}` (OLLAMA_PATHS, registered with the
request-context middleware).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import ember
from ember.errors import EmberError
from ember.protocols.json_body import parse_body
from ember.protocols.neutral import Dialect
from ember.protocols.ollama_admin import is_load_request, load_request, parse_pull, parse_show, refuse_delete
from ember.protocols.ollama_chat import CHAT
from ember.protocols.ollama_embed import EMBED_DIALECT, LEGACY_EMBEDDINGS
from ember.protocols.ollama_common import OLLAMA_ERRORS, error_line, line, served_name
from ember.protocols.ollama_generate import GENERATE
from ember.protocols.stream_format import NDJSON
from ember.server.event_stream import EventStreamResponse
from ember.server.ollama_models import ModelFacts, read_facts, running_entry, show_body, tag_entry
from ember.server.model_pool import ModelPool
from ember.server.pipeline import serve_generation
from ember.server.state import ModelState
from ember.store_cli import check_pullable, pull_model

OLLAMA_PATHS = {"/api": OLLAMA_ERRORS}


class OllamaCatalog:
    """Each model's facts, read from its files once, when it is first loaded for a request that needs them."""

    def __init__(self) -> None:
        self._facts: dict[int, ModelFacts] = {}

    async def facts(self, state: ModelState) -> ModelFacts:
        facts = self._facts.get(id(state))
        if facts is None:
            facts = self._facts[id(state)] = await asyncio.to_thread(read_facts, state.loaded)
        return facts

    def known(self, state: ModelState) -> ModelFacts | None:
        return self._facts.get(id(state))


def add_ollama_routes(app: FastAPI, pool: ModelPool) -> None:
    catalog = OllamaCatalog()

    async def generation(request: Request, dialect: Dialect, prompt_field: str) -> Response:
        body = parse_body(await request.body())
        if not is_load_request(body, prompt_field):
            return await serve_generation(request, dialect)
        reply, keep_alive = load_request(body, chat=dialect is CHAT)
        state = routed(reply["model"], pool)
        if keep_alive == 0:  # an unload: it waits for the model's running requests
            pool.request_unload(state, "a request's keep_alive of 0")
            return JSONResponse(reply)
        async with pool.using(reply["model"]) as state:
            check_name(reply["model"], state)
            if keep_alive is not None:
                state.keep_alive = keep_alive
        return JSONResponse(reply)

    @app.post("/api/chat", summary="Chat (Ollama)")
    async def chat(request: Request) -> Response:
        return await generation(request, CHAT, "messages")

    @app.post("/api/generate", summary="Generate from a prompt (Ollama)")
    async def generate(request: Request) -> Response:
        return await generation(request, GENERATE, "prompt")

    @app.post("/api/embed", summary="Embeddings of texts (Ollama)")
    async def embed(request: Request) -> Response:
        return await serve_generation(request, EMBED_DIALECT)

    @app.post("/api/embeddings", summary="The embedding of one text (Ollama's older route)")
    async def embeddings(request: Request) -> Response:
        return await serve_generation(request, LEGACY_EMBEDDINGS)

    @app.get("/api/tags", summary="The served models (Ollama)")
    async def tags() -> dict:
        entries = []
        for state in pool.states:  # none is loaded for this: one never loaded shows what its files say
            facts = await catalog.facts(state) if state.loaded is not None else catalog.known(state)
            names = state.names or [pool.label(state)]
            entries += [tag_entry(name, facts, state) for name in names]
        return {"models": entries}

    @app.get("/api/ps", summary="The loaded models (Ollama)")
    async def running() -> dict:
        entries = []
        for state in pool.states:
            if state.loaded is not None:
                facts = await catalog.facts(state)
                entries += [running_entry(name, facts, state, pool.policy.idle_unload_s) for name in state.names]
        return {"models": entries}

    @app.post("/api/show", summary="A model's details (Ollama)")
    async def show(request: Request) -> dict:
        name = parse_show(parse_body(await request.body()))
        async with pool.using(name) as state:
            check_name(name, state)
            facts = await catalog.facts(state)
            return show_body(facts, state.loaded, state.model.chat)

    @app.get("/api/version", summary="ember's version (Ollama)")
    async def version() -> dict:
        return {"version": ember.__version__}

    @app.post("/api/pull", summary="Fetch a Hugging Face repo id into the cache (Ollama)")
    async def pull(request: Request) -> Response:
        name, stream = parse_pull(parse_body(await request.body()))
        work = None  # nothing to fetch for a served model
        if not _is_served(name, pool):
            check_pullable(name, None)
            work = _fetch(name, pool.config)
        if not stream:
            if work is not None:
                await work
            return JSONResponse({"status": "success"})
        return EventStreamResponse(_pull_lines(work), lambda: None, pool.config.sse_keepalive,
                                   pool.config.stalled_client_timeout, NDJSON)

    @app.delete("/api/delete", summary="Refused: ember deletes no model (Ollama)")
    async def delete(request: Request) -> Response:
        refuse_delete(parse_body(await request.body()))


def check_name(name: str, state: ModelState) -> None:
    """404 unless `name` is one of the loaded model's names (`:latest` allowed)."""
    served_name(name, state.model)


def routed(name: str, pool: ModelPool) -> ModelState:
    """The model `name` stands for, its name checked against it once it has been loaded (404 otherwise)."""
    state = pool.resolve(name)
    if state.model is not None:
        check_name(name, state)
    return state


def _is_served(name: str, pool: ModelPool) -> bool:
    try:
        return bool(routed(name, pool).names)
    except EmberError:
        return False


async def _fetch(name: str, config) -> None:
    """`ember pull NAME`, off the loop; a failure (the hub unreachable, no such repo) is a 502 naming it."""
    try:
        await asyncio.to_thread(pull_model, name, None, config.ollama_models)
    except EmberError:
        raise
    except Exception as exc:
        raise EmberError(f"pulling {name} failed: {type(exc).__name__}: {exc}", param="model", code="pull_failed",
                         status=502) from None


async def _pull_lines(work) -> AsyncIterator[bytes]:
    """Ollama's progress lines: the start, then success or an error line."""
    yield NDJSON.frames([line({"status": "pulling manifest"})])
    try:
        if work is not None:
            await work
    except EmberError as error:
        yield NDJSON.frames(error_line(error))
        return
    yield NDJSON.frames([line({"status": "success"})])
