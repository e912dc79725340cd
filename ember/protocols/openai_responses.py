"""OpenAI Responses: validate a create request into the neutral form (a chat prompt built from typed
input items, tools and thinking options); render the reply's events as output items, whole or as the
Responses SSE lifecycle.

State lives outside this module: a `ResponsesContext` gives the stored conversation of a
previous_response_id, saves finished responses, and holds the seal for encrypted reasoning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ember.constraint_spec import GrammarSpec
from ember.errors import EmberError, InvalidRequest
from ember.parsers.events import (
    TEXT_EVENTS, ContentText, ReasoningText, ReplyEvent, ToolCall, ToolCallDelta, ToolCallStart, streamed_call,
)
from ember.protocols.chat_reply import ChatOptions, read_template_kwargs, read_thinking_budget, template_tools
from ember.protocols.errors import OPENAI_ERRORS, unsupported
from ember.protocols.fields import Fields, as_string
from ember.protocols.neutral import (
    ChatPrompt, ChoiceResult, Dialect, GenerationRequest, ModelInfo, ResponseMeta, RunResult, build_sampling_params,
    reply_token_fields,
)
from ember.protocols.chat_reply import REASONING_EFFORTS, ChatFeatures
from ember.protocols.cache_hints import collect_breakpoints, openai_writes, read_openai_cache_options
from ember.protocols.thinking import read_preserve_thinking, settle_thinking
from ember.protocols.openai_common import check_model, read_shared_sampling
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.protocols.sampling_fields import read_max_tokens, read_priority, read_single_choice
from ember.protocols.responses_items import new_item_id, read_input, to_messages
from ember.protocols.responses_tools import ToolRef, read_tool_choice, read_tools, unwrap_call
from ember.protocols.structured import check_grammar_with_tools, read_flat_format
from ember.protocols.sse import ServerEvent
from ember.types import FinishReason, GenerationOutput
from ember.protocols.unknown_fields import reads_fields

ENCRYPTED_REASONING = "reasoning.encrypted_content"
MAX_METADATA = 16
# Create fields ember understands and cannot honour, and what to say.
_REFUSED = {
    "conversation": "conversations are not supported; continue with previous_response_id",
    "prompt": "prompt templates are not supported; send instructions and input",
    "context_management": "context management (compaction) is not supported",
}


@dataclass(slots=True)
class ResponsesContext:
    """What the dialect needs from the server: stored conversations and the reasoning seal."""

    seal: ReasoningSeal
    history_of: Callable[[str], tuple[dict[str, Any], ...] | None]  # a stored response's conversation
    save: Callable[[dict[str, Any], "ResponseSpec", tuple[dict[str, Any], ...]], None]  # may raise a 400
    check_size: Callable[[tuple[dict[str, Any], ...]], None] = lambda items: None  # refuses what cannot be stored
    preserve_thinking_of: Callable[[str], bool | None] = lambda response_id: None  # a stored response's setting


@dataclass(slots=True)
class ResponseSpec:
    """The Responses-only parts of a create request."""

    input_items: list[dict[str, Any]]  # normalized
    history: tuple[dict[str, Any], ...] = ()  # the previous response's conversation
    store: bool = True
    include_encrypted: bool = False
    refs: dict[str, ToolRef] = field(default_factory=dict)  # the model's tool names -> the client's tools
    echo: dict[str, Any] = field(default_factory=dict)  # settings the response object repeats


@dataclass(slots=True)
class ResponsesRequest(GenerationRequest):
    spec: ResponseSpec | None = None


# ---- validation -----------------------------------------------------------------------------------

@reads_fields
def parse_responses(body: Any, model: ModelInfo, context: ResponsesContext) -> ResponsesRequest:
    f = Fields(body)
    check_model(f, model)
    refuse_unsupported(f)
    include_encrypted = read_include(f)
    instructions = f.string("instructions")
    previous = f.string("previous_response_id", non_empty=True)
    history: tuple[dict[str, Any], ...] = ()
    if previous is not None:
        stored = context.history_of(previous)
        if stored is None:
            raise InvalidRequest(f"previous_response_id '{previous}' is not a stored response: it was never stored "
                                 "(store: false), was deleted, was evicted, or the server restarted",
                                 param="previous_response_id", code="previous_response_not_found")
        history = stored
    input_items = read_input(f.raw("input"), context.seal)
    if not input_items and not history:
        raise InvalidRequest("input is required: a string or an array of items", param="input")
    store = f.boolean("store", True)
    if store:
        context.check_size(history + tuple(input_items))

    tools = read_tools(f)
    if tools.specs and model.chat.tool_format is None:
        raise unsupported("tools", "tool calling is turned off on this server (--tool-call-parser none)")
    choice, callable_tools, echo_choice = read_tool_choice(f, tools)
    text_echo, grammar = read_text(f)
    check_grammar_with_tools(grammar, choice, "tool_choice")
    parallel = f.boolean("parallel_tool_calls", True)
    template_kwargs = read_template_kwargs(f, reserved=("add_generation_prompt", "continue_final_message"))
    reasoning_echo, thinking, effort = read_reasoning(f, template_kwargs, model.chat)
    parent_preserves = context.preserve_thinking_of(previous) if previous is not None else None
    preserve = read_preserve_thinking(f, template_kwargs, model.chat.preserve_thinking if parent_preserves is None
                                      else parent_preserves)
    options = ChatOptions(tools=tuple(callable_tools), tool_choice=choice, parallel_tool_calls=parallel,
                          thinking=thinking, thinking_budget=read_thinking_budget(f), reasoning_effort=effort)

    paths = [None] * len(history) + ["input" if isinstance(f.raw("input"), str) else f"input[{i}]"
                                     for i in range(len(input_items))]
    cache_options = read_openai_cache_options(f)
    messages = to_messages(history + tuple(input_items), paths, instructions, cache_options.ttl_s)
    breakpoints = openai_writes(collect_breakpoints(messages), cache_options)
    prompt = ChatPrompt(messages, template_kwargs, template_tools(options.tools) if options.calls_tools else None,
                        cache_breakpoints=breakpoints, preserve_thinking=preserve)
    params = read_sampling(f, model)
    read_single_choice(f, "a response")
    stream = f.boolean("stream", False)
    return_token_ids = f.boolean("return_token_ids", False)
    echo = {
        "instructions": instructions, "max_output_tokens": params.max_tokens,
        "max_tool_calls": f.integer("max_tool_calls", low=0), "metadata": read_metadata(f),
        "parallel_tool_calls": parallel, "previous_response_id": previous,
        "prompt_cache_key": f.string("prompt_cache_key"), "reasoning": reasoning_echo,
        "safety_identifier": f.string("safety_identifier"), "service_tier": read_service_tier(f), "store": store,
        "temperature": params.temperature, "text": text_echo, "tool_choice": echo_choice, "tools": tools.echo,
        "top_logprobs": 0, "top_p": params.top_p, "truncation": "disabled", "user": f.string("user"),
        "preserve_thinking": preserve,
    }
    f.object("stream_options")
    f.object("client_metadata")
    spec = ResponseSpec(input_items, history, store, include_encrypted, tools.refs, echo)
    return ResponsesRequest(prompt, params, stream=stream, prompt_param="input", chat=options, grammar=grammar,
                            return_token_ids=return_token_ids, spec=spec)


def refuse_unsupported(f: Fields) -> None:
    if f.boolean("background", False):
        raise unsupported("background", "background responses are not supported: ember answers while the "
                                        "request is open; send background: false")
    for name, reason in _REFUSED.items():
        if f.has(name):
            raise unsupported(name, reason)
    truncation = f.string("truncation", "disabled", choices=("auto", "disabled"))
    if truncation == "auto":
        raise unsupported("truncation", "truncation 'auto' would drop input items silently; ember refuses a "
                                        "conversation that does not fit instead (send 'disabled')")
    if f.integer("top_logprobs", 0, low=0, high=20):
        raise unsupported("top_logprobs", "log probabilities are not available on the Responses route; use "
                                          "/v1/chat/completions with logprobs")


def read_include(f: Fields) -> bool:
    """Whether encrypted reasoning is asked for. Log probabilities are refused by name; any other
    value names something ember's responses do not carry, and is ignored."""
    values = [as_string(value, f"include[{i}]") for i, value in enumerate(f.array("include") or [])]
    for i, value in enumerate(values):
        if "logprobs" in value:
            raise unsupported(f"include[{i}]", f"include '{value}' cannot be given: log probabilities are not "
                                               "available on the Responses route; use /v1/chat/completions with "
                                               "logprobs")
    return ENCRYPTED_REASONING in values


