"""Ollama's /api/chat: validate a request into the neutral form (rendered by ollama_render).

    model        required; the served id or an alias (NAME:latest too)
    messages     [{role: system | user | assistant | tool, content, images?, thinking?, tool_calls?,
                  tool_name?}]; images are base64 strings, placed before the message's text;
                 an assistant's tool_calls carry `function.arguments` as an object
    tools        [{type: function, function: {name, description, parameters}}]; the model calls them
                 when it chooses (Ollama has no tool_choice)
    format, options, think    ollama_options
    stream       true unless false; keep_alive: ollama_common
An empty `messages` asks only for the model to be loaded: the route answers that (ollama_routes).
"""

from __future__ import annotations

from typing import Any

from ember.errors import InvalidRequest
from ember.parsers.events import ToolSpec
from ember.protocols.chat_reply import (
    AUTO, NONE, ChatOptions, called_function, declare_tool, function_tool, template_tools, tool_items, tool_name,
    tool_schema,
)
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields, as_string, json_type
from ember.protocols.image_parts import misplaced_image
from ember.protocols.neutral import ChatPrompt, Dialect, GenerationRequest, ModelInfo
from ember.protocols.ollama_common import OLLAMA_ERRORS, read_keep_alive, read_model, read_stream
from ember.protocols.ollama_options import read_format, read_options, read_think, refuse_logprobs
from ember.protocols.ollama_render import ChatRenderer, OllamaReply
from ember.protocols.stream_format import NDJSON
from ember.protocols.structured import check_grammar_with_tools
from ember.protocols.unknown_fields import reads_fields
from ember.media.sources import BASE64, ImageRef
from ember.tokenization.message_content import build_content, image_part

ROLES = ("system", "user", "assistant", "tool")
IMAGE_ROLES = ("user", "tool")


@reads_fields
def parse_chat(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    label = read_model(f, model)
    messages = read_messages(f, model)
    tools = read_tools(f)
    if tools and model.chat.tool_format is None:
        raise unsupported("tools", "tool calling is turned off on this server (--tool-call-parser none)")
    grammar = read_format(f)
    choice = AUTO if tools else NONE
    check_grammar_with_tools(grammar, choice)
    template_kwargs: dict[str, Any] = {}
    thinking, effort = read_think(f, model.chat, template_kwargs)
    options = ChatOptions(tools=tuple(tools), tool_choice=choice, thinking=thinking, reasoning_effort=effort,
                          thinking_budget_param="think")
    params = read_options(f, model, thinking)
    refuse_logprobs(f)
    keep_alive = read_keep_alive(f)
    prompt = ChatPrompt(messages, template_kwargs, template_tools(tools) if tools else None,
                        preserve_thinking=model.chat.preserve_thinking)
    return GenerationRequest(prompt, params, stream=read_stream(f), prompt_param="messages", chat=options,
                             grammar=grammar, dialect_options=OllamaReply(label), keep_alive=keep_alive)


def read_messages(f: Fields, model: ModelInfo) -> list[dict[str, Any]]:
    items = f.array("messages", non_empty=True)
    if items is None:
        raise InvalidRequest("messages is required: a non-empty array of messages", param="messages")
    model.check_message_count(len(items), "messages")
    return [read_message(Fields(item, f"messages[{i}]")) for i, item in enumerate(items)]


def read_message(m: Fields) -> dict[str, Any]:
    role = m.string("role", choices=ROLES)
    if role is None:
        raise InvalidRequest(f"{m.path_of('role')} is required", param=m.path_of("role"))
    content = m.string("content", "")
    images = read_images(m, role)
    message: dict[str, Any] = {"role": role, "content": build_content([*map(image_part, images), content])}
    if role == "assistant":
        thinking = m.string("thinking")
        if thinking:
            message["reasoning_content"] = thinking
        calls = read_tool_calls(m)
        if calls:
            message["tool_calls"] = calls
    if role == "tool":
        name = m.string("tool_name")
        if name is not None:
            message["name"] = name
    return message


def read_images(holder: Fields, role: str | None = None) -> list[ImageRef]:
    """`images`: base64 strings (no data: prefix), each read later by the media path."""
    items = holder.array("images")
    if not items:
        return []
    path = holder.path_of("images")
    if role is not None and role not in IMAGE_ROLES:
        raise misplaced_image(path, role)
    return [ImageRef(BASE64, as_string(item, f"{path}[{k}]", non_empty=True), f"{path}[{k}]")
            for k, item in enumerate(items)]


def read_tool_calls(m: Fields) -> list[dict[str, Any]]:
    calls = []
    for k, raw in enumerate(m.array("tool_calls") or []):
        call = Fields(raw, m.path_of("tool_calls") + f"[{k}]")
        function, name = called_function(call)
        arguments = function.raw("arguments", {})
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"{function.path_of('arguments')} must be an object, not {json_type(arguments)}",
                                 param=function.path_of("arguments"))
        function.integer("index")
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        call_id = call.string("id")
        if call_id is not None:
            entry["id"] = call_id
        calls.append(entry)
    return calls


def read_tools(f: Fields) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for i, raw in enumerate(tool_items(f)):
        function = function_tool(Fields(raw, f"tools[{i}]"))
        spec = ToolSpec(tool_name(function), tool_schema(function, "parameters", {}), function.string("description"))
        declare_tool(specs, spec, function)
    return specs


CHAT = Dialect(name="ollama_chat", id_prefix="ollama-", parse=parse_chat, renderer=ChatRenderer, errors=OLLAMA_ERRORS,
               stream_format=NDJSON)
