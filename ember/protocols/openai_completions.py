"""OpenAI Completions: a plain prompt continued, no chat template."""

from __future__ import annotations

from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.errors import OPENAI_ERRORS, unsupported
from ember.protocols.fields import Fields, as_integer, json_type
from ember.protocols.neutral import ChoiceResult, Dialect, GenerationRequest, ModelInfo, TextPrompt, TokenPrompt
from ember.protocols.openai_common import (
    MAX_TOP_LOGPROBS, OpenAIRenderer, check_model, completion_logprobs, read_accepted,
    read_choices, read_sampling, read_stream,
)
from ember.protocols.output_hints import refuse_other_prompt_field
from ember.protocols.structured import read_openai_structured
from ember.protocols.progress import read_stream_extras
from ember.protocols.sse import ServerEvent
from ember.types import GenerationOutput
from ember.protocols.unknown_fields import reads_fields


@reads_fields
def parse_completion(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    check_model(f, model)
    refuse_other_prompt_field(f, "messages", "/v1/chat/completions", "prompt")
    prompt = read_prompt(f, model.vocab_size)
    grammar = read_openai_structured(f)
    n = read_choices(f)
    logprobs = f.integer("logprobs", low=0, high=MAX_TOP_LOGPROBS)
    echo = f.boolean("echo", False)
    if echo and logprobs is not None:
        raise unsupported("echo", "echo together with logprobs needs the prompt's log probabilities, which this "
                                  "server does not compute")
    if f.string("suffix"):
        raise unsupported("suffix", "suffix (fill in the middle) is not supported by this server")
    best_of = f.integer("best_of", low=1)
    if best_of is not None and best_of != n:
        raise unsupported("best_of", "best_of is not supported; use n to get several completions")
    params = read_sampling(f, model, logprobs=logprobs)
    stream, include_usage = read_stream(f)
    return_token_ids = f.boolean("return_token_ids", False)
    return_progress, timings_per_token = read_stream_extras(f)
    read_accepted(f)
    return GenerationRequest(prompt, params, n=n, stream=stream, include_usage=include_usage,
                             return_token_ids=return_token_ids, echo=echo, prompt_param="prompt",
                             return_progress=return_progress, timings_per_token=timings_per_token,
                             grammar=grammar)


def read_prompt(f: Fields, vocab_size: int) -> TextPrompt | TokenPrompt:
    """A string, an array of one string, or an array of token ids (also wrapped in one array)."""
    prompt = f.raw("prompt")
    if prompt is None:
        raise InvalidRequest("prompt is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return TextPrompt(prompt)
    if not isinstance(prompt, list):
        raise InvalidRequest(f"prompt must be a string or an array of token ids, not {json_type(prompt)}",
                             param="prompt")
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest(f"prompt holds {len(prompt)} prompts; send one prompt per request", param="prompt")
    return TokenPrompt([as_integer(t, f"prompt[{i}]", low=0, high=vocab_size - 1) for i, t in enumerate(prompt)])


class CompletionRenderer(OpenAIRenderer):
    chunk_object = "text_completion"

    def __init__(self, request, result, meta) -> None:
        super().__init__(request, result, meta)
        self.prompt_text = self._prompt_text() if request.echo else ""
        self.offsets = [len(self.prompt_text)] * request.n  # where each choice's next text starts

    def _prompt_text(self) -> str:
        prompt = self.request.prompt
        return prompt.text if isinstance(prompt, TextPrompt) else self.meta.decode(self.result.prompt_token_ids)

    def stream_start(self) -> list[ServerEvent]:
        if not self.prompt_text:
            return []
        return [self.chunk([{"index": i, "text": self.prompt_text, "logprobs": None, "finish_reason": None}])
                for i in range(self.request.n)]

    empty_delta = {"text": ""}

    def delta_body(self, choice: ChoiceResult, output: GenerationOutput, with_logprobs: bool) -> dict[str, Any]:
        offset = self.offsets[choice.index]
        self.offsets[choice.index] += len(output.text_delta)
        return {"text": output.text_delta,
                "logprobs": completion_logprobs(output.new_logprobs, self.meta.token_text, offset)
                if with_logprobs else None}

    def choice_body(self, choice) -> dict[str, Any]:
        logprobs = self.request.params.logprobs is not None
        return {"text": self.prompt_text + choice.text,
                "logprobs": completion_logprobs(choice.logprobs, self.meta.token_text, len(self.prompt_text))
                if logprobs else None}

    def response(self) -> dict[str, Any]:
        return self.whole_response("text_completion")


COMPLETIONS = Dialect(name="completions", id_prefix="cmpl-", parse=parse_completion, renderer=CompletionRenderer,
                      errors=OPENAI_ERRORS)
