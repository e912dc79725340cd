"""A conversation made ready for the model's chat template.

Templates differ in what they can take. Probing the template once tells ember whether it lists
tools and whether it accepts a system message; where it cannot, ember does the work itself: it
describes the tools in the system message and writes past calls and results as text in the model's
tool-call format, and it moves system text to the top of the first user message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ember.parsers.events import ToolSpec
from ember.parsers.tool_format import ToolFormat, tool_system_prompt

_PROBE = "ember_template_probe"
EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")  # the efforts a request may name, "none" aside


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    takes_tools: bool
    takes_system: bool
    efforts: tuple[str, ...] | None = None  # the reasoning efforts it renders apart; None: it ignores efforts


def probe_template(tokenizer) -> TemplateTraits:
    """What the tokenizer's chat template does with tools, with a system message and with efforts."""
    tool = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    user = {"role": "user", "content": "hello"}
    return TemplateTraits(
        takes_tools=_renders_with(tokenizer, [user], tools=[tool]),
        takes_system=_renders_with(tokenizer, [{"role": "system", "content": _PROBE}, user]),
        efforts=_template_efforts(tokenizer, [user]),
    )


def _template_efforts(tokenizer, messages: list[dict[str, Any]]) -> tuple[str, ...] | None:
    """An effort is offered when the template renders it otherwise than an effort it cannot know;
    a template that renders every effort as it renders none ignores them (None)."""
    def render(**kwargs: Any) -> str | None:
        try:
            return tokenizer.render_chat_template(messages, enable_thinking=True, **kwargs)
        except Exception:  # a template that refuses the value: not offered
            return None

    plain, unknown = render(), render(reasoning_effort=_PROBE)
    rendered = {effort: render(reasoning_effort=effort) for effort in EFFORTS}
    if all(text == plain for text in (unknown, *rendered.values())):
        return None
    return tuple(effort for effort, text in rendered.items() if text is not None and text != unknown)


def _renders_with(tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> bool:
    try:
        return _PROBE in tokenizer.render_chat_template(messages, **kwargs)
    except Exception:  # a template that refuses the shape: it cannot take it
        return False


def prepare_conversation(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                         traits: TemplateTraits, tool_format: ToolFormat | None
                         ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand the template. The caller's messages are not changed."""
    prepared = [dict(m) for m in messages]
    template_tools = [dict(t) for t in tools] if tools else None
    if not traits.takes_tools and tool_format is not None:
        prepared = _history_as_text(prepared, tool_format)
        if template_tools:
            _add_system_text(prepared, tool_system_prompt(_specs(template_tools), tool_format))
        template_tools = None
    if not traits.takes_system:
        prepared = _system_into_first_user(prepared)
    return prepared, template_tools


def drop_closed_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning stays only in the assistant turns after the last user message (the open turn: a
    reply still calling tools); the ones before it are closed."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    last_user = users[-1] if users else -1
    return [{k: v for k, v in m.items() if k != "reasoning_content"}
            if i < last_user and m.get("role") == "assistant" else m for i, m in enumerate(messages)]


def _specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    specs = []
    for tool in tools:
        function = tool.get("function", {})
        specs.append(ToolSpec(function["name"], function.get("parameters") or {}, function.get("description")))
    return specs


def _history_as_text(messages: list[dict[str, Any]], tool_format: ToolFormat) -> list[dict[str, Any]]:
    """Past calls become text in the assistant turn; tool results become a user turn."""
    result: list[dict[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [tool_format.render_call(c["function"]["name"], _as_mapping(c["function"].get("arguments")))
                     for c in message["tool_calls"]]
            text = message.get("content") or ""
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = "\n".join(([text] if text else []) + calls)
        elif message.get("role") == "tool":
            response = f"<tool_response>\n{message.get('content', '')}\n</tool_response>"
            if result and result[-1].get("ember_tool_results"):
                result[-1]["content"] += "\n" + response
                continue
            message = {"role": "user", "content": response, "ember_tool_results": True}
        result.append(message)
    for message in result:
        message.pop("ember_tool_results", None)
    return result


def _as_mapping(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


def _add_system_text(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0].get("role") == "system":
        existing = messages[0].get("content") or ""
        messages[0]["content"] = f"{existing}\n\n{text}" if existing else text
    else:
        messages.insert(0, {"role": "system", "content": text})


def _system_into_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system = [m.get("content") or "" for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    if not system:
        return rest
    text = "\n\n".join(s for s in system if s)
    for message in rest:
        if message.get("role") == "user":
            message["content"] = f"{text}\n\n{message.get('content') or ''}"
            return rest
    return [{"role": "user", "content": text}, *rest]
