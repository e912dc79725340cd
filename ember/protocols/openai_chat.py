"""OpenAI Chat Completions: validate a request into the neutral form; render results and chunks."""

from __future__ import annotations

import json
from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.errors import OPENAI_ERRORS, unsupported
from ember.protocols.cache_hints import (
    OpenAICacheOptions, collect_breakpoints, mark, openai_writes, read_openai_breakpoint, read_openai_cache_options,
)
from ember.protocols.fields import Fields, as_string, json_type
from ember.protocols.image_parts import misplaced_image, read_chat_image
from ember.protocols.chat_reply import called_function, read_template_kwargs, template_tools
from ember.protocols.neutral import ChatPrompt, ChoiceResult, Dialect, GenerationRequest, ModelInfo, weight_versions
from ember.protocols.openai_chat_options import read_chat_options
from ember.protocols.output_hints import read_chat_verbosity, refuse_chat_store, refuse_other_prompt_field
from ember.protocols.openai_common import (
    MAX_TOP_LOGPROBS, OpenAIRenderer, chat_logprobs, check_model, finish_reason, read_accepted, read_choices,
    read_sampling, read_stream,
)
from ember.protocols.structured import check_grammar_with_tools, read_openai_structured
from ember.protocols.thinking import read_preserve_thinking
from ember.protocols.progress import read_stream_extras
from ember.parsers.events import ContentText, ReasoningText, ToolCallDelta, ToolCallStart
from ember.protocols.sse import ServerEvent
from ember.types import FinishReason, GenerationOutput
from ember.protocols.unknown_fields import reads_fields
from ember.tokenization.message_content import build_content, content_length, image_part

# Wire role -> the role the chat template sees. Templates rarely know `developer`; it is a system turn.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool", "function": "tool"}
IMAGE_ROLES = ("user", "tool")  # the template roles whose messages may hold images
# Content parts ember cannot read (Responses' input_image included: Chat sends images as image_url).
MEDIA_PARTS = ("input_image", "input_audio", "audio_url", "video_url", "file", "input_file")