def read_reasoning(f: Fields, template_kwargs: dict[str, Any],
                   features: ChatFeatures) -> tuple[dict[str, Any], bool | None, str | None]:
    """(the reasoning object the response repeats, thinking on/off or None, the effort). The
    template's switch may also come from chat_template_kwargs.enable_thinking; a contradiction
    with reasoning.effort is refused, and so is an effort the template does not offer. The
    server's defaults apply to what the request leaves open."""
    thinking = template_kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise InvalidRequest("chat_template_kwargs.enable_thinking must be true or false",
                             param="chat_template_kwargs.enable_thinking")
    reasoning = f.object("reasoning")
    effort = summary = None
    if reasoning is not None:
        effort = reasoning.string("effort", choices=REASONING_EFFORTS)
        summary = reasoning.string("summary", choices=("auto", "concise", "detailed"))
        reasoning.string("generate_summary", choices=("auto", "concise", "detailed"))
    effort_param = "reasoning.effort"
    if effort is None and template_kwargs.get("reasoning_effort") is not None:
        effort_param = "chat_template_kwargs.reasoning_effort"
        effort = Fields(template_kwargs, "chat_template_kwargs").string("reasoning_effort", choices=REASONING_EFFORTS)
    if effort is not None:
        wants_thinking = effort != "none"
        if thinking is not None and thinking != wants_thinking:
            raise InvalidRequest(f"{effort_param} '{effort}' contradicts chat_template_kwargs.enable_thinking "
                                 f"{str(thinking).lower()}", param=effort_param, code="conflicting_template_option")
        thinking = wants_thinking
    thinking, settled = settle_thinking(thinking, effort, effort_param, features, template_kwargs)
    return {"effort": settled, "summary": summary}, thinking, settled


