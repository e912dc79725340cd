"""Embedding and reranking routes: /v1/embeddings, /v1/rerank (also /rerank and /v1/reranking), /v1/score
(also /score), all through the one generation pipeline (admission, the request log, metrics); and
`embed_texts`, the call other dialects' routes (Ollama's /api/embed) use to embed texts."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ember.loaders.serving_task import EMBED, check_serves
from ember.protocols.embeddings import EMBEDDINGS, VectorShape, pooling_run, vector_of
from ember.protocols.neutral import GenerationRequest, RunResult, resolve_sampling
from ember.protocols.rerank import RERANK_DIALECT, SCORE_DIALECT
from ember.server.keys import DEFAULT_TENANT
from ember.server.pipeline import ChoiceRun, serve_generation
from ember.server.state import ServerState


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


@dataclass(slots=True)
class EmbeddedTexts:
    vectors: list[list[float]]  # one per text, in order (float32 values)
    token_counts: list[int]  # each text's prompt tokens


async def embed_texts(state: ServerState, texts: list[str], *, dimensions: int | None = None,
                      keep_last_tokens: int | None = None, param: str = "input") -> EmbeddedTexts:
    """Embed `texts` on the served embedding model, as one batch through admission, with the
    model's default prompt and normalisation; `dimensions` cuts each vector (then renormalised);
    `keep_last_tokens` truncates each text. Refusals (InvalidRequest) name `param[i]`, or `param`
    when the texts hold more tokens together than --max-total-input-tokens."""
    await state.require_engine()
    task = state.model.task
    check_serves(task, (EMBED,))
    runs = [pooling_run(text, task, f"{param}[{i}]", prompt=task.pooling.default_prompt,
                        keep_last_tokens=keep_last_tokens) for i, text in enumerate(texts)]
    prompts = [await state.encode(run.prompt) for run in runs]
    params = [resolve_sampling(GenerationRequest(run.prompt, run.params, prompt_param=run.prompt_param), len(ids), state.model, run.params, run.prompt_param)[0]
              for run, ids in zip(runs, prompts)]
    state.model.check_total_input_tokens(prompts, param)
    ticket = await state.admission.acquire(len(runs), DEFAULT_TENANT)
    result = RunResult(len(runs), prompts[0], batch_prompt_ids=prompts)
    run = ChoiceRun(state.engine, prompts, params, f"embed-{uuid.uuid4().hex}")
    try:
        async for index, output in run.outputs():
            result.add(index, output)
    finally:
        await run.close()
        ticket.release()
    shape = VectorShape(task.pooling.normalize, dimensions)
    return EmbeddedTexts([shape.finish(vector_of(choice)) for choice in result.choices],
                         [len(ids) for ids in prompts])

