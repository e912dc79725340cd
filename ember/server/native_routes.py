"""Native routes: SGLang's /generate, vLLM's /tokenize and /detokenize, and /v1/systemone.

/generate and /v1/systemone go through the one generation pipeline (admission, the request log,
metrics); /tokenize and /detokenize only tokenize, like the count_tokens routes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ember.errors import InvalidRequest
from ember.protocols.json_body import parse_body
from ember.protocols.native_generate import GENERATE
from ember.protocols.native_tokens import parse_detokenize, parse_tokenize, render_detokenize, render_tokenize
from ember.protocols.systemone import SYSTEMONE
from ember.server.openapi import generation_route_docs
from ember.server.model_pool import ModelPool
from ember.server.pipeline import requested_model, serve_generation, tokenize_only

DECIDER_CONFIG = "decider_config.json"

def _body_docs(schema: str) -> dict[str, Any]:
    return {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}}}


def decider_config_of(model: str | None) -> Path | None:
    """The decider file of a model folder that holds one (a model trained for /v1/systemone)."""
    if model is None or not Path(model).is_dir():
        return None
    path = Path(model) / DECIDER_CONFIG
    return path if path.exists() else None


def add_native_routes(app: FastAPI, pool: ModelPool) -> None:

    @app.post("/generate", summary="Generate (SGLang's native route)", **generation_route_docs("GenerateRequest"))
    async def generate(request: Request) -> Response:
        return await serve_generation(request, GENERATE)

    systemone_docs = generation_route_docs("SystemOneRequest")
    systemone_docs["responses"][200] = {"description": "The answers, by question name (never streamed).",
                                        "content": {"application/json": {}}}

    @app.post("/v1/systemone", summary="Typed decisions read from next-token probabilities", **systemone_docs)
    async def systemone(request: Request) -> Response:
        decider = decider_config_of(pool.resolve(requested_model(parse_body(await request.body()))).config.model)
        if decider is not None:
            raise InvalidRequest(f"this model folder holds {DECIDER_CONFIG} (a trained decider); ember reads "
                                 f"/v1/systemone zero-shot only and does not implement the decider reading",
                                 param=None, code="decider_not_supported")
        return await serve_generation(request, SYSTEMONE)

    @app.post("/tokenize", summary="The token ids of a prompt or of messages (vLLM's shape)",
              **_body_docs("TokenizeRequest"))
    async def tokenize(request: Request) -> dict:
        def answer(job, token_ids: list[int], state) -> dict:
            strs = state.loaded.tokenizer.convert_ids_to_tokens(token_ids) if job.return_token_strs else []
            return render_tokenize(job, token_ids, state.model, list(strs))

        return await tokenize_only(request, parse_tokenize, answer)

    @app.post("/detokenize", summary="The text of token ids (vLLM's shape)", **_body_docs("DetokenizeRequest"))
    async def detokenize(request: Request) -> dict:
        raw = parse_body(await request.body())
        async with pool.using(requested_model(raw)) as state:
            return render_detokenize(state.decode(parse_detokenize(raw, state.model)))
