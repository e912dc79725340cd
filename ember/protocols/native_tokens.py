"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt's token ids as the server would run them
(a text, or messages through the chat template), and token ids back to text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields, as_integer
from ember.protocols.cache_hints import read_openai_cache_options
from ember.protocols.neutral import ChatPrompt, ModelInfo, TextPrompt
from ember.protocols.openai_chat import read_messages, read_template_options
from ember.protocols.openai_common import check_model
from ember.protocols.thinking import read_preserve_thinking
from ember.protocols.unknown_fields import reads_fields


@dataclass(slots=True)
class TokenizeJob:
    prompt: ChatPrompt | TextPrompt
    return_token_strs: bool


@reads_fields
def parse_tokenize(body: Any, model: ModelInfo) -> TokenizeJob:
    f = Fields(body)
    check_model(f, model)
    return_token_strs = f.boolean("return_token_strs", False)
    if f.has("prompt") and f.has("messages"):
        raise InvalidRequest("send prompt or messages, not both", param="messages")
    if f.has("prompt"):
        prompt = TextPrompt(f.string("prompt"), add_special_tokens=f.boolean("add_special_tokens", True))
        return TokenizeJob(prompt, return_token_strs)
    if not f.has("messages"):
        raise InvalidRequest("prompt or messages is required", param="prompt")
    if f.boolean("add_special_tokens", False):
        raise unsupported("add_special_tokens", "with messages the chat template writes the special tokens; "
                                                "add_special_tokens must be false")
    if f.has("tools"):
        raise unsupported("tools", "/tokenize counts messages only; tools are not rendered here")
    # breakpoints mean nothing here; their fields are read all the same
    messages = read_messages(f, read_openai_cache_options(f), model)
    template_kwargs, add_generation_prompt = read_template_options(f)
    preserve_thinking = read_preserve_thinking(f, template_kwargs, model.chat.preserve_thinking)
    prompt = ChatPrompt(messages, template_kwargs, add_generation_prompt=add_generation_prompt,
                        preserve_thinking=preserve_thinking)
    return TokenizeJob(prompt, return_token_strs)


def render_tokenize(job: TokenizeJob, token_ids: list[int], model: ModelInfo, token_strs: list[str]) -> dict:
    body: dict[str, Any] = {"count": len(token_ids), "max_model_len": model.max_model_len, "tokens": token_ids}
    if job.return_token_strs:
        body["token_strs"] = token_strs
    return body


@reads_fields
def parse_detokenize(body: Any, model: ModelInfo) -> list[int]:
    f = Fields(body)
    check_model(f, model)
    tokens = f.array("tokens")
    if tokens is None:
        raise InvalidRequest("tokens is required", param="tokens")
    return [as_integer(t, f"tokens[{i}]", low=0, high=model.vocab_size - 1) for i, t in enumerate(tokens)]


def render_detokenize(text: str) -> dict:
    return {"prompt": text}
