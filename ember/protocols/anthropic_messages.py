"""Anthropic Messages: validate a request (or a count_tokens request) into the neutral form.

The conversation becomes chat-template messages: `system` (a string or text blocks; Claude Code's
billing-header block dropped) leads, `user` / `assistant` / `system` turns follow in order, with
consecutive turns of one role joined. tool_result blocks become `tool` messages, tool_use blocks
assistant `tool_calls`, thinking blocks `reasoning_content`; image blocks (in user turns and tool
results) become image parts of their message's content (tokenization.message_content). A final
assistant turn of text is a prefill that the reply continues. Claude Code's session-title requests
run as background work (session_title.py). The rendering lives in anthropic_render.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ember.constraint_spec import GrammarSpec
from ember.errors import InvalidRequest
from ember.protocols.anthropic_errors import ANTHROPIC_ERRORS
from ember.protocols.anthropic_render import MessagesRenderer
from ember.protocols.cache_hints import AnthropicBreakpoints, Breakpoint, collect_breakpoints, mark, shift_marks
from ember.protocols.anthropic_tools import read_tool_choice, read_tools
from ember.protocols.chat_reply import ChatFeatures, ChatOptions, template_tools
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields, as_string, json_type
from ember.protocols.image_parts import misplaced_image, read_anthropic_image
from ember.protocols.neutral import ChatPrompt, Dialect, GenerationRequest, ModelInfo, build_sampling_params
from ember.protocols.sampling_fields import PRIORITIES, read_max_tokens, read_sampling_fields, read_single_choice
from ember.protocols.session_title import is_session_title_request
from ember.protocols.structured import check_grammar_with_tools, read_flat_format
from ember.protocols.thinking import read_preserve_thinking, settle_thinking
from ember.protocols.tool_history import Answer, Call, in_call_order
from ember.protocols.unknown_fields import reads_fields
from ember.tokenization.message_content import build_content, content_length, image_part

BILLING_HEADER = "x-anthropic-billing-header:"
MIN_THINKING_BUDGET = 1024
MAX_STOP_SEQUENCES = 64
MAX_TOKENS_NAMES = ("max_tokens", "max_completion_tokens")
ROLES = ("user", "assistant", "system")
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
# Blocks ember cannot take (it runs none of Anthropic's server tools), and why.
REFUSED_BLOCKS = {
    "document": "documents are not supported; send their text in a text block",
    "search_result": "search result blocks are not supported; send their text in a text block",
    "redacted_thinking": "redacted thinking cannot be restored by ember (it holds no readable text)",
    "container_upload": "ember has no code-execution container",
}
# Top-level fields naming features that run on Anthropic's side: refused by name.
REFUSED_FIELDS = {
    "container": "ember has no code-execution container",
    "mcp_servers": "ember does not connect to MCP servers; declare the tools in tools instead",
}


@dataclass(slots=True)
class MessagesRequest(GenerationRequest):
    """The neutral request plus what only the Messages rendering needs."""

    model_label: str = ""  # echoed in the response


@reads_fields
def parse_messages(body: Any, model: ModelInfo) -> MessagesRequest:
    return _parse(body, model, counting=False)


@reads_fields
def parse_count_tokens(body: Any, model: ModelInfo) -> MessagesRequest:
    """The same prompt a create request makes; output-only fields are not read."""
    return _parse(body, model, counting=True)


def _parse(body: Any, model: ModelInfo, *, counting: bool) -> MessagesRequest:
    f = Fields(body)
    label = f.string("model", non_empty=True)
    for name, reason in REFUSED_FIELDS.items():
        if f.has(name) and f.raw(name) != []:
            raise unsupported(name, f"{name} is not supported: {reason}")
    max_tokens, max_tokens_param = (None, "max_tokens") if counting else read_max_tokens(f, MAX_TOKENS_NAMES)
    marks = AnthropicBreakpoints()
    tools, tools_ttl = read_tools(f, marks)
    conversation, last_turn = read_messages(f, marks, model)
    messages = join_leading_system(read_system(f, marks), conversation)
    read_request_cache_control(f, marks, messages)
    if tools and model.chat.tool_format is None:
        raise unsupported("tools", "tool calling is turned off on this server (--tool-call-parser none)")
    choice, chosen, parallel = read_tool_choice(f, tools)
    thinking, budget = read_thinking(f, max_tokens if max_tokens is not None else model.default_max_tokens)
    effort, grammar = read_output_config(f, model.chat)
    check_grammar_with_tools(grammar, choice, "tool_choice")
    clear_old_thinking(f, messages)
    prefill = read_prefill(messages, last_turn, thinking_enabled=budget is not None)
    if prefill and grammar is not None:
        raise InvalidRequest(f"{grammar.param} cannot be combined with a prefill (a final assistant turn of text): "
                             "the format holds the whole answer", param=grammar.param)
    template_kwargs: dict[str, Any] = {}
    requested_effort = effort
    _, effort = settle_thinking(thinking and not prefill, effort, "output_config.effort", model.chat, template_kwargs)
    preserve_thinking = read_preserve_thinking(f, template_kwargs, model.chat.preserve_thinking)
    if prefill:
        template_kwargs["continue_final_message"] = True
    options = ChatOptions(tools=tuple(chosen if chosen is not None else tools), tool_choice=choice,
                          parallel_tool_calls=parallel, thinking=thinking and not prefill, thinking_budget=budget,
                          reasoning_effort=effort, thinking_budget_param="thinking.budget_tokens",
                          requested_effort=requested_effort)
    breakpoints = collect_breakpoints(messages)
    if tools_ttl is not None:  # the tools end where the template's system part does
        breakpoints.insert(0, Breakpoint(1 if messages and messages[0]["role"] == "system" else 0, None, tools_ttl))
    prompt = ChatPrompt(messages, template_kwargs, template_tools(options.tools) if options.calls_tools else None,
                        add_generation_prompt=not prefill, cache_breakpoints=breakpoints,
                        preserve_thinking=preserve_thinking)
    if counting:
        params = build_sampling_params({"max_tokens": None})
    else:
        params = read_sampling(f, model, max_tokens, max_tokens_param, options.thinking)
        read_single_choice(f, "a message")
        if is_session_title_request(messages):  # nobody waits on it: it yields to the work someone waits on
            params = dataclasses.replace(params, priority=max(params.priority, PRIORITIES["background"]))
    stream = False if counting else f.boolean("stream", False)
    return_token_ids = False if counting else f.boolean("return_token_ids", False)
    f.object("metadata")
    f.string("service_tier")
    for accepted in ("inference_geo", "speed"):  # accepted; they change nothing here
        f.raw(accepted)
    return MessagesRequest(prompt, params, stream=stream, prompt_param="messages", chat=options,
                           grammar=None if counting else grammar, return_token_ids=return_token_ids,
                           model_label=label or model.name)


# ---- the conversation -----------------------------------------------------------------------------

def read_system(f: Fields, marks: AnthropicBreakpoints) -> list[dict[str, Any]]:
    raw = f.raw("system")
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "system", "content": raw}] if raw else []
    if not isinstance(raw, list):
        raise InvalidRequest(f"system must be a string or an array of text blocks, not {json_type(raw)}",
                             param="system")
    texts = []
    cuts: list[tuple[int, float]] = []
    for j, item in enumerate(raw):
        block = Fields(item, f"system[{j}]")
        kind = block.string("type")
        if kind != "text":
            raise InvalidRequest(f"{block.path} has type {kind!r}; system takes text blocks only", param=block.path)
        text = as_string(block.raw("text"), block.path_of("text"))
        ttl = marks.read(block)
        if j == 0 and text.startswith(BILLING_HEADER):
            continue  # Claude Code's per-request attribution (and its mark): kept out so the prefix stays cacheable
        texts.append(text)
        if ttl is not None:
            cuts.append((sum(map(len, texts)), ttl))
    text = "".join(texts)
    if not text:
        return []
    system = {"role": "system", "content": text}
    for cut, ttl in cuts:
        mark(system, cut, ttl)
    return [system]


def join_leading_system(system: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation that opens with a system turn continues the top-level system text."""
    if system and messages and messages[0]["role"] == "system":
        joined = {"role": "system", "content": system[0]["content"] + messages[0]["content"]}
        for cut, ttl in shift_marks(system[0], 0) + shift_marks(messages[0], len(system[0]["content"])):
            mark(joined, cut, ttl)
        return [joined, *messages[1:]]
    return system + messages


