"""Chat Completions' tool and thinking fields, validated into the neutral ChatOptions.

    tools                  [{"type": "function", "function": {name, description?, parameters?, strict?}}]
    tool_choice            "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
                           | {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}
    parallel_tool_calls    true (default) | false: at most one call
    enable_thinking        top level or in chat_template_kwargs
    reasoning_effort       top level (wins) or in chat_template_kwargs; "none" turns thinking off
    thinking_budget        reasoning tokens before ember closes the think block (0: the server's default)
"""

from __future__ import annotations

from typing import Any

from ember.errors import InvalidRequest
from ember.parsers.events import ToolSpec
from ember.protocols.chat_reply import (
    AUTO, FUNCTION, NONE, REQUIRED, REASONING_EFFORTS, ChatFeatures, ChatOptions, declare_tool, function_tool,
    read_thinking_budget,
    tool_items, tool_name, tool_schema,
)
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields
from ember.protocols.neutral import ModelInfo
from ember.protocols.thinking import settle_thinking



def read_chat_options(f: Fields, template_kwargs: dict[str, Any], model: ModelInfo) -> ChatOptions:
    """Also settles the thinking switches in `template_kwargs`, which the template receives."""
    tools = read_tools(f)
    if tools and model.chat.tool_format is None:
        raise unsupported("tools", "tool calling is turned off on this server (--tool-call-parser none)")
    choice, chosen = read_tool_choice(f, tools)
    if chosen is not None:
        tools = chosen
    thinking, effort, requested = read_thinking(f, template_kwargs, model.chat)
    budget = read_thinking_budget(f)
    return ChatOptions(tools=tuple(tools), tool_choice=choice, parallel_tool_calls=f.boolean("parallel_tool_calls", True),
                       thinking=thinking, thinking_budget=budget, reasoning_effort=effort, requested_effort=requested)


def read_tools(f: Fields) -> list[ToolSpec]:
    items = tool_items(f)
    specs: list[ToolSpec] = []
    for i, raw in enumerate(items):
        function = function_tool(Fields(raw, f"tools[{i}]"))
        name = tool_name(function)
        strict = function.boolean("strict", False)
        parameters = tool_schema(function, "parameters", {})
        declare_tool(specs, ToolSpec(name, parameters, function.string("description"), strict), function)
    return specs


def read_tool_choice(f: Fields, tools: list[ToolSpec]) -> tuple[str, list[ToolSpec] | None]:
    """(the choice, the tools it leaves callable when it narrows them, else None)."""
    raw = f.raw("tool_choice")
    if raw is None:
        return (AUTO if tools else NONE), None
    if isinstance(raw, str):
        if raw not in (NONE, AUTO, REQUIRED):
            raise InvalidRequest(f"tool_choice must be none, auto, required or an object; got '{raw}'",
                                 param="tool_choice")
        if raw == REQUIRED and not tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool in tools", param="tool_choice")
        return raw, None
    choice = Fields(raw, "tool_choice")
    kind = choice.string("type", choices=("function", "allowed_tools"))
    if kind == "function":
        function = choice.object("function")
        name = function.string("name") if function is not None else None
        if name is None:
            raise InvalidRequest("tool_choice.function.name is required", param="tool_choice.function.name")
        return FUNCTION, [_declared(tools, name, "tool_choice.function.name")]
    if kind == "allowed_tools":
        allowed = choice.object("allowed_tools")
        if allowed is None:
            raise InvalidRequest("tool_choice.allowed_tools is required", param="tool_choice.allowed_tools")
        mode = allowed.string("mode", AUTO, choices=(AUTO, REQUIRED))
        names = []
        for j, item in enumerate(allowed.array("tools", non_empty=True) or []):
            entry = Fields(item, allowed.path_of("tools") + f"[{j}]")
            function = entry.object("function")
            name = function.string("name") if function is not None else entry.string("name")
            names.append(_declared(tools, name, entry.path_of("function") + ".name"))
        if not names:
            raise InvalidRequest("tool_choice.allowed_tools.tools must name at least one tool",
                                 param="tool_choice.allowed_tools.tools")
        return mode, names
    raise InvalidRequest("tool_choice.type is required: function or allowed_tools", param="tool_choice.type")


def _declared(tools: list[ToolSpec], name: str | None, param: str) -> ToolSpec:
    for tool in tools:
        if tool.name == name:
            return tool
    raise InvalidRequest(f"{param} names '{name}', which is not among the declared tools", param=param)


def read_thinking(f: Fields, template_kwargs: dict[str, Any],
                  features: ChatFeatures) -> tuple[bool | None, str | None, str | None]:
    """(thinking on/off or None for the template's default, the reasoning effort, the effort the
    request itself named) from the top-level fields and their chat_template_kwargs spellings, then
    the server's defaults; contradictions are refused, and so is an effort the template does not offer."""
    enable = f.boolean("enable_thinking")
    in_kwargs = template_kwargs.get("enable_thinking")
    if in_kwargs is not None:
        if not isinstance(in_kwargs, bool):
            raise InvalidRequest("chat_template_kwargs.enable_thinking must be true or false",
                                 param="chat_template_kwargs.enable_thinking")
        if enable is not None and enable != in_kwargs:
            raise InvalidRequest("enable_thinking and chat_template_kwargs.enable_thinking disagree",
                                 param="enable_thinking", code="conflicting_template_option")
        enable = in_kwargs
    effort, effort_param = f.string("reasoning_effort", choices=REASONING_EFFORTS), "reasoning_effort"
    if effort is None and template_kwargs.get("reasoning_effort") is not None:
        effort = Fields(template_kwargs, "chat_template_kwargs").string("reasoning_effort",
                                                                        choices=REASONING_EFFORTS)
        effort_param = "chat_template_kwargs.reasoning_effort"
    if effort is not None:
        wants_thinking = effort != "none"
        if enable is not None and enable != wants_thinking:
            raise InvalidRequest(f"reasoning_effort '{effort}' contradicts enable_thinking {str(enable).lower()}",
                                 param="reasoning_effort", code="conflicting_template_option")
        enable = wants_thinking
    return (*settle_thinking(enable, effort, effort_param, features, template_kwargs), effort)
