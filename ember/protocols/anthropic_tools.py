"""Anthropic Messages `tools` and `tool_choice`, validated into the neutral tool declarations.

A client tool is {name, description?, input_schema?, input_examples?, strict?, cache_control?,
eager_input_streaming?}. Its input_examples reach the model inside the description the template
renders (each example as one line of JSON), since chat templates have no place of their own for
them. defer_loading: true is refused by name: it needs Anthropic's tool search, which ember does
not run, and the tool would otherwise be shown to the model at once. Anthropic's server tools
(web_search, code_execution, ...) run on Anthropic's side and are refused by name too.
"""

from __future__ import annotations

import json
from typing import Any

from ember.errors import InvalidRequest
from ember.parsers.events import ToolSpec
from ember.protocols.cache_hints import AnthropicBreakpoints
from ember.protocols.chat_reply import (
    AUTO, FUNCTION, NONE, REQUIRED, declare_tool, tool_items, tool_name, tool_schema,
)
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields, json_type

MAX_INPUT_EXAMPLES = 32


def read_tools(f: Fields, marks: AnthropicBreakpoints) -> tuple[list[ToolSpec], float | None]:
    """The tools, and the longest TTL a tool's cache_control asks for (None: no tool has one)."""
    items = tool_items(f)
    specs: list[ToolSpec] = []
    ttls: list[float] = []
    for i, raw in enumerate(items):
        tool = Fields(raw, f"tools[{i}]")
        kind = tool.string("type")
        if kind not in (None, "custom"):
            raise unsupported(tool.path_of("type"),
                              f"{tool.path} is a '{kind}' tool, which runs on Anthropic's servers; ember calls client "
                              "tools only (name, description, input_schema)")
        name = tool_name(tool)
        schema = tool_schema(tool, "input_schema", {"type": "object", "properties": {}})
        tool.boolean("eager_input_streaming")
        if tool.boolean("defer_loading", False):
            raise unsupported(tool.path_of("defer_loading"), "defer_loading needs Anthropic's tool search, which ember "
                                                             "does not run; declare the tool without it")
        description = described_with_examples(tool.string("description"), read_input_examples(tool))
        ttl = marks.read(tool)
        if ttl is not None:
            ttls.append(ttl)
        declare_tool(specs, ToolSpec(name, schema, description, strict=tool.boolean("strict", False)), tool)
    return specs, max(ttls, default=None)


def read_input_examples(tool: Fields) -> list[dict[str, Any]]:
    examples = tool.array("input_examples") or []
    path = tool.path_of("input_examples")
    if len(examples) > MAX_INPUT_EXAMPLES:
        raise InvalidRequest(f"{path} holds {len(examples)} examples; at most {MAX_INPUT_EXAMPLES} are allowed",
                             param=path)
    for j, example in enumerate(examples):
        if not isinstance(example, dict):
            raise InvalidRequest(f"{path}[{j}] must be an object (an input the tool takes), not {json_type(example)}",
                                 param=f"{path}[{j}]")
    return examples


def described_with_examples(description: str | None, examples: list[dict[str, Any]]) -> str | None:
    """The description the model reads: the tool's own, then its input examples, one JSON object a line."""
    if not examples:
        return description
    lines = "\n".join(json.dumps(example, ensure_ascii=False) for example in examples)
    return f"{description}\n\nInput examples:\n{lines}" if description else f"Input examples:\n{lines}"


def read_tool_choice(f: Fields, tools: list[ToolSpec]) -> tuple[str, list[ToolSpec] | None, bool]:
    """(the choice, the tools it leaves callable when it names one, parallel calls allowed)."""
    choice = f.object("tool_choice")
    if choice is None:
        return (AUTO if tools else NONE), None, True
    kind = choice.string("type", choices=("auto", "any", "tool", "none"))
    if kind is None:
        raise InvalidRequest("tool_choice.type is required: auto, any, tool or none", param="tool_choice.type")
    parallel = not choice.boolean("disable_parallel_tool_use", False)
    if kind == "none" or (kind == "auto" and not tools):
        return NONE, None, parallel
    if kind == "auto":
        return AUTO, None, parallel
    if not tools:
        raise InvalidRequest(f"tool_choice '{kind}' needs at least one tool in tools", param="tool_choice")
    if kind == "any":
        return REQUIRED, None, parallel
    name = choice.string("name")
    if name is None:
        raise InvalidRequest("tool_choice.name is required for type 'tool'", param="tool_choice.name")
    for tool in tools:
        if tool.name == name:
            return FUNCTION, [tool], parallel
    raise InvalidRequest(f"tool_choice.name names '{name}', which is not among the declared tools",
                         param="tool_choice.name")
