"""OpenAI Responses: validate a create request into the neutral form (a chat prompt built from typed
input items, tools and thinking options). The rendering lives in responses_render.py.

State lives outside this module: a `ResponsesContext` gives the stored conversation of a
previous_response_id, saves finished responses, and holds the seal for encrypted reasoning.
"""

from __future__ import annotations

from typing import Any

from ember.constraint_spec import GrammarSpec
from ember.errors import InvalidRequest
from ember.protocols.cache_hints import collect_breakpoints, openai_writes, read_openai_cache_options
from ember.protocols.chat_reply import (
    REASONING_EFFORTS, ChatFeatures, ChatOptions, read_template_kwargs, read_thinking_budget, template_tools,
)
from ember.protocols.errors import OPENAI_ERRORS, unsupported
from ember.protocols.fields import Fields, as_string
from ember.protocols.neutral import ChatPrompt, Dialect, ModelInfo, build_sampling_params
from ember.protocols.openai_common import check_model, read_shared_sampling
from ember.protocols.output_hints import read_reasoning_summary, read_text_verbosity
from ember.protocols.responses_items import read_input, to_messages
from ember.protocols.responses_render import ResponsesRenderer
from ember.protocols.responses_request import ResponsesContext, ResponseSpec, ResponsesRequest
from ember.protocols.responses_tools import read_tool_choice, read_tools
from ember.protocols.sampling_fields import read_max_tokens, read_priority, read_single_choice
from ember.protocols.structured import check_grammar_with_tools, read_flat_format
from ember.protocols.thinking import read_preserve_thinking, settle_thinking
from ember.protocols.unknown_fields import reads_fields

ENCRYPTED_REASONING = "reasoning.encrypted_content"
MAX_METADATA = 16
# Create fields ember understands and cannot honour, and what to say.
_REFUSED = {
    "conversation": "conversations are not supported; continue with previous_response_id",
    "prompt": "prompt templates are not supported; send instructions and input",
    "context_management": "context management (compaction) is not supported",
}


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
                                 "(store: false), was deleted or evicted, belongs to another API key's tenant, or "
                                 "the server restarted with --response-store memory",
                                 param="previous_response_id", code="previous_response_not_found", status=404)
        history = stored
    raw_input = f.raw("input")
    if isinstance(raw_input, list):
        model.check_message_count(len(raw_input), "input")
    input_items = read_input(raw_input, context.seal)
    if not input_items and not history:
        raise InvalidRequest("input is required: a string or an array of items", param="input")
    store = f.boolean("store", True)
    if store:
        context.check_size(history + tuple(input_items))

    tools = read_tools(f, model.chat.tool_format.name if model.chat.tool_format is not None else None)
    if tools.specs and model.chat.tool_format is None:
        raise unsupported("tools", "tool calling is turned off on this server (--tool-call-parser none)")
    choice, callable_tools, echo_choice = read_tool_choice(f, tools)
    text_echo, grammar = read_text(f)
    check_grammar_with_tools(grammar, choice, "tool_choice")
    parallel = f.boolean("parallel_tool_calls", True)
    template_kwargs = read_template_kwargs(f, reserved=("add_generation_prompt", "continue_final_message"))
    reasoning_echo, thinking, effort, requested_effort = read_reasoning(f, template_kwargs, model.chat)
    parent_preserves = context.preserve_thinking_of(previous) if previous is not None else None
    preserve = read_preserve_thinking(f, template_kwargs, model.chat.preserve_thinking if parent_preserves is None
                                      else parent_preserves)
    options = ChatOptions(tools=tuple(callable_tools), tool_choice=choice, parallel_tool_calls=parallel,
                          thinking=thinking, thinking_budget=read_thinking_budget(f), reasoning_effort=effort,
                          requested_effort=requested_effort)

    paths = [None] * len(history) + ["input" if isinstance(f.raw("input"), str) else f"input[{i}]"
                                     for i in range(len(input_items))]
    cache_options = read_openai_cache_options(f)
    messages = to_messages(history + tuple(input_items), paths, instructions, cache_options.ttl_s)
    breakpoints = openai_writes(collect_breakpoints(messages), cache_options)
    prompt = ChatPrompt(messages, template_kwargs, template_tools(options.tools) if options.calls_tools else None,
                        cache_breakpoints=breakpoints, preserve_thinking=preserve)
    params = read_sampling(f, model, options.thinking)
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
                            return_token_ids=return_token_ids, spec=spec, session=cache_options.key)


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
                   features: ChatFeatures) -> tuple[dict[str, Any], bool | None, str | None, str | None]:
    """(the reasoning object the response repeats, thinking on/off or None, the effort, the effort
    the request named). The
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
        summary = read_reasoning_summary(reasoning)
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
    return {"effort": settled, "summary": summary}, thinking, settled, effort


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
    verbosity = read_text_verbosity(text)
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
            raise InvalidRequest(f"metadata.{key} must be a string, not null", param=metadata.path_of(key))
        if len(value) > 512:
            raise InvalidRequest(f"metadata.{key} is {len(value)} characters; at most 512 are allowed",
                                 param=metadata.path_of(key))
    return dict(metadata.obj)


def read_service_tier(f: Fields) -> str:
    """Accepted whatever tier is asked for: this server has one, which the response reports."""
    f.string("service_tier")
    return "default"


def read_sampling(f: Fields, model: ModelInfo, thinking: bool | None):
    values: dict[str, Any] = dict(model.sampling_defaults_for(thinking))
    values["max_tokens"], max_tokens_param = read_max_tokens(
        f, ("max_output_tokens", "max_tokens", "max_completion_tokens"))
    names = read_shared_sampling(f, values)
    values["ignore_eos"] = f.boolean("ignore_eos", False)
    values["priority"] = read_priority(f)
    return build_sampling_params(values, {"max_tokens": max_tokens_param, **names})


def responses_dialect(context: ResponsesContext) -> Dialect:
    return Dialect(name="responses", id_prefix="resp_",
                   parse=lambda body, model: parse_responses(body, model, context),
                   renderer=lambda request, result, meta: ResponsesRenderer(request, result, meta, context),
                   errors=OPENAI_ERRORS)
