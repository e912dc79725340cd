"""`POST /v1/rerank` (the shape llama-server, vLLM and the Jina / Cohere clients use) and
`POST /v1/score` (vLLM's `text_1` / `text_2`): how relevant each document is to a query.

How a pair is scored is the served model's (loaders.serving_task):
- a cross-encoder (a classification head of one label): the tokenizer's pair encoding of (query,
  document), as transformers and sentence-transformers encode a pair, read through the head at the
  last token in the engine (types.CLASSIFY); the relevance is the sigmoid of that logit, as
  sentence-transformers' CrossEncoder reports it by default;
- a yes/no reranker (Qwen3-Reranker): the prompt its model card documents, one prompt-only
  reading per pair, and the relevance is the probability of "yes" in a softmax over the logits of
  "yes" and "no" at the last position (the log-probability path /v1/systemone reads);
- an embedding model: the cosine similarity of the query's and the document's vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequest
from ember.loaders.serving_task import EMBED, RERANK, ServingTask
from ember.protocols.embeddings import pooling_run, vector_of
from ember.protocols.errors import OPENAI_ERRORS, GenerationFailed
from ember.protocols.fields import Fields, json_type
from ember.protocols.neutral import (ChoiceResult, Dialect, GenerationRequest, NeverStreamed, ModelInfo, PromptRun, ResponseMeta,
                                     RunResult, TextPrompt)
from ember.protocols.openai_common import check_model
from ember.protocols.systemone import label_probabilities
from ember.types import CLASSIFY, SamplingParams

MAX_DOCUMENTS = 1024
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen3-Reranker's prompt, from its model card
_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                  "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
_RERANK_FIELDS = ("model", "query", "documents", "top_n", "return_documents", "instruction", "truncate_prompt_tokens")
_SCORE_FIELDS = ("model", "text_1", "text_2", "instruction", "truncate_prompt_tokens")


def rerank_prompt(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    return f"{_RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{_RERANK_SUFFIX}"


# How a pair's relevance is read: the head's logit, the yes/no reading, or two vectors compared
HEAD, YES_NO, COSINE = "head", "yes_no", "cosine"


def pair_reading(task: ServingTask) -> str:
    if task.kind == EMBED:
        return COSINE
    return HEAD if task.cross_encoder else YES_NO


@dataclass(frozen=True, slots=True)
class Pairs:
    """What the renderer needs: the pairs' (query index, document index) by run, the documents'
    texts, and how the runs score (a reading per pair, or vectors compared)."""

    reading: str  # HEAD, YES_NO: run i scores pair i; COSINE: runs are the queries' then the documents' vectors
    pairs: list[tuple[int, int]]
    num_queries: int
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = False


def _runs(task: ServingTask, queries: list[str], documents: list[str], pairs: list[tuple[int, int]],
          instruction: str | None, keep: int | None, doc_param: str) -> list[PromptRun]:
    reading = pair_reading(task)
    if reading != YES_NO and instruction is not None:
        raise InvalidRequest("instruction is read by yes/no rerankers only; this server scores by "
                             + ("its classification head" if reading == HEAD else "embeddings"), param="instruction")
    if reading == HEAD:
        params = SamplingParams(max_tokens=0, pooling=CLASSIFY)
        return [PromptRun(TextPrompt(queries[q], text_pair=documents[d], keep_last_tokens=keep), params,
                          f"{doc_param}[{d}]") for q, d in pairs]
    if reading == YES_NO:
        yes, no = task.label_token_ids
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0,
                                logprob_token_ids=[yes, no])
        return [PromptRun(TextPrompt(rerank_prompt(queries[q], documents[d], instruction or DEFAULT_INSTRUCTION),
                                     add_special_tokens=False, keep_last_tokens=keep),
                          params, f"{doc_param}[{d}]") for q, d in pairs]
    prompt = task.pooling.default_prompt
    return ([pooling_run(q, task, "query", prompt=prompt, keep_last_tokens=keep) for q in queries]
            + [pooling_run(d, task, f"{doc_param}[{i}]", prompt=prompt, keep_last_tokens=keep)
               for i, d in enumerate(documents)])


def _request(task: ServingTask, queries: list[str], documents: list[str], pairs: list[tuple[int, int]],
             f: Fields, doc_param: str, **options) -> GenerationRequest:
    runs = _runs(task, queries, documents, pairs, f.string("instruction"),
                 f.integer("truncate_prompt_tokens", low=1), doc_param)
    scoring = Pairs(pair_reading(task), pairs, len(queries), documents, **options)
    return GenerationRequest(runs[0].prompt, runs[0].params, prompt_param=runs[0].prompt_param, batch=runs,
                             dialect_options=scoring, total_tokens_param=doc_param)


def _refuse_unknown(f: Fields, known: tuple[str, ...], route: str) -> None:
    for key in f.obj:
        if key not in known:
            raise InvalidRequest(f"{key} is not a field of {route}", param=key, code="unknown_parameter")


def _texts(value: Any, path: str, *, documents: bool = False) -> list[str]:
    """A string, or a non-empty list of strings (documents may be {"text": ...} objects too)."""
    items = value if isinstance(value, list) else [value]
    if value is None or not items:
        raise InvalidRequest(f"{path} is required: a string or a non-empty list of strings", param=path)
    if len(items) > MAX_DOCUMENTS:
        raise InvalidRequest(f"{path} holds {len(items)} texts; send at most {MAX_DOCUMENTS}", param=path)
    texts = []
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(value, list) else path
        if documents and isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str) or not item:
            shapes = "a non-empty string or an object with text" if documents else "a non-empty string"
            raise InvalidRequest(f"{where} must be {shapes}, not {json_type(item)}", param=where)
        texts.append(item)
    return texts


def parse_rerank(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    _refuse_unknown(f, _RERANK_FIELDS, "/v1/rerank")
    check_model(f, model)
    query = f.string("query", non_empty=True)
    if query is None:
        raise InvalidRequest("query is required: a non-empty string", param="query")
    documents = _texts(f.obj.get("documents"), "documents", documents=True)
    if not isinstance(f.obj["documents"], list):
        raise InvalidRequest("documents must be a list", param="documents")
    top_n = f.integer("top_n", low=1)
    pairs = [(0, d) for d in range(len(documents))]
    return _request(model.task, [query], documents, pairs, f, "documents", top_n=top_n,
                    return_documents=f.boolean("return_documents", True))


def parse_score(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    _refuse_unknown(f, _SCORE_FIELDS, "/v1/score")
    check_model(f, model)
    firsts = _texts(f.obj.get("text_1"), "text_1")
    seconds = _texts(f.obj.get("text_2"), "text_2")
    if len(firsts) == 1:
        pairs = [(0, d) for d in range(len(seconds))]
    elif len(firsts) == len(seconds):
        pairs = [(i, i) for i in range(len(seconds))]
    else:
        raise InvalidRequest(f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: send one text_1, or as "
                             "many as text_2 (scored pairwise)", param="text_2")
    return _request(model.task, firsts, seconds, pairs, f, "text_2")


def cosine(a: list[float], b: list[float]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norms if norms > 0 else 0.0


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)  # no overflow for a large negative logit
    return e / (1.0 + e)


def pair_scores(scoring: Pairs, choices: list[ChoiceResult]) -> list[float]:
    """Each pair's relevance, in pair order."""
    if scoring.reading == HEAD:
        return [sigmoid(vector_of(choice)[0]) for choice in choices]
    if scoring.reading == YES_NO:
        scores = []
        for choice in choices:
            if not choice.logprobs:
                raise GenerationFailed(choice.error or "the model gave no reading for a pair")
            scores.append(label_probabilities([lp for _, lp in choice.logprobs[0].requested])[0])
        return scores
    vectors = [vector_of(choice) for choice in choices]
    queries, documents = vectors[:scoring.num_queries], vectors[scoring.num_queries:]
    return [cosine(queries[q], documents[d]) for q, d in scoring.pairs]


