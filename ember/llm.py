"""The offline Python API: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import io
import itertools
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, Union

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.driver import EngineDriver
from ember.engine.messages import Abort, Add, MediaSpan
from ember.engine.outputs import RequestTracker
from ember.errors import InvalidRequest
from ember.loaders import source_opener
from ember.media.image import ImageInput, read_image
from ember.media.limits import MediaLimits
from ember.media.prompt import lay_out_images
from ember.types import GenerationOutput, SamplingParams

Message = dict[str, Any]
Prompt = Union[str, list[int], list[Message]]


class LLM:
    """Loads a model and generates for batches of prompts, all scheduled together.

    `model` is a Hugging Face folder, a GGUF file, a Hugging Face repo id (`org/name[@revision][:QUANT]`,
    through the Hugging Face cache), `ollama:NAME[:TAG]` (Ollama's store at `ollama_models`, default
    ~/.ollama/models), or None for the default model. Other keyword arguments are EngineConfig fields
    (max_model_len, dtype, block_size, ...). With tensor_parallel_size N above 1, this process is
    rank 0 and starts N - 1 more on this host (engine.ranks); `close()` stops them.
    """

    def __init__(self, model: str | None = None, *, cache_dir: str | Path | None = None, revision: str | None = None,
                 ollama_models: str | Path | None = None, **engine_kwargs) -> None:
        config = EngineConfig(**engine_kwargs)
        open_source = source_opener(cache_dir, ollama_models)
        self.source = open_source(model, revision, config.mmproj)
        self.tokenizer = self.source.tokenizer
        group = None
        if config.tensor_parallel_size > 1:
            from ember.engine.messages import WorkerSettings
            from ember.engine.ranks import start_leader

            group = start_leader(WorkerSettings(model, str(cache_dir) if cache_dir else None, revision,
                                                str(ollama_models) if ollama_models else None, None, config))
        self.driver = EngineDriver(EngineCore.from_source(self.source, config, open_source, group), self.tokenizer)
        self.vision = self.engine.images.processing if self.engine.images is not None else None
        self._ids = itertools.count()

    @property
    def engine(self) -> EngineCore:
        return self.driver.core

    def close(self) -> None:
        """Write out the disk tier's queued blocks and stop a tensor-parallel group's other ranks."""
        self.engine.close()
        if self.engine.group is not None:
            self.engine.group.close()
            self.engine.group = None

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
        finals = {output.request_id: output for output in self._run(zip(batch, params)) if output.finished}
        return list(finals.values())

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[GenerationOutput]:
        """Generate for one prompt, yielding an output (with its text delta) at every step."""
        return self._run([(prompt, sampling_params or SamplingParams())])

    def _run(self, requests: Iterable[tuple[Prompt, SamplingParams]]) -> Iterator[GenerationOutput]:
        """Add every request, then step until all have finished, yielding each step's outputs (the
        finished ones in the order the requests were given, as `generate` returns them). A stop
        string aborts its request in the engine; leaving early aborts every live one."""
        trackers: dict[str, RequestTracker] = {}
        finished: dict[str, GenerationOutput] = {}
        try:
            for prompt, params in requests:
                token_ids, media = self.encode_with_images(prompt)
                add = Add(f"llm-{next(self._ids)}", token_ids, params, arrival_time=time.time(), media=media)
                self.driver.admit(add)
                trackers[add.request_id] = RequestTracker(add.request_id, token_ids, params,
                                                          self.tokenizer.hf.backend_tokenizer, add.arrival_time)
            while len(finished) < len(trackers):
                for step in self.driver.step():
                    tracker = trackers[step.request_id]
                    output = tracker.update(step)
                    if tracker.stopped_by_string:
                        self.driver.abort(Abort([step.request_id]))
                    if output.finished:
                        finished[step.request_id] = output
                    else:
                        yield output
            yield from (finished[request_id] for request_id in trackers)
        finally:  # on an error, KeyboardInterrupt or a consumer that left, give every block back
            self.driver.abort(Abort([request_id for request_id in trackers if request_id not in finished]))

    def chat(self, messages: list[Message], sampling_params: SamplingParams | None = None) -> GenerationOutput:
        return self.generate([messages], sampling_params)[0]

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.encode_with_images(prompt)[0]

    def encode_with_images(self, prompt: Prompt) -> tuple[list[int], list[MediaSpan]]:
        """(token ids, the images' spans). A chat message's content may be a list of parts:
        {"type": "text", "text": ...} and, for a vision model, {"type": "image", "image": ...} with
        the image file's bytes, its path, or a PIL image."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True), []
        if prompt and all(isinstance(m, dict) for m in prompt):
            images = [_read_image(part["image"]) for m in prompt if isinstance(m.get("content"), list)
                      for part in m["content"] if part.get("type") == "image"]
            if not images:
                return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True), []
            if self.vision is None:
                raise InvalidRequest("this model reads no images", param="prompts", code="vision_disabled")
            text = self.tokenizer.render_chat_template(prompt, add_generation_prompt=True)
            ids, spans = lay_out_images(text, images, self.vision,
                                        lambda text: self.tokenizer.encode(text, add_special_tokens=False), "prompts")
            return ids, [MediaSpan(s.image.sha256, s.image.data, s.start, s.stop) for s in spans]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt), []
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


def _read_image(image: bytes | str | Path | Any) -> ImageInput:
    """An image part's image (a file's bytes, its path, or a PIL image), checked as a server checks one."""
    if isinstance(image, (str, Path)):
        image = Path(image).read_bytes()
    elif not isinstance(image, (bytes, bytearray)):  # a PIL image: its pixels, losslessly
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        image = buffer.getvalue()
    return read_image(bytes(image), "prompts", MediaLimits())