@dataclass(slots=True)
class _Turn:
    """Consecutive messages of one role, read; kept beside the neutral messages made from it (the
    last turn tells whether the conversation ends with a prefill)."""

    role: str
    blocks: list[tuple[str, Fields, float | None]]  # (kind, the block, its cache_control TTL) in order
    path: str  # of the first message of the turn


def read_messages(f: Fields, marks: AnthropicBreakpoints, model: ModelInfo) -> tuple[list[dict[str, Any]], _Turn]:
    """(the neutral messages, the last turn they were made from)."""
    items = f.array("messages", non_empty=True)
    if items is None:
        raise InvalidRequest("messages is required: a non-empty array of messages", param="messages")
    model.check_message_count(len(items), "messages")
    turns: list[_Turn] = []
    for i, raw in enumerate(items):
        m = Fields(raw, f"messages[{i}]")
        role = m.string("role")
        if role is None:
            raise InvalidRequest(f"{m.path_of('role')} is required", param=m.path_of("role"))
        if role not in ROLES:
            raise InvalidRequest(f"{m.path_of('role')} must be user, assistant or system; got '{role}'",
                                 param=m.path_of("role"))
        blocks = read_blocks(m, role, marks, final=i == len(items) - 1)
        if turns and turns[-1].role == role:
            turns[-1].blocks.extend(blocks)  # consecutive turns of one role are one turn
        else:
            turns.append(_Turn(role, blocks, m.path))
    order_tool_results(turns)
    messages: list[dict[str, Any]] = []
    for turn in turns:
        messages.extend(turn_messages(turn))
    return messages, turns[-1]