class _PairsRenderer(NeverStreamed):
    def __init__(self, request: GenerationRequest, result: RunResult, meta: ResponseMeta) -> None:
        self.scoring: Pairs = request.dialect_options
        self.result = result
        self.meta = meta


class RerankRenderer(_PairsRenderer):
    def response(self) -> dict[str, Any]:
        scores = pair_scores(self.scoring, self.result.choices)
        order = sorted(range(len(scores)), key=lambda d: -scores[d])[:self.scoring.top_n]
        results = []
        for d in order:
            entry: dict[str, Any] = {"index": d, "relevance_score": scores[d]}
            if self.scoring.return_documents:
                entry["document"] = {"text": self.scoring.documents[d]}
            results.append(entry)
        tokens = self.result.num_prompt_tokens
        return {"id": self.meta.response_id, "model": self.meta.model, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class ScoreRenderer(_PairsRenderer):
    def response(self) -> dict[str, Any]:
        scores = pair_scores(self.scoring, self.result.choices)
        tokens = self.result.num_prompt_tokens
        return {"id": self.meta.response_id, "object": "list", "created": self.meta.created, "model": self.meta.model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


RERANK_DIALECT = Dialect(name="rerank", id_prefix="rerank-", parse=parse_rerank, renderer=RerankRenderer,
                         errors=OPENAI_ERRORS, tasks=(EMBED, RERANK))
SCORE_DIALECT = Dialect(name="score", id_prefix="score-", parse=parse_score, renderer=ScoreRenderer,
                        errors=OPENAI_ERRORS, tasks=(EMBED, RERANK))
