"""Ollama's /api/embed and its older /api/embeddings: texts in, vectors out, on the served embedding
model, through the same pooling requests as /v1/embeddings (protocols.embeddings).

    /api/embed       input (a string or a list of strings), truncate (default true: an input past
                     the context window keeps its first tokens; false: such an input is a 400 naming
                     it), dimensions, options, keep_alive; the vectors are unit length, as Ollama
                     gives them; answer: embeddings, prompt_eval_count and durations in nanoseconds
    /api/embeddings  prompt (one string), options, keep_alive; answer: embedding, the model's own
                     normalisation kept
`options` change nothing in pooling: each one sent is listed in x-ember-ignored-fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequest
from ember.loaders.serving_task import EMBED
from ember.protocols.embeddings import VectorShape, pooling_run, read_dimensions, vector_of
from ember.protocols.fields import Fields, json_type
from ember.protocols.neutral import Dialect, GenerationRequest, ModelInfo, NeverStreamed, ResponseMeta, RunResult
from ember.protocols.ollama_common import OLLAMA_ERRORS, durations, read_keep_alive, read_model
from ember.protocols.stream_format import NDJSON
from ember.protocols.unknown_fields import note_ignored, reads_fields

MAX_INPUTS = 2048


@dataclass(frozen=True, slots=True)
class EmbedReply:
    model_label: str  # the request's `model`, echoed
    shape: VectorShape
    legacy: bool  # /api/embeddings: one `embedding`


@reads_fields
def parse_embed(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    label = read_model(f, model)
    texts = _texts(f.raw("input"))
    keep_first = model.max_model_len if f.boolean("truncate", True) else None
    shape = VectorShape(True, read_dimensions(f, model.task))
    return _request(f, model, texts, "input" if len(texts) == 1 and isinstance(f.raw("input"), str) else None,
                    keep_first, EmbedReply(label, shape, legacy=False))


@reads_fields
def parse_legacy_embeddings(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    label = read_model(f, model)
    text = f.string("prompt", non_empty=True)
    if text is None:
        raise InvalidRequest("prompt is required: the text to embed", param="prompt")
    shape = VectorShape(model.task.pooling.normalize)
    return _request(f, model, [text], "prompt", None, EmbedReply(label, shape, legacy=True))


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"input must be a string or a non-empty list of strings, not {json_type(value)}",
                             param="input")
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(f"input holds {len(value)} texts; send at most {MAX_INPUTS}", param="input")
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text:
            raise InvalidRequest(f"input[{i}] must be a non-empty string", param=f"input[{i}]")
    return value


def _request(f: Fields, model: ModelInfo, texts: list[str], param: str | None, keep_first: int | None,
             reply: EmbedReply) -> GenerationRequest:
    options = f.object("options")
    if options is not None:
        note_ignored(*(f"options.{name}" for name in options.obj))
    keep_alive = read_keep_alive(f)
    task = model.task
    runs = [pooling_run(text, task, param or f"input[{i}]", prompt=task.pooling.default_prompt,
                        max_length=keep_first) for i, text in enumerate(texts)]
    return GenerationRequest(runs[0].prompt, runs[0].params, prompt_param=runs[0].prompt_param, batch=runs,
                             dialect_options=reply, keep_alive=keep_alive)


class EmbedRenderer(NeverStreamed):
    def __init__(self, request: GenerationRequest, result: RunResult, meta: ResponseMeta) -> None:
        self.reply: EmbedReply = request.dialect_options
        self.result = result

    def response(self) -> dict[str, Any]:
        vectors = [self.reply.shape.finish(vector_of(choice)) for choice in self.result.choices]
        if self.reply.legacy:
            return {"embedding": vectors[0]}
        numbers = durations(self.result)
        return {"model": self.reply.model_label, "embeddings": vectors,
                **{name: numbers[name] for name in ("total_duration", "load_duration", "prompt_eval_count")}}


EMBED_DIALECT = Dialect(name="ollama_embed", id_prefix="ollama-emb-", parse=parse_embed, renderer=EmbedRenderer,
                        errors=OLLAMA_ERRORS, tasks=(EMBED,), stream_format=NDJSON)
LEGACY_EMBEDDINGS = Dialect(name="ollama_embeddings", id_prefix="ollama-emb-", parse=parse_legacy_embeddings,
                            renderer=EmbedRenderer, errors=OLLAMA_ERRORS, tasks=(EMBED,), stream_format=NDJSON)
