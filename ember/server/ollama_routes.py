"""Ollama's API on ember's server: /api/chat and /api/generate through the one generation pipeline
(NDJSON streams), /api/tags, /api/show, /api/ps and /api/version from the served model, /api/pull
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
from ember.protocols.ollama_admin import is_load_request, load_reply, parse_pull, parse_show, refuse_delete
from ember.protocols.ollama_chat import CHAT
from ember.protocols.ollama_embed import EMBED_DIALECT, LEGACY_EMBEDDINGS
from ember.protocols.ollama_common import OLLAMA_ERRORS, error_line, line, served_name
from ember.protocols.ollama_generate import GENERATE
from ember.protocols.stream_format import NDJSON
from ember.server.event_stream import EventStreamResponse
from ember.server.ollama_models import ModelFacts, read_facts, running_entry, show_body, tag_entry
from ember.server.pipeline import serve_generation
from ember.server.state import ServerState
from ember.store_cli import check_pullable, pull_model

OLLAMA_PATHS = {"/api": OLLAMA_ERRORS}


class OllamaCatalog:
    """The served model's facts, read from its files once, on the first request that needs them."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._facts: ModelFacts | None = None

    async def facts(self) -> ModelFacts:
        self.state.require_ready()
        if self._facts is None:
            self._facts = await asyncio.to_thread(read_facts, self.state.loaded)
        return self._facts

    def names(self) -> list[str]:
        model = self.state.model
        return [model.name, *model.aliases]


def add_ollama_routes(app: FastAPI, state: ServerState) -> None:
    catalog = OllamaCatalog(state)

    async def generation(request: Request, dialect: Dialect, prompt_field: str) -> Response:
        body = parse_body(await request.body())
        if is_load_request(body, prompt_field):
            state.require_ready()
            return JSONResponse(load_reply(body, state.model, chat=dialect is CHAT))
        return await serve_generation(request, dialect)

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

    @app.get("/api/tags", summary="The served model (Ollama)")
    async def tags() -> dict:
        facts = await catalog.facts()
        return {"models": [tag_entry(name, facts, state.component_set_sha) for name in catalog.names()]}

    @app.get("/api/ps", summary="The loaded model (Ollama)")
    async def running() -> dict:
        facts = await catalog.facts()
        return {"models": [running_entry(name, facts, state.component_set_sha, state.loaded)
                           for name in catalog.names()]}

    @app.post("/api/show", summary="The served model's details (Ollama)")
    async def show(request: Request) -> dict:
        facts = await catalog.facts()
        parse_show(parse_body(await request.body()), state.model)
        return show_body(facts, state.loaded, state.model.chat)

    @app.get("/api/version", summary="ember's version (Ollama)")
    async def version() -> dict:
        return {"version": ember.__version__}

    @app.post("/api/pull", summary="Fetch a Hugging Face repo id into the cache (Ollama)")
    async def pull(request: Request) -> Response:
        name, stream = parse_pull(parse_body(await request.body()))
        work = None  # nothing to fetch for the served model
        if state.model is None or not _is_served(name, state):
            check_pullable(name, None)
            work = _fetch(name, state)
        if not stream:
            if work is not None:
                await work
            return JSONResponse({"status": "success"})
        return EventStreamResponse(_pull_lines(work), lambda: None, state.config.sse_keepalive,
                                   state.config.stalled_client_timeout, NDJSON)

    @app.delete("/api/delete", summary="Refused: ember deletes no model (Ollama)")
    async def delete(request: Request) -> Response:
        refuse_delete(parse_body(await request.body()))


def _is_served(name: str, state: ServerState) -> bool:
    try:
        served_name(name, state.model)
    except EmberError:
        return False
    return True


async def _fetch(name: str, state: ServerState) -> None:
    """`ember pull NAME`, off the loop; a failure (the hub unreachable, no such repo) is a 502 naming it."""
    try:
        await asyncio.to_thread(pull_model, name, None, state.config.ollama_models)
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
