"""Ollama's /api/generate: validate a request into the neutral form (rendered by ollama_render).

    prompt       the user's text, put through the model's chat template after `system` (when the model
                 has no template, or with raw: true, the text goes to the model as it is)
    images       base64 strings, placed before the prompt (not with raw: true)
    format, options, think    ollama_options; stream, keep_alive: ollama_common
    refused      suffix (ember has no fill-in-the-middle), template (ember renders the model's own
                 template; send raw: true with a formatted prompt), context (send the conversation
                 to /api/chat instead)
An empty or absent `prompt` asks only for the model to be loaded: the route answers that.
"""

from __future__ import annotations

from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.chat_reply import ChatOptions
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields
from ember.protocols.neutral import ChatPrompt, Dialect, GenerationRequest, ModelInfo, TextPrompt
from ember.protocols.ollama_chat import read_images
from ember.protocols.ollama_common import OLLAMA_ERRORS, read_keep_alive, read_model, read_stream
from ember.protocols.ollama_options import read_format, read_options, read_think, refuse_logprobs
from ember.protocols.ollama_render import GenerateRenderer, OllamaReply
from ember.protocols.stream_format import NDJSON
from ember.protocols.unknown_fields import reads_fields
from ember.tokenization.message_content import build_content, image_part

REFUSED = {
    "suffix": "ember has no fill-in-the-middle; send the text before the gap as the prompt",
    "template": "ember renders the model's own chat template; send raw: true with the prompt formatted instead",
}


@reads_fields
def parse_generate(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    label = read_model(f, model)
    for name, reason in REFUSED.items():
        if f.string(name):
            raise unsupported(name, f"{name} is not supported: {reason}")
    if f.array("context"):
        raise unsupported("context", "context is not supported: send the conversation to /api/chat instead")
    text = f.string("prompt", "")
    system = f.string("system")
    images = read_images(f)
    raw = f.boolean("raw", False) or not model.has_chat_template
    if raw and images:
        raise InvalidRequest("images cannot be sent with raw: true; ember places them through the chat template",
                             param="images")
    if raw and system:
        raise InvalidRequest("system cannot be sent with raw: true: the prompt goes to the model as it is",
                             param="system")
    grammar = read_format(f)
    template_kwargs: dict[str, Any] = {}
    chat = None
    if raw:
        if f.has("think"):
            raise InvalidRequest("think cannot be sent with raw: true: thinking is switched through the chat "
                                 "template", param="think")
        prompt: Any = TextPrompt(text)
        thinking = None
    else:
        thinking, effort = read_think(f, model.chat, template_kwargs)
        chat = ChatOptions(thinking=thinking, reasoning_effort=effort, thinking_budget_param="think")
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": build_content([*map(image_part, images), text])})
        prompt = ChatPrompt(messages, template_kwargs, preserve_thinking=model.chat.preserve_thinking)
    params = read_options(f, model, thinking)
    refuse_logprobs(f)
    keep_alive = read_keep_alive(f)
    return GenerationRequest(prompt, params, stream=read_stream(f), prompt_param="prompt", chat=chat,
                             grammar=grammar, dialect_options=OllamaReply(label), keep_alive=keep_alive)


GENERATE = Dialect(name="ollama_generate", id_prefix="ollama-", parse=parse_generate, renderer=GenerateRenderer,
                   errors=OLLAMA_ERRORS, stream_format=NDJSON)