def order_tool_results(turns: list[_Turn]) -> None:
    """Each assistant turn's tool_use blocks are answered by the user turn after it (system turns
    between are passed over), one tool_result each, put back in call order (tool_history). Results
    in a conversation's opening user turn answer nothing it holds: a truncated or imported history,
    kept as it is."""
    calls: list[Call] | None = None  # the last assistant turn's calls; None before any assistant turn
    due = ""  # the path of that assistant turn
    for turn in turns:
        if turn.role == "system":
            continue
        if turn.role == "assistant":
            if calls:
                in_call_order(calls, [], complete=True, turn_param=turn.path, result_kind="tool_result")
            calls = [Call(block.raw("id"), block.path_of("id")) for kind, block, _ in turn.blocks if kind == "tool_use"]
            due = turn.path
            continue
        results = [entry for entry in turn.blocks if entry[0] == "tool_result"]
        if calls is not None:
            answers = [Answer(block.raw("tool_use_id"), block.path_of("tool_use_id"), (kind, block, ttl))
                       for kind, block, ttl in results]
            results = in_call_order(calls, answers, complete=True, turn_param=turn.path + ".content",
                                    result_kind="tool_result")
        turn.blocks = results + [entry for entry in turn.blocks if entry[0] != "tool_result"]
        calls = []
    if calls and turns[-1].role == "system":  # (a final assistant turn is a prefill: read_prefill refuses calls)
        in_call_order(calls, [], complete=True, turn_param=due, result_kind="tool_result")