@reads_fields
def parse_chat(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    check_model(f, model)
    refuse_other_prompt_field(f, "prompt", "/v1/completions", "messages")
    cache_options = read_openai_cache_options(f)
    messages = read_messages(f, cache_options, model)
    breakpoints = openai_writes(collect_breakpoints(messages), cache_options)
    grammar = read_openai_structured(f)
    refuse_unsupported_outputs(f)
    template_kwargs, add_generation_prompt = read_template_options(f)
    options = read_chat_options(f, template_kwargs, model)
    preserve_thinking = read_preserve_thinking(f, template_kwargs, model.chat.preserve_thinking)
    check_grammar_with_tools(grammar, options.tool_choice)
    logprobs = read_logprobs(f)
    params = read_sampling(f, model, logprobs=logprobs, rename={"logprobs": "top_logprobs"}, thinking=options.thinking)
    n = read_choices(f)
    stream, include_usage = read_stream(f)
    return_token_ids = f.boolean("return_token_ids", False)
    return_progress, timings_per_token = read_stream_extras(f)
    read_accepted(f)
    tools = template_tools(options.tools) if options.calls_tools else None
    prompt = ChatPrompt(messages, template_kwargs, tools, add_generation_prompt, cache_breakpoints=breakpoints,
                        preserve_thinking=preserve_thinking)
    return GenerationRequest(prompt, params, n=n, stream=stream, include_usage=include_usage,
                             return_token_ids=return_token_ids, return_progress=return_progress,
                             timings_per_token=timings_per_token, prompt_param="messages", chat=options,
                             grammar=grammar, session=cache_options.key)


def read_messages(f: Fields, cache_options: OpenAICacheOptions, model: ModelInfo) -> list[dict[str, Any]]:
    items = f.array("messages", non_empty=True)
    if items is None:
        raise InvalidRequest("messages is required: a non-empty array of messages", param="messages")
    model.check_message_count(len(items), "messages")
    return [read_message(Fields(item, f"messages[{i}]"), cache_options) for i, item in enumerate(items)]


def read_message(m: Fields, cache_options: OpenAICacheOptions) -> dict[str, Any]:
    role = m.string("role")
    if role is None:
        raise InvalidRequest(f"{m.path_of('role')} is required", param=m.path_of("role"))
    if role not in ROLES:
        raise InvalidRequest(f"{m.path_of('role')} must be one of {', '.join(ROLES)}; got '{role}'",
                             param=m.path_of("role"))
    content, cuts = read_content(m, role)
    message: dict[str, Any] = {"role": ROLES[role], "content": content}
    for cut in cuts:
        mark(message, cut, cache_options.ttl_s)
    name = m.string("name")
    if name is not None:
        message["name"] = name
    if role == "assistant":
        tool_calls = read_tool_calls(m)
        if tool_calls:
            message["tool_calls"] = tool_calls
        reasoning = m.string("reasoning_content")
        reasoning = reasoning if reasoning is not None else m.string("reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning
    if message["role"] == "tool":
        call_id = m.string("tool_call_id")
        if call_id is not None:
            message["tool_call_id"] = call_id
    return message


def read_content(m: Fields, role: str) -> tuple[Any, list[int]]:
    """A string, or text parts joined in order with nothing added between them (a list of text and
    image parts when it holds an image: tokenization.message_content); and where the parts that
    carry a prompt_cache_breakpoint end in it."""
    content = m.raw("content")
    path = m.path_of("content")
    if content is None:
        if role == "assistant":
            return "", []
        raise InvalidRequest(f"{path} is required for a {role} message", param=path)
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise InvalidRequest(f"{path} must be a string or an array of content parts, not {json_type(content)}",
                             param=path)
    pieces: list[Any] = []
    cuts = []
    for j, raw in enumerate(content):
        part = Fields(raw, f"{path}[{j}]")
        kind = part.string("type")
        if kind == "image_url":
            if ROLES[role] not in IMAGE_ROLES:
                raise misplaced_image(part.path, role)
            pieces.append(image_part(read_chat_image(part)))
        elif kind in MEDIA_PARTS:
            raise InvalidRequest(f"{part.path}: {kind} parts cannot be read; ember reads text and image_url parts",
                                 param=part.path, code="unsupported_content")
        elif kind == "text":
            pieces.append(as_string(part.raw("text"), part.path_of("text")))
        elif kind == "refusal" and role == "assistant":
            pieces.append(as_string(part.raw("refusal"), part.path_of("refusal")))
        else:
            raise InvalidRequest(f"{part.path} has type {kind!r}; only text and image_url parts are accepted",
                                 param=part.path)
        if read_openai_breakpoint(part):
            cuts.append(content_length(build_content(pieces)))
    return build_content(pieces), cuts


def read_tool_calls(m: Fields) -> list[dict[str, Any]]:
    """Tool calls in the history go to the template; arguments that are a JSON object become a dict,
    the form most templates expect."""
    calls = m.array("tool_calls")
    if not calls:
        return []
    result = []
    for k, raw in enumerate(calls):
        call = Fields(raw, m.path_of("tool_calls") + f"[{k}]")
        function, name = called_function(call)
        arguments = function.raw("arguments", "{}")
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        elif not isinstance(arguments, dict):
            raise InvalidRequest(f"{function.path_of('arguments')} must be a JSON string",
                                 param=function.path_of("arguments"))
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        call_id = call.string("id")
        if call_id is not None:
            entry["id"] = call_id
        result.append(entry)
    return result


def refuse_unsupported_outputs(f: Fields) -> None:
    """Outputs this server cannot give: refused by name, not ignored."""
    if f.array("functions"):
        raise unsupported("functions", "the legacy functions field is not supported; declare the same "
                                       "functions in tools instead")
    choice = f.raw("function_call")
    if choice is not None and choice not in ("none", "auto"):
        raise unsupported("function_call", "the legacy function_call field is not supported; use tool_choice")
    if f.has("audio"):
        raise unsupported("audio", "audio output is not supported: this model produces text only")
    modalities = f.array("modalities")
    if modalities and any(m != "text" for m in modalities):
        raise unsupported("modalities", "this model produces text only; modalities must be ['text']")
    if f.has("web_search_options"):
        raise unsupported("web_search_options", "web search is not available on this server")
    read_chat_verbosity(f)
    refuse_chat_store(f)


def read_template_options(f: Fields) -> tuple[dict[str, Any], bool]:
    """chat_template_kwargs reach the template; continue_final_message extends the last assistant turn."""
    kwargs = read_template_kwargs(f)
    add_generation_prompt = f.boolean("add_generation_prompt", kwargs.pop("add_generation_prompt", True))
    if not isinstance(add_generation_prompt, bool):
        raise InvalidRequest("add_generation_prompt must be true or false",
                             param="chat_template_kwargs.add_generation_prompt")
    if f.boolean("continue_final_message", False):
        if f.boolean("add_generation_prompt", False):
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                                 param="continue_final_message")
        kwargs["continue_final_message"] = True
        add_generation_prompt = False
    return kwargs, add_generation_prompt


def read_logprobs(f: Fields) -> int | None:
    """None: off; k: the chosen token's logprob plus k alternatives."""
    wanted = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top or 0) if wanted else None