def read_text(f: Fields) -> tuple[dict[str, Any], GrammarSpec | None]:
    """(the text object the response repeats: its format as sent, the structured output it asks for)."""
    text = f.object("text")
    echo: dict[str, Any] = {"format": {"type": "text"}}
    if text is None:
        return echo, None
    fmt = text.object("format")
    grammar = None
    if fmt is not None:
        grammar = read_flat_format(fmt)
        echo["format"] = dict(fmt.obj)
    verbosity = text.string("verbosity", choices=("low", "medium", "high"))
    if verbosity is not None:
        echo["verbosity"] = verbosity
    return echo, grammar


def read_metadata(f: Fields) -> dict[str, str]:
    metadata = f.object("metadata")
    if metadata is None:
        return {}
    if len(metadata.obj) > MAX_METADATA:
        raise InvalidRequest(f"metadata holds {len(metadata.obj)} pairs; at most {MAX_METADATA} are allowed",
                             param="metadata")
    for key, value in metadata.obj.items():
        if len(key) > 64:
            raise InvalidRequest(f"metadata key '{key[:20]}...' is {len(key)} characters; at most 64 are allowed",
                                 param="metadata")
        if metadata.string(key) is None:
            raise InvalidRequest(f"metadata.{key} must be a string, not null", param=metadata.at(key))
        if len(value) > 512:
            raise InvalidRequest(f"metadata.{key} is {len(value)} characters; at most 512 are allowed",
                                 param=metadata.at(key))
    return dict(metadata.obj)


def read_service_tier(f: Fields) -> str:
    """Accepted whatever tier is asked for: this server has one, which the response reports."""
    f.string("service_tier")
    return "default"


def read_sampling(f: Fields, model: ModelInfo):
    values: dict[str, Any] = dict(model.sampling_defaults)
    values["max_tokens"], max_tokens_param = read_max_tokens(
        f, ("max_output_tokens", "max_tokens", "max_completion_tokens"))
    names = read_shared_sampling(f, values)
    values["ignore_eos"] = f.boolean("ignore_eos", False)
    values["priority"] = read_priority(f)
    return build_sampling_params(values, {"max_tokens": max_tokens_param, **names})


# ---- output items ---------------------------------------------------------------------------------