def read_blocks(m: Fields, role: str, marks: AnthropicBreakpoints, *,
                final: bool) -> list[tuple[str, Fields, float | None]]:
    content = m.raw("content")
    path = m.path_of("content")
    if content is None:
        raise InvalidRequest(f"{path} is required", param=path)
    if isinstance(content, str):
        if not content and not (role == "assistant" and final):
            raise InvalidRequest(f"{path} must not be empty", param=path)
        return [("text", Fields({"type": "text", "text": content}, path), None)]
    if not isinstance(content, list):
        raise InvalidRequest(f"{path} must be a string or an array of content blocks, not {json_type(content)}",
                             param=path)
    if not content and not (role == "assistant" and final):
        raise InvalidRequest(f"{path} must not be empty", param=path)
    blocks = []
    for j, item in enumerate(content):
        block = Fields(item, f"{path}[{j}]")
        kind = block.string("type")
        if kind is None:
            raise InvalidRequest(f"{block.path_of('type')} is required", param=block.path_of("type"))
        check_block(block, kind, role)
        ttl = marks.read(block)
        if kind == "tool_result":  # a mark inside the result counts for the result
            for k, inner in enumerate(block.raw("content") if isinstance(block.raw("content"), list) else []):
                inner_ttl = marks.read(Fields(inner, block.path_of("content") + f"[{k}]"))
                ttl = inner_ttl if ttl is None else max(ttl, inner_ttl or 0.0)
        blocks.append((kind, block, ttl))
    return blocks


_ALLOWED = {"text": ROLES, "image": ("user",), "tool_result": ("user",), "tool_use": ("assistant",),
            "thinking": ("assistant",)}


def check_block(block: Fields, kind: str, role: str) -> None:
    if kind == "image" and role != "user":
        raise misplaced_image(block.path, role)
    if kind in REFUSED_BLOCKS:
        raise InvalidRequest(f"{block.path}: {kind} blocks are not supported: {REFUSED_BLOCKS[kind]}",
                             param=block.path, code="unsupported_content")
    if kind not in _ALLOWED:
        raise InvalidRequest(f"{block.path}: {kind} blocks are not supported (ember takes text, image, tool_use, "
                             f"tool_result and thinking blocks; server tools run on Anthropic's side only)",
                             param=block.path, code="unsupported_content")
    if role not in _ALLOWED[kind]:
        raise InvalidRequest(f"{block.path}: a {kind} block cannot appear in a {role} message", param=block.path)
    if kind == "text":
        as_string(block.raw("text"), block.path_of("text"))
    elif kind == "image":
        read_anthropic_image(block)
    elif kind == "thinking":
        as_string(block.raw("thinking"), block.path_of("thinking"))
        block.string("signature")
    elif kind == "tool_use":
        for name in ("id", "name"):
            if block.string(name, non_empty=True) is None:
                raise InvalidRequest(f"{block.path_of(name)} is required", param=block.path_of(name))
        block.object("input")
    else:
        if block.string("tool_use_id", non_empty=True) is None:
            raise InvalidRequest(f"{block.path_of('tool_use_id')} is required", param=block.path_of("tool_use_id"))
        block.boolean("is_error")
        tool_result_content(block)


def tool_result_content(block: Fields) -> Any:
    """A tool_result's text and images in order, as a neutral message's content."""
    content = block.raw("content")
    path = block.path_of("content")
    pieces: list[Any] = []
    if isinstance(content, str):
        pieces.append(content)
    elif isinstance(content, list):
        for k, item in enumerate(content):
            part = Fields(item, f"{path}[{k}]")
            kind = part.string("type")
            if kind == "text":
                pieces.append(as_string(part.raw("text"), part.path_of("text")))
            elif kind == "image":
                pieces.append(image_part(read_anthropic_image(part)))
            else:
                reason = REFUSED_BLOCKS.get(kind or "", "a tool result may hold text and image blocks only")
                raise InvalidRequest(f"{part.path}: {kind} blocks are not supported in a tool result: {reason}",
                                     param=part.path, code="unsupported_content")
    elif content is not None:
        raise InvalidRequest(f"{path} must be a string or an array of text and image blocks, not "
                             f"{json_type(content)}", param=path)
    # A failed tool says so in the prompt, where the model can read it.
    return build_content(["Error: " if block.boolean("is_error", False) else "", *pieces])


