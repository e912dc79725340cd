"""The offline Python API: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.outputs import RequestTracker
from ember.errors import InvalidRequest
from ember.loaders import source_opener
from ember.types import GenerationOutput, SamplingParams

Message = dict[str, Any]
Prompt = Union[str, list[int], list[Message]]


class LLM:
    """Loads a model and generates for batches of prompts, all scheduled together.

    `model` is a Hugging Face folder, a GGUF file, a Hugging Face repo id (`org/name[@revision][:QUANT]`,
    through the Hugging Face cache), `ollama:NAME[:TAG]` (Ollama's store at `ollama_models`, default
    ~/.ollama/models), or None for the default model. Other keyword arguments are EngineConfig fields
    (max_model_len, dtype, block_size, ...).
    """

    def __init__(self, model: str | None = None, *, cache_dir: str | Path | None = None, revision: str | None = None,
                 ollama_models: str | Path | None = None, **engine_kwargs) -> None:
        open_source = source_opener(cache_dir, ollama_models)
        self.source = open_source(model, revision)
        self.tokenizer = self.source.tokenizer
        self.engine = EngineCore.from_source(self.source, EngineConfig(**engine_kwargs), open_source)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[GenerationOutput]:
        """Prompts: a string, a list of token ids, a list of chat messages, or a list of those."""
        batch = _as_batch(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(batch) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(batch):
            raise InvalidRequest(f"got {len(batch)} prompts but {len(params)} sampling params", param="sampling_params")
        trackers: dict[str, RequestTracker] = {}
        order: list[str] = []
        results: dict[str, GenerationOutput] = {}
        try:
            for prompt, p in zip(batch, params):
                token_ids = self.encode_prompt(prompt)
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, token_ids, p)
                trackers[request_id] = RequestTracker(request_id, token_ids, p, self.tokenizer.hf.backend_tokenizer)
                order.append(request_id)
            while len(results) < len(order):
                for step in self.engine.step():
                    tracker = trackers[step.request_id]
                    output = tracker.update(step)
                    if tracker.stopped_by_string:
                        self.engine.abort([step.request_id])
                    if output.finished:
                        results[step.request_id] = output
        finally:  # on an error or KeyboardInterrupt, give every block back
            unfinished = [r for r in order if r not in results]
            if unfinished:
                self.engine.abort(unfinished)
        return [results[r] for r in order]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[GenerationOutput]:
        """Generate for one prompt, yielding an output (with its text delta) at every step."""
        params = sampling_params or SamplingParams()
        token_ids = self.encode_prompt(prompt)
        request_id = f"llm-{next(self._ids)}"
        self.engine.add_request(request_id, token_ids, params)
        tracker = RequestTracker(request_id, token_ids, params, self.tokenizer.hf.backend_tokenizer)
        finished = False
        try:
            while not finished:
                for step in self.engine.step():
                    output = tracker.update(step)
                    finished = output.finished
                    yield output
        finally:
            if not finished or tracker.stopped_by_string:
                self.engine.abort([request_id])

    def chat(self, messages: list[Message], sampling_params: SamplingParams | None = None) -> GenerationOutput:
        return self.generate([messages], sampling_params)[0]

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise InvalidRequest("a prompt must be a string, a list of token ids or a list of chat messages",
                             param="prompts")


def _as_batch(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequest("prompts must be a prompt or a non-empty list of prompts", param="prompts")
    first = prompts[0]
    if isinstance(first, (int, dict)):  # one token list or one conversation
        return [list(prompts)]
    return list(prompts)