class ChatRenderer(OpenAIRenderer):
    chunk_object = "chat.completion.chunk"

    def stream_start(self) -> list[ServerEvent]:
        extra = {"prompt_token_ids": self.result.prompt_token_ids} if self.request.return_token_ids else {}
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], **(extra if i == 0 else {}))
                for i in range(self.request.n)]

    empty_delta = {"delta": {}}

    def delta_bodies(self, choice: ChoiceResult, output: GenerationOutput, with_logprobs: bool,
                     with_ids: bool) -> list[dict[str, Any]]:
        """One chunk per reply event: reasoning and content deltas, and for a tool call, one chunk with
        its id and name once the name is known, then one per piece of its arguments."""
        deltas: list[dict[str, Any]] = []
        for event in choice.events:
            if isinstance(event, ContentText):
                deltas.append({"content": event.text})
            elif isinstance(event, ReasoningText):
                deltas.append({"reasoning_content": event.text})
            elif isinstance(event, ToolCallStart):
                deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                               "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ToolCallDelta):
                deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
        if not deltas and (with_logprobs or with_ids):
            deltas.append({"content": ""})
        bodies = [{"delta": delta, "logprobs": None} for delta in deltas]
        if bodies and with_logprobs:
            bodies[0]["logprobs"] = {"content": chat_logprobs(output.new_logprobs, self.meta.token_text)}
        return bodies

    def finish_reason(self, choice: ChoiceResult) -> str | None:
        # Whole calls count even when text after them ran into max_tokens: the client can run them. A
        # call cut short (or malformed) leaves the engine's reason, so no client runs half a call.
        if choice.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and choice.reply.calls_complete:
            return "tool_calls"
        return finish_reason(choice.finish_reason)

    def finish_extra(self, choice: ChoiceResult) -> dict[str, Any]:
        return {"matched_stop": choice.matched_stop, **super().finish_extra(choice)}

    def choice_body(self, choice) -> dict[str, Any]:
        logprobs = self.request.params.logprobs is not None
        reply = choice.reply
        message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
        if self.result.plan is not None and self.result.plan.counts_reasoning:
            message["reasoning_content"] = reply.reasoning or None
        if reply.tool_calls:
            message["content"] = reply.content or None
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in reply.tool_calls]
        return {"message": message,
                "logprobs": {"content": chat_logprobs(choice.logprobs, self.meta.token_text)} if logprobs else None}

    def response(self) -> dict[str, Any]:
        """The whole reply, with SGLang's `metadata` (the weights' version) beside usage."""
        body = self.whole_response("chat.completion")
        body["metadata"] = weight_versions(self.result.num_completion_tokens)
        return body


CHAT = Dialect(name="chat", id_prefix="chatcmpl-", parse=parse_chat, renderer=ChatRenderer,
               errors=OPENAI_ERRORS)
