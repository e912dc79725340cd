"""xgrammar structural tags that hold a reply's tool calls, alone or beside a structured output.

Tool calls are written in the served model's format (hermes JSON or Qwen3 XML), each call's
arguments held to its tool's schema where the call is forced or the tool is `strict` (another
tool's to a JSON object); a custom tool with a grammar has its input held to that grammar (as raw
text in Qwen3 XML, as the body of a JSON string in hermes):
- forced: one call or more (one without parallel calls) to the offered tools, and nothing else;
- not forced: free text, but a call the reply opens is held to the offered tools;
- beside a structured output: the structured output's answer, or calls as when forced.
The front end decides which applies; this module only writes the tag.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ember.constraint_spec import (
    CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, STRUCTURAL_TAG, ConstraintSpec, GrammarSpec, SteeringSpec,
)
from ember.errors import InvalidRequest
from ember.grammar.compiler import MAX_JSON_WHITESPACE, compiler_reason, structural_tag_text
from ember.grammar.json_string import json_string_ebnf
from ember.parsers.events import CUSTOM_INPUT, ToolSpec
from ember.parsers.tool_format import CLOSER, OPENER, ToolFormat

_ANY_OBJECT = {"type": "object"}
_CALL_SEPARATOR = "\n"


def calls_constraint(steering: SteeringSpec | None, tool_format: ToolFormat, tools: Sequence[ToolSpec], *,
                     forced: bool, parallel: bool, answer: GrammarSpec | None = None) -> ConstraintSpec:
    """The spec that holds a reply's calls to `tools` (and, with `answer`, the structured output the
    reply may give instead); `steering` follows the reasoning before them."""
    if answer is not None:
        calls = _calls_format(tool_format, tools, forced=True, parallel=parallel)
        tag, param = {"type": "or", "elements": [calls, _spec_format(answer)]}, answer.param
    else:
        tag, param = _calls_format(tool_format, tools, forced=forced, parallel=parallel), "tools"
    grammars = [answer, *(tool.input_grammar for tool in tools)]
    return ConstraintSpec(steering, STRUCTURAL_TAG, structural_tag_text(_structural_tag(tag)), param,
                          checks=[(g.kind, g.text, g.param) for g in grammars if g is not None])


def _spec_format(spec: GrammarSpec) -> dict[str, Any]:
    """A structured-output spec as a structural-tag format."""
    if spec.kind == JSON_SCHEMA:
        return _json_format(json.loads(spec.text))
    if spec.kind == JSON_OBJECT:
        return _json_format(_ANY_OBJECT)
    if spec.kind == REGEX:
        return {"type": "regex", "pattern": spec.text}
    if spec.kind == CHOICE:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in json.loads(spec.text)]}
    if spec.kind == GRAMMAR:
        return {"type": "grammar", "grammar": spec.text}
    if spec.kind == LARK:
        return {"type": "grammar", "grammar": spec.text, "syntax": "lark"}
    raise ValueError(spec.kind)


def _json_format(schema: Any, style: str = "json") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "style": style, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _structural_tag(answer: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": answer}


def _calls_format(tool_format: ToolFormat, tools: Sequence[ToolSpec], *, forced: bool, parallel: bool
                  ) -> dict[str, Any]:
    shape = _CALL_SHAPES.get(tool_format.name)
    if shape is None:
        raise InvalidRequest(f"tool calls in the {tool_format.name} format cannot be held to a schema",
                             param="tools")
    begin, end, style = shape
    tags = []
    for tool in tools:
        if tool.input_grammar is not None:
            tags.append(_raw_input_tag(tool_format, tool, begin(tool.name), end))
            continue
        schema = (tool.parameters or _ANY_OBJECT) if forced or tool.strict else _ANY_OBJECT
        tags.append({"type": "tag", "begin": begin(tool.name), "content": _json_format(schema, style), "end": end})
    if forced:
        return {"type": "tags_with_separator", "tags": tags, "separator": _CALL_SEPARATOR, "at_least_one": True,
                "stop_after_first": not parallel}
    return {"type": "triggered_tags", "triggers": [OPENER], "tags": tags, "at_least_one": False,
            "stop_after_first": not parallel}


def holds_input_grammar(tool_format_name: str) -> bool:
    """Whether a custom tool's input, in calls of this format, can be held to the tool's grammar."""
    return tool_format_name in _INPUT_WRAPPERS


def _raw_input_tag(tool_format: ToolFormat, tool: ToolSpec, begin: str, end: str) -> dict[str, Any]:
    """A call whose one parameter, CUSTOM_INPUT, is held to the tool's grammar."""
    wrapper = _INPUT_WRAPPERS.get(tool_format.name)
    if wrapper is None:
        raise InvalidRequest(f"the input of the custom tool '{tool.name}' cannot be held to its grammar in calls "
                             f"of the {tool_format.name} format", param="tools")
    before, after, in_json_string = wrapper
    content = _json_string_content(tool.input_grammar) if in_json_string else _spec_format(tool.input_grammar)
    return {"type": "tag", "begin": begin + before, "content": content, "end": after + end}


def _json_string_content(grammar: GrammarSpec) -> dict[str, Any]:
    try:
        return {"type": "grammar", "grammar": json_string_ebnf(grammar.kind, grammar.text)}
    except Exception as exc:  # xgrammar's reason, as for any grammar that does not compile
        raise InvalidRequest(f"{grammar.param} could not be compiled: {compiler_reason(exc)}",
                             param=grammar.param, code="invalid_grammar") from None


# format name -> (the text before the input, the text after it, whether it is written as a JSON string)
_INPUT_WRAPPERS: dict[str, tuple[str, str, bool]] = {
    "qwen3_xml": (f"<parameter={CUSTOM_INPUT}>\n", "\n</parameter>\n", False),
    "hermes": (f'{{{json.dumps(CUSTOM_INPUT)}: "', '"}', True),
}

# format name -> (the text before the arguments, given the tool's name; the text after them; how they're written)
_CALL_SHAPES: dict[str, tuple[Callable[[str], str], str, str]] = {
    "hermes": (lambda name: f'{OPENER}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{CLOSER}", "json"),
    "qwen3_xml": (lambda name: f"{OPENER}\n<function={name}>\n", f"</function>\n{CLOSER}", "qwen_xml"),
}