@dataclass(slots=True)
class OutputItem:
    """One output item as it grows: its kind, stable id and index, and its text."""

    kind: str  # reasoning | message | function_call | custom_tool_call
    id: str
    index: int
    text: str = ""  # reasoning or answer text; a call's arguments or input
    call_id: str = ""
    ref: ToolRef | None = None
    sealed: str | None = None  # encrypted_content, once done
    status: str = "in_progress"

    @property
    def has_part(self) -> bool:
        return self.kind in ("reasoning", "message")

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self, status: str, include_encrypted: bool = False) -> dict[str, Any]:
        """The item as it stands: `in_progress` when added (empty text), else completed or incomplete."""
        done = status != "in_progress"
        if self.kind == "reasoning":
            item = {"id": self.id, "type": "reasoning", "summary": [],
                    "content": [self.part(self.text)] if done else []}
            if include_encrypted:
                item["encrypted_content"] = self.sealed if done else None
            return item
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": [self.part(self.text)] if done else []}
        text = self.text if done else ""
        item = {"id": self.id, "type": self.kind, "call_id": self.call_id, "name": self.ref.name}
        if self.kind == "function_call":
            item.update(arguments=text, status=status)
        else:
            item["input"] = text
        if self.ref.namespace is not None:
            item["namespace"] = self.ref.namespace
        return item


