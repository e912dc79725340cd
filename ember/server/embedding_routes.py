"""Embedding and reranking routes: /v1/embeddings, /v1/rerank (also /rerank and /v1/reranking), /v1/score
(also /score), all through the one generation pipeline (admission, the request log, metrics).
Ollama's /api/embed is one more dialect on the same pipeline (server.ollama_routes)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ember.protocols.embeddings import EMBEDDINGS
from ember.protocols.rerank import RERANK_DIALECT, SCORE_DIALECT
from ember.server.pipeline import serve_generation


def _docs(fields: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": fields, "required": required}
    return {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}}


_TEXTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
EMBEDDINGS_DOCS = _docs({"input": {"anyOf": [_TEXTS, {"type": "array"}]}, "model": {"type": "string"},
                         "encoding_format": {"enum": ["float", "base64"]}, "dimensions": {"type": "integer"},
                         "truncate_prompt_tokens": {"type": "integer"}, "prompt_name": {"type": "string"}},
                        ["input"])
RERANK_DOCS = _docs({"query": {"type": "string"}, "documents": {"type": "array"}, "model": {"type": "string"},
                     "top_n": {"type": "integer"}, "return_documents": {"type": "boolean"},
                     "instruction": {"type": "string"}}, ["query", "documents"])
SCORE_DOCS = _docs({"text_1": _TEXTS, "text_2": _TEXTS, "model": {"type": "string"},
                    "instruction": {"type": "string"}}, ["text_1", "text_2"])


def add_embedding_routes(app: FastAPI) -> None:
    @app.post("/v1/embeddings", summary="Embeddings (OpenAI's shape)", **EMBEDDINGS_DOCS)
    async def embeddings(request: Request) -> Response:
        return await serve_generation(request, EMBEDDINGS)

    async def rerank(request: Request) -> Response:
        return await serve_generation(request, RERANK_DIALECT)

    for path in ("/v1/rerank", "/rerank", "/v1/reranking"):
        app.add_api_route(path, rerank, methods=["POST"], summary="Documents ordered by relevance to a query",
                          include_in_schema=path == "/v1/rerank", **RERANK_DOCS)

    async def score(request: Request) -> Response:
        return await serve_generation(request, SCORE_DIALECT)

    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"], summary="Relevance scores of text pairs (vLLM's shape)",
                          include_in_schema=path == "/v1/score", **SCORE_DOCS)
