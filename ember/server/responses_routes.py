"""The OpenAI Responses routes: create (through the one generation pipeline), retrieve, delete, list
input items, count input tokens, and the refused cancel and compact."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember.errors import EmberError, InvalidRequest
from ember.protocols.errors import unsupported
from ember.protocols.openai_responses import ResponsesContext, ResponseSpec, responses_dialect
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.server.config import ServerConfig
from ember.server.keys import DEFAULT_TENANT
from ember.server.openapi import generation_route_docs
from ember.server.pipeline import serve_generation, tokenize_only
from ember.server.response_store import MemoryResponseStore, ResponseStore, StoredResponse, record_size
from ember.server.sqlite_response_store import SqliteResponseStore
from ember.server.state_dir import state_dir

MAX_LIST_LIMIT = 100


class ResponseNotFound(EmberError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"No stored response has the id '{response_id}': it was never stored (store: false), "
                         "was deleted or evicted, belongs to another API key's tenant, or the server restarted "
                         "with --response-store memory.", param="response_id", code="response_not_found")


def open_response_store(config: ServerConfig) -> ResponseStore:
    """--response-store: `memory`, a file, or (unset) responses.db in ember's state folder."""
    max_bytes = int(config.response_store_max_mb * (1 << 20))
    if config.response_store == "memory":
        return MemoryResponseStore(config.response_store_max_records, max_bytes)
    path = config.response_store or state_dir() / "responses.db"
    return SqliteResponseStore(path, config.response_store_max_records, max_bytes)


def make_context(store: ResponseStore, seal: ReasoningSeal | None = None,
                 tenant: str = DEFAULT_TENANT) -> ResponsesContext:
    """The dialect's view of `store` for one tenant: it reads and writes that tenant's records only."""
    def history_of(response_id: str):
        record = store.get(response_id, tenant)
        return record.history if record is not None else None

    def save(body: dict[str, Any], spec: ResponseSpec, history: tuple[dict[str, Any], ...]) -> None:
        store.put(StoredResponse(body, tuple(spec.input_items), history, record_size(body, history)), tenant)

    def check_size(items: tuple[dict[str, Any], ...]) -> None:
        store.check_fits(sum(len(json.dumps(item, ensure_ascii=False)) for item in items))

    def preserve_thinking_of(response_id: str) -> bool | None:
        record = store.get(response_id, tenant)
        return record.response.get("preserve_thinking") if record is not None else None

    return ResponsesContext(seal or ReasoningSeal(), history_of, save, check_size, preserve_thinking_of)


def add_responses_routes(app: FastAPI, config: ServerConfig) -> None:
    store = open_response_store(config)
    # one seal for the server's life: what one request sealed, the next one opens
    seal = ReasoningSeal.from_key_file(config.reasoning_key_file) if config.reasoning_key_file else ReasoningSeal()
    app.state.responses = store

    def dialect_of(request: Request):
        """The Responses dialect over the records of the request's tenant."""
        return responses_dialect(make_context(store, seal, tenant_of(request)))

    @app.post("/v1/responses", summary="Create a response (OpenAI Responses)",
              **generation_route_docs("ResponsesRequest"))
    async def create_response(request: Request) -> Response:
        return await serve_generation(request, dialect_of(request))

    @app.post("/v1/responses/input_tokens", summary="The prompt tokens a create request would have")
    async def count_input_tokens(request: Request) -> dict:
        return await tokenize_only(request, dialect_of(request).parse,
                                   lambda _, ids, __: {"object": "response.input_tokens", "input_tokens": len(ids)})

    @app.post("/v1/responses/compact", summary="Refused: ember does not compact conversations")
    async def compact() -> Response:
        raise InvalidRequest("Compacting a conversation is not supported by this server.",
                             code="compaction_not_supported")

    @app.get("/v1/responses/{response_id}", summary="A stored response")
    async def retrieve(response_id: str, request: Request) -> dict:
        for name in ("stream", "starting_after", "include", "include[]"):
            if name in request.query_params and request.query_params[name] not in ("", "false"):
                raise unsupported(name, f"{name} is not supported when retrieving a response: ember returns the "
                                        "stored object as it was created")
        return _stored(store, response_id, tenant_of(request)).response

    @app.delete("/v1/responses/{response_id}", summary="Delete a stored response")
    async def delete(response_id: str, request: Request) -> dict:
        if not store.delete(response_id, tenant_of(request)):
            raise ResponseNotFound(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", summary="The input items of a stored response")
    async def input_items(response_id: str, request: Request) -> JSONResponse:
        items = list(_stored(store, response_id, tenant_of(request)).input_items)
        return JSONResponse(list_page(items, request.query_params))

    @app.post("/v1/responses/{response_id}/cancel", summary="Refused: there are no background responses")
    async def cancel(response_id: str) -> Response:
        raise InvalidRequest("Only background responses can be cancelled, and this server runs none: a response "
                             "ends when its request does (close the connection to stop it).",
                             param="response_id", code="background_not_supported")


def tenant_of(request: Request) -> str:
    """The tenant of the request's API key (`default` on a server without keys)."""
    return request.scope["ember.record"].tenant or DEFAULT_TENANT


def _stored(store: ResponseStore, response_id: str, tenant: str) -> StoredResponse:
    record = store.get(response_id, tenant)
    if record is None:
        raise ResponseNotFound(response_id)
    return record


def list_page(items: list[dict[str, Any]], query) -> dict[str, Any]:
    """OpenAI's list shape over `items` with `order` (asc | desc, default desc), `after` and `limit`."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be asc or desc; got '{order}'", param="order")
    raw_limit = query.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}; got '{raw_limit}'",
                             param="limit") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidRequest(f"limit must be from 1 to {MAX_LIST_LIMIT}; got {limit}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidRequest(f"after names '{after}', which is not an input item of this response",
                                 param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