class ResponsesRenderer:
    """Builds the output items from the reply's events; as a stream, every event carries `event:`
    and a `sequence_number` that rises by one from 0."""

    def __init__(self, request: ResponsesRequest, result: RunResult, meta: ResponseMeta,
                 context: ResponsesContext) -> None:
        self.request = request
        self.spec = request.spec
        self.result = result
        self.meta = meta
        self.context = context
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.sequence = 0

    # ---- events -----------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> ServerEvent:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return ServerEvent(data, event=kind)

    def on_reply(self, reply_event: ReplyEvent) -> list[ServerEvent]:
        if isinstance(reply_event, ToolCallStart):
            return self.close_open("completed") + self.start_call(reply_event)
        if isinstance(reply_event, ToolCallDelta):
            item = self.items[-1]
            if item.kind == "custom_tool_call":
                return []  # its input is the string inside the arguments: given once the call ends
            item.text += reply_event.arguments
            return [self.event("response.function_call_arguments.delta", item_id=item.id, output_index=item.index,
                               delta=reply_event.arguments)]
        if isinstance(reply_event, ToolCall):
            return self.end_call(reply_event)
        kind = "reasoning" if isinstance(reply_event, ReasoningText) else "message"
        events = []
        if self.open is None or self.open.kind != kind:
            events += self.close_open("completed")
            self.open = OutputItem(kind, new_item_id(kind), len(self.items))
            self.items.append(self.open)
            events.append(self.event("response.output_item.added", output_index=self.open.index,
                                     item=self.open.body("in_progress", self.spec.include_encrypted)))
            events.append(self.event("response.content_part.added", item_id=self.open.id,
                                     output_index=self.open.index, content_index=0, part=self.open.part("")))
        item = self.open
        item.text += reply_event.text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(delta, item_id=item.id, output_index=item.index, content_index=0,
                                 delta=reply_event.text, **extra))
        return events

    def start_call(self, call: ToolCallStart) -> list[ServerEvent]:
        ref = self.spec.refs.get(call.name) or ToolRef("function", call.name)
        kind = "custom_tool_call" if ref.kind == "custom" else "function_call"
        item = OutputItem(kind, new_item_id(kind), len(self.items), call_id=call.id, ref=ref)
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=item.index, item=item.body("in_progress"))]

    def end_call(self, call: ToolCall) -> list[ServerEvent]:
        """A call cut short or malformed ends `incomplete`, its arguments as far as they were written."""
        item = self.items[-1]
        item.status = "completed" if call.complete else "incomplete"
        events = []
        if item.kind == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                     output_index=item.index, name=item.ref.name, arguments=item.text))
        else:
            item.text = unwrap_call(item.ref, call.arguments)
            events.append(self.event("response.custom_tool_call_input.delta", item_id=item.id,
                                     output_index=item.index, delta=item.text))
            events.append(self.event("response.custom_tool_call_input.done", item_id=item.id,
                                     output_index=item.index, input=item.text))
        events.append(self.event("response.output_item.done", output_index=item.index,
                                 item=item.body(item.status)))
        return events

    def close_open(self, status: str) -> list[ServerEvent]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        if item.kind == "reasoning" and self.spec.include_encrypted:
            item.sealed = self.context.seal.seal(item.text)
        if item.kind == "reasoning":
            done = self.event("response.reasoning_text.done", item_id=item.id, output_index=item.index,
                              content_index=0, text=item.text)
        else:
            done = self.event("response.output_text.done", item_id=item.id, output_index=item.index,
                              content_index=0, text=item.text, logprobs=[])
        return [done,
                self.event("response.content_part.done", item_id=item.id, output_index=item.index,
                           content_index=0, part=item.part(item.text)),
                self.event("response.output_item.done", output_index=item.index,
                           item=item.body(status, self.spec.include_encrypted))]

    # ---- the response object ----------------------------------------------------------------------

    def status(self) -> str:
        choice = self.result.choices[0]
        if choice.finish_reason == FinishReason.LENGTH and not choice.reply.calls_complete:
            return "incomplete"  # whole calls count even when text after them ran out of tokens
        return "completed"

    def response_object(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        final = status != "in_progress"
        body: dict[str, Any] = {
            "id": self.meta.response_id, "object": "response", "created_at": self.meta.created,
            "status": status, "background": False, "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.meta.model,
            "output": [item.body(item.status, self.spec.include_encrypted) for item in self.items] if final else [],
            **self.spec.echo,
            "usage": self.usage() if final else None,
        }
        if final:
            body.update(reply_token_fields(self.request, self.result))
        return body

    @staticmethod
    def item_status(status: str) -> str:
        return "incomplete" if status in ("incomplete", "failed") else "completed"

    def usage(self) -> dict[str, Any]:
        result = self.result
        prompt, completion = result.num_prompt_tokens, result.num_completion_tokens
        cached = result.num_cached_tokens
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": max(prompt - cached, 0)},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": result.num_reasoning_tokens or 0},
                "total_tokens": prompt + completion, **result.speculative_usage()}

    def finish(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The final object; stored (before the client sees it) when the request asked for it."""
        body = self.response_object(status, error)
        if self.spec.store:
            history = self.spec.history + tuple(self.spec.input_items) + tuple(
                item.body(item.status) for item in self.items)
            self.context.save(body, self.spec, history)
        return body

    # ---- Renderer ---------------------------------------------------------------------------------

    def stream_start(self) -> list[ServerEvent]:
        return [self.event("response.created", response=self.response_object("in_progress")),
                self.event("response.in_progress", response=self.response_object("in_progress"))]

    def stream_output(self, choice: ChoiceResult, output: GenerationOutput) -> list[ServerEvent]:
        events: list[ServerEvent] = []
        for reply_event in choice.events:
            events += self.on_reply(reply_event)
        return events

    def stream_end(self) -> list[ServerEvent]:
        status = self.status()
        events = self.close_open(self.item_status(status))
        try:
            body = self.finish(status)
        except EmberError as exc:
            return events + self.failed(exc)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self.event(kind, response=body)]

    def stream_error(self, error: EmberError) -> list[ServerEvent]:
        for item in self.items:
            if item.status == "in_progress":
                item.status = "incomplete"  # a call the failure cut short
        return self.close_open("incomplete") + self.failed(error)

    def failed(self, error: EmberError) -> list[ServerEvent]:
        """An `error` event, then `response.failed` with the final object."""
        detail = {"code": "server_error", "message": error.message}
        notice = self.event("error", code=error.code or error.type, message=error.message, param=error.param)
        try:
            body = self.finish("failed", detail)
        except EmberError:
            body = self.response_object("failed", detail)
        return [notice, self.event("response.failed", response=body)]

    def response(self) -> dict[str, Any]:
        reply = self.result.choices[0].reply
        events: list[ReplyEvent] = [ReasoningText(reply.reasoning), ContentText(reply.content)]
        for call in reply.tool_calls:
            events += streamed_call(call)
        for reply_event in events:
            if isinstance(reply_event, TEXT_EVENTS) and not reply_event.text:
                continue
            self.on_reply(reply_event)
        status = self.status()
        self.close_open(self.item_status(status))
        return self.finish(status)


def responses_dialect(context: ResponsesContext) -> Dialect:
    return Dialect(name="responses", id_prefix="resp_",
                   parse=lambda body, model: parse_responses(body, model, context),
                   renderer=lambda request, result, meta: ResponsesRenderer(request, result, meta, context),
                   errors=OPENAI_ERRORS)