def turn_messages(turn: _Turn) -> list[dict[str, Any]]:
    """A turn's neutral messages, each marked where a block of it carries cache_control: text and
    images at the end of that block in the content, other blocks (results, calls, thinking) at the
    end of their message."""
    pieces: list[Any] = []
    text_cuts: list[tuple[int | None, float]] = []
    whole_ttls: list[float] = []
    for kind, block, ttl in turn.blocks:
        if kind == "text":
            pieces.append(block.raw("text"))
        elif kind == "image":
            pieces.append(image_part(read_anthropic_image(block)))
        if ttl is not None and kind != "tool_result":
            if kind in ("text", "image"):
                text_cuts.append((content_length(build_content(pieces)), ttl))
            else:
                whole_ttls.append(ttl)
    content = build_content(pieces)
    if turn.role == "system":
        return [_marked({"role": "system", "content": content}, text_cuts)]
    if turn.role == "user":
        # Tool results answer the assistant's calls, so they come first; the turn's text follows.
        results = [_marked({"role": "tool", "tool_call_id": block.raw("tool_use_id"),
                            "content": tool_result_content(block)}, [] if ttl is None else [(None, ttl)])
                   for kind, block, ttl in turn.blocks if kind == "tool_result"]
        if pieces or not results:
            return results + [_marked({"role": "user", "content": content}, text_cuts)]
        return results
    message: dict[str, Any] = {"role": "assistant", "content": content}
    reasoning = "".join(block.raw("thinking") for kind, block, _ in turn.blocks if kind == "thinking")
    if reasoning:
        message["reasoning_content"] = reasoning  # the visible text; the signature is not checked
    calls = [{"id": block.raw("id"), "type": "function",
              "function": {"name": block.raw("name"), "arguments": dict(block.raw("input", {}))}}
             for kind, block, _ in turn.blocks if kind == "tool_use"]
    if calls:
        message["tool_calls"] = calls
    return [_marked(message, text_cuts + [(None, ttl) for ttl in whole_ttls])]


def _marked(message: dict[str, Any], cuts: list[tuple[int | None, float]]) -> dict[str, Any]:
    for cut, ttl in cuts:
        mark(message, cut, ttl)
    return message


def read_request_cache_control(f: Fields, marks: AnthropicBreakpoints, messages: list[dict[str, Any]]) -> None:
    """Top-level cache_control marks the last block of the conversation, unless that block has a
    cache_control of its own, which then stands (whatever its TTL: refusing a request that sends
    both, as Claude Code may, would help no one)."""
    if not f.has("cache_control") or not messages:
        return
    content = f.raw("messages")[-1].get("content")
    last_block = content[-1] if isinstance(content, list) and content else None
    if isinstance(last_block, dict) and last_block.get("cache_control") is not None:
        marks.read(f, counts=False)  # checked, and the block's own mark stands
        return
    mark(messages[-1], None, marks.read(f))


def read_prefill(messages: list[dict[str, Any]], last_turn: _Turn, *, thinking_enabled: bool) -> bool:
    """Whether the conversation ends with an assistant turn the reply continues; `last_turn` is the
    turn its last message was made from. An empty final assistant turn is dropped."""
    if last_turn.role != "assistant":
        return False
    kinds, path = [kind for kind, _, _ in last_turn.blocks], last_turn.path
    if any(kind != "text" for kind in kinds):
        raise InvalidRequest(f"{path}: the conversation ends with an assistant turn holding "
                             f"{', '.join(sorted(set(k for k in kinds if k != 'text')))} blocks; a final "
                             "assistant turn is a prefill and may hold text only", param=path)
    text = messages[-1]["content"]
    if not text:
        messages.pop()  # an empty prefill: an ordinary reply
        return False
    if text != text.rstrip():
        raise InvalidRequest(f"{path}: a final assistant turn (a prefill) may not end with whitespace", param=path)
    if thinking_enabled:
        raise InvalidRequest("thinking cannot be enabled when the final assistant turn is a prefill", param="thinking")
    return True


