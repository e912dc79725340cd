"""Tools and past tool calls written as text, for a chat template that cannot list tools.

Such a template gets the tools described in the system message (with an example call in the
served model's tool-call format), past calls as text in the assistant turns and tool results as
user turns; a template that refuses a system message gets that text in the first user turn, and
one that takes a system message at the start only gets a later one as a user turn that says what
it is (ember.tokenization.chat_prompt).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ember.parsers.events import ToolSpec
from ember.parsers.tool_format import ToolFormat
from ember.tokenization.chat_prompt import TemplateTraits, later_system_as_user, system_into_first_user
from ember.tokenization.message_content import build_content


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
        prepared = system_into_first_user(prepared)
    elif traits.later_system_refused:
        prepared = later_system_as_user(prepared)
    return prepared, template_tools


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
            response = build_content(["<tool_response>\n", message.get("content") or "", "\n</tool_response>"])
            if result and result[-1].get("ember_tool_results"):
                result[-1]["content"] = build_content([result[-1]["content"], "\n", response])
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


def tool_system_prompt(tools: Sequence[ToolSpec], tool_format: ToolFormat) -> str:
    """Instructions for a model whose chat template cannot list tools itself. The example call
    uses the first tool's own parameters, which small models copy far better than a placeholder."""
    lines = ["You may call functions to answer. Each one is described by a JSON schema inside <tools></tools>:",
             "<tools>"]
    for tool in tools:
        entry: dict[str, Any] = {"name": tool.name}
        if tool.description:
            entry["description"] = tool.description
        entry["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        lines.append(json.dumps({"type": "function", "function": entry}, ensure_ascii=False))
    lines.append("</tools>")
    lines.append("To call a function, reply with its name and arguments inside <tool_call></tool_call> tags, "
                 "for example:")
    lines.append(tool_format.render_call(tools[0].name, example_arguments(tools[0])))
    return "\n".join(lines)


_PLACEHOLDERS = {"string": "...", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}


def example_arguments(tool: ToolSpec) -> dict[str, Any]:
    properties = tool.parameters.get("properties")
    if not isinstance(properties, dict):
        return {}
    example = {}
    for name, schema in properties.items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        enum = schema.get("enum") if isinstance(schema, dict) else None
        example[name] = enum[0] if isinstance(enum, list) and enum else _PLACEHOLDERS.get(kind, "...")
    return example
