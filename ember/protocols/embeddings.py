"""`POST /v1/embeddings` (OpenAI's shape): one vector per input, each input a prompt-only pooling
request; a request's inputs run together as one batch.

Fields: `input` (a string, a list of strings, a list of token ids, or a list of such lists; at most
MAX_INPUTS), `model`, `encoding_format` (float or base64: little-endian float32), `dimensions` (the
first N values, scaled to unit length again), `user` (taken, unused), and ember's
`truncate_prompt_tokens` (keep only an input's last N tokens) and `prompt_name` (one of the model's
sentence-transformers prompts, prefixed to every text input; default: the model's default prompt).
A model's max_seq_length (sentence_bert_config.json) cuts every input to its first tokens, as
sentence-transformers does. An input still longer than the context window is a 400 naming its
index, unless truncated.
"""

from __future__ import annotations

import array
import base64
import math
import struct
from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequest
from ember.loaders.serving_task import EMBED, ServingTask
from ember.protocols.errors import OPENAI_ERRORS, GenerationFailed
from ember.protocols.fields import Fields, json_type
from ember.protocols.neutral import (ChoiceResult, Dialect, GenerationRequest, ModelInfo, NeverStreamed, PromptRun,
                                     ResponseMeta, RunResult, TextPrompt, TokenPrompt)
from ember.protocols.openai_common import check_model
from ember.types import SamplingParams

MAX_INPUTS = 2048
_FIELDS = ("input", "model", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "prompt_name")


@dataclass(frozen=True, slots=True)
class VectorShape:
    """What becomes of a pooled vector: cut to `dimensions`, then scaled to unit length when the
    model normalises or when it was cut."""

    normalize: bool
    dimensions: int | None = None

    def finish(self, pooled: list[float]) -> list[float]:
        vector = pooled[:self.dimensions] if self.dimensions else pooled
        if self.normalize or self.dimensions:
            norm = math.sqrt(math.fsum(v * v for v in vector))
            vector = [v / norm for v in vector] if norm > 0 else list(vector)
        return array.array("f", vector).tolist()  # float32 values, as the base64 form carries them


def pooling_params(task: ServingTask) -> SamplingParams:
    return SamplingParams(max_tokens=0, pooling=task.pooling.method)


def pooling_run(value: str | list[int], task: ServingTask, param: str, *, prompt: str = "",
                keep_last_tokens: int | None = None, max_length: int | None = None) -> PromptRun:
    """One input as a pooling request: text after the instruction `prompt`, or token ids as they are.
    The model's max_seq_length (and `max_length`, where smaller) cuts it first, as sentence-transformers
    does (its first tokens kept, and a text's special tokens); then `keep_last_tokens` keeps the last
    of those."""
    limit = min((n for n in (task.pooling.max_input_tokens, max_length) if n), default=None)
    if isinstance(value, str):
        text = TextPrompt(prompt + value, add_special_tokens=True, keep_last_tokens=keep_last_tokens, max_length=limit)
        return PromptRun(text, pooling_params(task), param)
    ids = value[:limit] if limit else value
    ids = ids[-keep_last_tokens:] if keep_last_tokens else ids
    return PromptRun(TokenPrompt(list(ids)), pooling_params(task), param)


def read_dimensions(f: Fields, task: ServingTask) -> int | None:
    return f.integer("dimensions", low=1, high=task.dimension)


def parse_embeddings(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    for key in f.obj:
        if key not in _FIELDS:
            raise InvalidRequest(f"{key} is not a field of /v1/embeddings", param=key, code="unknown_parameter")
    check_model(f, model)
    task = model.task
    inputs = _read_inputs(f.obj.get("input"), model.vocab_size)
    encoding = f.string("encoding_format", "float", choices=("float", "base64"))
    dimensions = read_dimensions(f, task)
    keep = f.integer("truncate_prompt_tokens", low=1)
    prompt_name = f.string("prompt_name")
    prompts = task.pooling.prompts
    if prompt_name is not None and prompt_name not in prompts:
        known = ", ".join(prompts) or "none"
        raise InvalidRequest(f"prompt_name {prompt_name!r} is not one of the model's prompts ({known})",
                             param="prompt_name")
    prompt = prompts[prompt_name] if prompt_name is not None else task.pooling.default_prompt
    runs = [pooling_run(value, task, f"input[{i}]" if isinstance(f.obj["input"], list) else "input",
                        prompt=prompt, keep_last_tokens=keep) for i, value in enumerate(inputs)]
    options = EmbeddingOptions(encoding, VectorShape(task.pooling.normalize, dimensions))
    return GenerationRequest(runs[0].prompt, runs[0].params, prompt_param=runs[0].prompt_param, batch=runs,
                             dialect_options=options, total_tokens_param="input")


def _read_inputs(value: Any, vocab_size: int) -> list[str | list[int]]:
    if isinstance(value, str):
        return [_text(value, "input")]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string, a list of strings, a list of token ids or a list of such lists "
                             f"(not empty), not {json_type(value)}", param="input")
    if all(_is_token(v) for v in value):
        return [_tokens(value, "input", vocab_size)]
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(f"input holds {len(value)} inputs; send at most {MAX_INPUTS}", param="input")
    read: list[str | list[int]] = []
    for i, item in enumerate(value):
        path = f"input[{i}]"
        read.append(_text(item, path) if isinstance(item, str) else _tokens(item, path, vocab_size))
    return read


def _text(value: str, path: str) -> str:
    if not value:
        raise InvalidRequest(f"{path} must not be empty", param=path)
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tokens(value: Any, path: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value or not all(_is_token(t) for t in value):
        raise InvalidRequest(f"{path} must be a string or a non-empty list of token ids", param=path)
    if any(not 0 <= t < vocab_size for t in value):
        raise InvalidRequest(f"{path} holds a token id outside the vocabulary (0..{vocab_size - 1})", param=path)
    return value


@dataclass(frozen=True, slots=True)
class EmbeddingOptions:
    encoding_format: str
    shape: VectorShape


def vector_of(choice: ChoiceResult) -> list[float]:
    if choice.pooled is None:
        raise GenerationFailed(choice.error or "the engine returned no vector for an input")
    return choice.pooled


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class EmbeddingsRenderer(NeverStreamed):
    def __init__(self, request: GenerationRequest, result: RunResult, meta: ResponseMeta) -> None:
        self.options: EmbeddingOptions = request.dialect_options
        self.result = result
        self.meta = meta

    def response(self) -> dict[str, Any]:
        data = [{"object": "embedding", "index": choice.index,
                 "embedding": encode_vector(self.options.shape.finish(vector_of(choice)),
                                            self.options.encoding_format)}
                for choice in self.result.choices]
        tokens = self.result.num_prompt_tokens
        return {"object": "list", "data": data, "model": self.meta.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


EMBEDDINGS = Dialect(name="embeddings", id_prefix="emb-", parse=parse_embeddings, renderer=EmbeddingsRenderer,
                     errors=OPENAI_ERRORS, tasks=(EMBED,))