def clear_old_thinking(f: Fields, messages: list[dict[str, Any]]) -> None:
    """context_management's clear_thinking edit: reasoning stays in the last `keep` assistant turns
    that have some (1 unless said otherwise, or all). Other edits are accepted and not applied."""
    management = f.object("context_management")
    if management is None:
        return
    for k, raw in enumerate(management.array("edits") or []):
        edit = Fields(raw, management.path_of("edits") + f"[{k}]")
        kind = edit.string("type")
        if kind is None or not kind.startswith("clear_thinking"):
            continue
        keep = edit.raw("keep")
        if keep == "all":
            continue
        turns = 1
        if keep is not None:
            spec = edit.object("keep")
            if spec.string("type", choices=("thinking_turns",)) is None:
                raise InvalidRequest(f"{spec.path_of('type')} is required", param=spec.path_of("type"))
            turns = spec.integer("value", low=0)
            if turns is None:
                raise InvalidRequest(f"{spec.path_of('value')} is required", param=spec.path_of("value"))
        thinking = [m for m in messages if m["role"] == "assistant" and m.get("reasoning_content")]
        for message in thinking[:max(len(thinking) - turns, 0)]:
            del message["reasoning_content"]


# ---- thinking, effort, sampling ---------------------------------------------------------------------

def read_thinking(f: Fields, max_tokens: int | None) -> tuple[bool, int | None]:
    """(thinking on, its budget: the request's for `enabled`, else None for the server's default).
    Without a thinking field the reply does not think, as on Anthropic's API."""
    thinking = f.object("thinking")
    if thinking is None:
        return False, None
    kind = thinking.string("type", choices=("enabled", "adaptive", "disabled", "between_tools"))
    if kind is None:
        raise InvalidRequest("thinking.type is required: enabled, adaptive or disabled", param="thinking.type")
    if thinking.string("display", choices=("summarized", "omitted")) == "omitted":
        raise unsupported("thinking.display", "thinking.display 'omitted' is not supported: ember returns the "
                                              "thinking text itself, and cannot restore hidden thinking later")
    if kind == "disabled":
        return False, None
    if kind != "enabled":
        return True, None
    budget = thinking.integer("budget_tokens", low=MIN_THINKING_BUDGET)
    if budget is None:
        raise InvalidRequest("thinking.budget_tokens is required when thinking is enabled",
                             param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise InvalidRequest(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                             param="thinking.budget_tokens")
    return True, budget


def read_output_config(f: Fields, features: ChatFeatures) -> tuple[str | None, GrammarSpec | None]:
    """(output_config.effort, reaching the chat template as reasoning_effort ('max' as 'xhigh' unless
    the template offers 'max'); the structured output of output_config.format, or of output_format,
    the older name of the same field)."""
    config = f.object("output_config")
    effort = config.string("effort", choices=EFFORTS) if config is not None else None
    if effort is not None and not (effort == "max" and features.efforts is not None and "max" in features.efforts):
        effort = EFFORTS[effort]
    return effort, _read_format(f, config)


def _read_format(f: Fields, config: Fields | None) -> GrammarSpec | None:
    fmt = config.object("format") if config is not None else None
    older = f.object("output_format")
    if fmt is not None and older is not None:
        raise InvalidRequest("output_format cannot be combined with output_config.format: send the format once, "
                             "in output_config.format", param="output_format", code="conflicting_constraints")
    fmt = fmt if fmt is not None else older
    return read_flat_format(fmt, allow_text=False, allow_json_object=False) if fmt is not None else None


def read_sampling(f: Fields, model: ModelInfo, max_tokens: int | None, max_tokens_param: str,
                  thinking: bool | None):
    """Anthropic's sampling fields plus the ones other servers take on this route (min_p, the
    penalties, seed, stop), over the defaults of the turn's thinking mode."""
    values: dict[str, Any] = dict(model.sampling_defaults_for(thinking))
    values["max_tokens"] = max_tokens
    f.integer("top_k", low=0)  # 0 is off; Anthropic has no -1
    names = read_sampling_fields(f, values, stop_names=("stop_sequences", "stop"), stop_limit=MAX_STOP_SEQUENCES)
    return build_sampling_params(values, {"max_tokens": max_tokens_param, **names})


MESSAGES = Dialect(name="messages", id_prefix="msg_", parse=parse_messages, renderer=MessagesRenderer,
                   errors=ANTHROPIC_ERRORS)
