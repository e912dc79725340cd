"""The FastAPI application: routes, error rendering and middleware, around the server's ModelPool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ember.errors import EmberError
from ember.protocols.errors import MethodNotAllowed, ModelNotFound, RouteNotFound
from ember.protocols.openai_chat import CHAT
from ember.protocols.openai_completions import COMPLETIONS
from ember.server.config import ServerConfig
from ember.server.metrics import Metrics
from ember.server.model_card import model_card, weight_fields
from ember.server.middleware import GuardMiddleware, RequestContextMiddleware, error_response
from ember.server.observability import Observability
from ember.server.origin_guard import OriginGuardMiddleware
from ember.server.openapi import build_document, generation_route_docs
from ember.server.pipeline import serve_generation
from ember.server.request_log import RequestLog
from ember.server.responses_routes import add_responses_routes
from ember.server.anthropic_routes import ANTHROPIC_PATHS, add_anthropic_routes
from ember.server.embedding_routes import add_embedding_routes
from ember.server.native_routes import add_native_routes
from ember.server.ollama_routes import OLLAMA_PATHS, add_ollama_routes
from ember.server.model_pool import ModelPool, PoolPolicy, public_state
from ember.server.state import LoadedModel, ModelState, load_model
from ember.server.stats_logger import ThroughputReporter
from ember.server.ui_routes import add_ui_routes

logger = logging.getLogger("ember.server")


def create_app(config: ServerConfig, loader: Callable[[ServerConfig], LoadedModel] = load_model, *,
               request_log: RequestLog | None = None, argv: list[str] | None = None,
               models: list[ServerConfig] | None = None, policy: PoolPolicy = PoolPolicy()) -> FastAPI:
    """The app. `models`: every model's settings, the first one's server-wide fields in force
    (default: `config` alone); `policy`: when models are unloaded. `request_log`: the opened
    --request-log file (opened here from the config when not given); `argv`: the command line, its
    API key already redacted (cli.redact_argv), for the log's server_start event."""
    pool = ModelPool(models or [config], loader, policy)
    config = pool.config
    metrics = Metrics()
    if request_log is None and config.request_log:
        request_log = RequestLog.open(config.request_log)
    observability = Observability(pool, metrics, request_log, argv)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        pool.start()
        reporter = None
        if config.log_stats_interval > 0:
            reporter = asyncio.get_running_loop().create_task(
                ThroughputReporter(pool, config.log_stats_interval, request_log).run())
        yield
        if reporter is not None:
            reporter.cancel()
        await pool.shutdown()
        app.state.responses.close()
        observability.close()

    app = FastAPI(title="ember", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pool = pool
    app.state.metrics = metrics
    app.state.observability = observability
    _add_routes(app, pool, observability)
    add_responses_routes(app, config)
    add_anthropic_routes(app)
    add_native_routes(app, pool)
    add_embedding_routes(app)
    add_ollama_routes(app, pool)
    _add_error_handlers(app)
    app.add_middleware(GuardMiddleware, keys=pool.keys, max_body_bytes=config.max_request_bytes)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"], expose_headers=["x-request-id", "request-id"], max_age=600)
    app.add_middleware(OriginGuardMiddleware, listen_host=config.host, allowed_hosts=config.allowed_hosts,
                       cors_origins=config.cors_origins)
    app.add_middleware(RequestContextMiddleware, server=pool, observer=observability,
                       error_shapes={**ANTHROPIC_PATHS, **OLLAMA_PATHS})
    return app


def _add_routes(app: FastAPI, pool: ModelPool, observability: Observability) -> None:
    health_docs = {"responses": {200: {"description": "Ready.", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Health"}}}}, 503: {"description": "Loading or unavailable."}}}

    async def health() -> JSONResponse:
        status_code, status = pool.health()
        state = pool.default
        body: dict = {"status": status}
        if state.loaded is not None:
            body.update(state.loaded.engine.health())  # worker_pid, worker_restarts; workers under data parallelism
            for worker in body.get("workers", ()):
                if worker["stats"] is not None:
                    worker.update(cache_tier_fields(worker["stats"]["cache_tiers"]))
        if state.status == "ok":
            body.update(health_counters(state, observability, await state.engine_stats()))
        elif state.failure and not pool.several:
            body["reason"] = state.failure
        if pool.several or status == "ok":
            body["models"] = pool.model_states()
        return JSONResponse(body, status_code=status_code)

    app.add_api_route("/health", health, methods=["GET"], summary="Readiness and counters", **health_docs)
    app.add_api_route("/v1/health", health, methods=["GET"], summary="Readiness (same as /health)",
                      include_in_schema=False)
    app.add_api_route("/healthz", health, methods=["GET"], summary="Readiness (same as /health)",
                      include_in_schema=False)
    add_ui_routes(app, pool.config.ui, health)

    def cards(state: ModelState) -> list[dict]:
        return [model_card(state, name, public_state(state)) for name in (state.names or [pool.label(state)])]

    @app.get("/v1/models", summary="The served models, each under its id and aliases, with its state")
    async def list_models() -> dict:
        if not pool.several:
            pool.default.require_ready()
        return {"object": "list", "data": [card for state in pool.states for card in cards(state)]}

    @app.get("/v1/models/{model_id:path}", summary="One model, by id",
             responses={404: {"description": "Another id (model_not_found)."}})
    async def get_model(model_id: str) -> dict:
        state = pool.resolve(model_id)
        if not pool.several:
            state.require_ready()
            if not state.model.accepts(model_id):
                raise ModelNotFound(model_id, state.model.name)
        return model_card(state, model_id, public_state(state))

    @app.post("/v1/chat/completions", summary="Chat completion", **generation_route_docs("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return await serve_generation(request, CHAT)

    @app.post("/v1/completions", summary="Text completion", **generation_route_docs("CompletionRequest"))
    async def completions(request: Request) -> Response:
        return await serve_generation(request, COMPLETIONS)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_document(app)
        return app.openapi_schema

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus() -> Response:
        state = pool.default  # the engine's numbers are the first model's; every model's state is a gauge
        worker = state.loaded.engine.health() if state.loaded is not None else {}
        body = observability.metrics.render(state.admission, await state.engine_stats(), worker,
                                            pool.model_states())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/requests", summary="The last 100 generation requests in numbers (no text)")
    async def recent_requests() -> dict:
        return {"object": "list", "data": list(observability.recent)}


def health_counters(state: ModelState, observability: Observability, stats: dict[str, Any] | None) -> dict:
    """/health's numbers. The *_total fields only grow: a poller turns two samples into rates."""
    info = state.loaded.engine.info
    body: dict[str, Any] = {
        "model": state.model.name,
        "max_model_len": state.model.max_model_len,
        "kv_cache_tokens": state.model.kv_capacity_tokens,  # the most the KV pool holds (a worker's pool)
        "tensor_parallel_size": info.tensor_parallel_size if info is not None else 1,
        "data_parallel_size": state.config.data_parallel_size,
        "requests_running": state.admission.num_running,
        "requests_waiting": state.admission.num_waiting,
        "requests_finished": observability.requests_finished,
        # what is loaded: the id replies carry (system_fingerprint) and the digest of every component
        "deployment_id": state.fingerprint, "component_set_sha": state.component_set_sha,
        **weight_fields(state.loaded), "prefix_cache": state.config.engine.enable_prefix_caching,
        "slots": state.config.engine.max_num_seqs, "routed_experts": info.routed_experts if info is not None else None,
    }
    # The same numbers under the names other servers' pollers read.
    running, waiting = body["requests_running"], body["requests_waiting"]
    body.update(busy=running + waiting > 0, live_rows=running, waiting=waiting,
                requests_total=observability.requests_finished + running,
                context_length=state.model.window.tokens)
    invariance = state.loaded.batch_invariance
    if invariance:
        body.update(batch_invariant=invariance["holds"], batch_invariant_reason=invariance["reason"])
    if stats is not None:
        prefilling = stats.get("num_prefilling", 0)
        body.update(prompt_tokens_total=stats.get("admitted_prompt_tokens"),
                    cached_tokens_total=stats.get("cached_prompt_tokens"),
                    completion_tokens_total=stats.get("generation_tokens"),
                    prefill_seconds_total=stats.get("prefill_seconds"),
                    decode_seconds_total=stats.get("decode_seconds"),
                    rounds_total=stats.get("num_steps"),
                    draft_tokens_total=stats.get("spec_proposed_tokens"),
                    draft_tokens_accepted_total=stats.get("spec_accepted_tokens"),
                    drafted_total=stats.get("spec_proposed_tokens"),  # document 001's names of the two
                    accepted_total=stats.get("spec_accepted_tokens"),
                    streams={"decoding": stats.get("num_running", 0) - prefilling, "prefilling": prefilling,
                             "max": state.config.max_running},
                    engine=stats, **cache_tier_fields(stats["cache_tiers"]))
    return body


def cache_tier_fields(tiers: dict[str, dict]) -> dict[str, Any]:
    """The tiers behind the KV pool (EngineStats.cache_tiers) in /health: the host tier's numbers
    under the names other servers' pollers read (cache_bytes: ember keeps no other prompt state in
    host memory), the disk tier's beside them, zero or false for a tier that is off; and every
    tier's statistics whole."""
    host, disk = tiers.get("host", {}), tiers.get("disk", {})
    return {"cache_bytes": host.get("bytes", 0), "host_cache_bytes": host.get("bytes", 0),
            "host_cache_cap_bytes": host.get("capacity_bytes", 0), "host_cache_evictions": host.get("evictions", 0),
            "disk_cache_bytes": disk.get("bytes", 0), "disk_cache_cap_bytes": disk.get("capacity_bytes", 0),
            "disk_cache_enabled": disk.get("enabled", False), "cache_tiers": tiers}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EmberError)
    async def ember_error(request: Request, error: EmberError) -> Response:
        return error_response(error, request.scope.get("ember.record"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        if error.status_code == 405:
            ember = MethodNotAllowed(request.method, request.url.path)
        elif error.status_code == 404:
            ember = RouteNotFound(request.method, request.url.path)
        else:
            ember = EmberError(str(error.detail), status=error.status_code, type="invalid_request_error")
        return error_response(ember, request.scope.get("ember.record"))
