"""From a validated request to the grammar its replies are held to, and a constraint per choice.

What the answer must match:
- a structured-output field alone: that grammar;
- tool_choice required or a named function: one call or more (one with parallel_tool_calls false)
  to the offered tools, each call's arguments held to that tool's schema, and nothing else;
- tool_choice auto with a `strict` tool: free text, but a call the reply opens is held to the
  offered tools, a strict tool's arguments to its schema (another tool's to a JSON object);
- a structured-output field beside tools under auto: the grammar's answer, or calls as above.
Tool calls are written in the served model's format (hermes JSON or Qwen3 XML).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ember.errors import InvalidRequest
from ember.constraint_spec import STRUCTURAL_TAG, ConstraintSpec
from ember.grammar.compiler import MAX_JSON_WHITESPACE, grammar_unavailable, structural_tag_text
from ember.parsers.events import ToolSpec
from ember.parsers.tool_format import CLOSER, OPENER
from ember.protocols.chat_reply import FUNCTION, REQUIRED, ReplyPlan
from ember.protocols.neutral import GenerationRequest
from ember.protocols.structured import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, GrammarSpec
_ANY_OBJECT = {"type": "object"}
_CALL_SEPARATOR = "\n"


def build_constraints(job: GenerationRequest, plan: ReplyPlan | None, grammars: bool) -> ConstraintSpec | None:
    """The grammar every choice's reply is held to, as a spec the engine compiles (`grammars`:
    whether it can, with xgrammar); None when no grammar applies (the reply plan's own steering,
    if any, applies). The engine checks that the spec compiles before the request is admitted."""
    tools, forced = _constrained_tools(job, plan)
    if job.grammar is None and tools is None:
        return None
    if not grammars:
        if job.grammar is not None:
            raise grammar_unavailable(job.grammar.param)
        if any(t.strict for t in tools):
            raise grammar_unavailable("tools")
        return None  # a forced call without xgrammar: the reply plan forces opener and name, as before
    steering = plan.steering(reasoning_only=True) if plan is not None else None
    if job.grammar is not None:
        if tools is None:
            return ConstraintSpec(steering, job.grammar.kind, job.grammar.text, job.grammar.param)
        calls = _calls_format(plan.fmt.tool_format, tools, forced=True, parallel=plan.fmt.parallel_tool_calls)
        tag, param = {"type": "or", "elements": [calls, spec_format(job.grammar)]}, job.grammar.param
    else:
        calls = _calls_format(plan.fmt.tool_format, tools, forced=forced, parallel=plan.fmt.parallel_tool_calls)
        tag, param = calls, "tools"
    return ConstraintSpec(steering, STRUCTURAL_TAG, structural_tag_text(_structural_tag(tag)), param,
                          checks=[(g.kind, g.text, g.param) for g in (job.grammar,) if g is not None])


def _constrained_tools(job: GenerationRequest, plan: ReplyPlan | None) -> tuple[list[ToolSpec] | None, bool]:
    """(the tools whose calls a grammar must shape, or None; whether a call is forced)."""
    options = job.chat
    if options is None or plan is None or plan.fmt.tool_format is None or not options.calls_tools:
        return None, False
    forced = options.tool_choice in (REQUIRED, FUNCTION)
    if job.grammar is None and not forced and not any(t.strict for t in options.tools):
        return None, False
    return list(options.tools), forced


# ---- xgrammar structural tags -------------------------------------------------------------------

def spec_format(spec: GrammarSpec) -> dict[str, Any]:
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
    raise ValueError(spec.kind)


def _json_format(schema: Any, style: str = "json") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "style": style, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _structural_tag(answer: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": answer}


def _calls_format(tool_format: Any, tools: Sequence[ToolSpec], *, forced: bool, parallel: bool) -> dict[str, Any]:
    shape = _CALL_SHAPES.get(tool_format.name)
    if shape is None:
        raise InvalidRequest(f"tool calls in the {tool_format.name} format cannot be held to a schema",
                             param="tools")
    begin, end, style = shape
    tags = []
    for tool in tools:
        schema = (tool.parameters or _ANY_OBJECT) if forced or tool.strict else _ANY_OBJECT
        tags.append({"type": "tag", "begin": begin(tool.name), "content": _json_format(schema, style), "end": end})
    if forced:
        return {"type": "tags_with_separator", "tags": tags, "separator": _CALL_SEPARATOR, "at_least_one": True,
                "stop_after_first": not parallel}
    return {"type": "triggered_tags", "triggers": [OPENER], "tags": tags, "at_least_one": False,
            "stop_after_first": not parallel}


# format name -> (the text before the arguments, given the tool's name; the text after them; how they're written)
_CALL_SHAPES: dict[str, tuple[Callable[[str], str], str, str]] = {
    "hermes": (lambda name: f'{OPENER}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{CLOSER}", "json"),
    "qwen3_xml": (lambda name: f"{OPENER}\n<function={name}>\n", f"</function>\n{CLOSER}", "qwen_xml"),
}
