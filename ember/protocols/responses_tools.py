"""Responses `tools` and `tool_choice`, validated into the neutral tool declarations.

    function    {"type": "function", name, description?, parameters?, strict?}: strict holds its calls'
                arguments to `parameters` (a grammar, see ember/grammar)
    namespace   {"type": "namespace", name, description?, tools: [function, ...]}: the model sees each as
                `NAMESPACE__name`; its calls come back with `namespace` and the function's own name
    custom      {"type": "custom", name, description?, format?}: free-form input; the model sees a function
                with one string parameter `input`, and its calls come back as custom_tool_call items with
                that input. A grammar format ({type: grammar, syntax: lark | regex, definition}) is shown
                in the description and, where the model writes that parameter as raw text (the Qwen3 XML
                call format), enforced by xgrammar on the input; where it writes JSON (hermes) it cannot
                be, and the format is listed in x-ember-ignored-fields
    hosted      web_search, file_search, computer use, code_interpreter, image_generation, mcp, ...: ember
                cannot run them, so they are not shown to the model; they stay accepted (Codex declares
                them), each listed in x-ember-ignored-fields and the request log as `tools[i]`, and logged
                once per request; forcing one through tool_choice is a 400
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from ember.constraint_spec import LARK, REGEX, GrammarSpec
from ember.errors import InvalidRequest
from ember.grammar.structural_tag import holds_input_grammar
from ember.parsers.events import CUSTOM_INPUT, ToolSpec
from ember.protocols.chat_reply import AUTO, FUNCTION, NONE, REQUIRED, declare_tool, tool_items, tool_name, tool_schema
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields
from ember.protocols.responses_items import visible_name
from ember.protocols.unknown_fields import note_ignored

logger = logging.getLogger("ember.server")

HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
                "file_search", "computer", "computer_use", "computer_use_preview", "code_interpreter",
                "image_generation", "mcp", "local_shell", "shell", "apply_patch", "tool_search")
GRAMMAR_SYNTAXES = {"lark": LARK, "regex": REGEX}  # a custom tool's grammar syntax -> its GrammarSpec kind


@dataclass(frozen=True, slots=True)
class ToolRef:
    """What a name the model calls stands for."""

    kind: str  # function | custom
    name: str  # the client's name
    namespace: str | None = None


@dataclass(slots=True)
class ResponsesTools:
    specs: list[ToolSpec] = field(default_factory=list)  # callable, in declaration order, as the model sees them
    refs: dict[str, ToolRef] = field(default_factory=dict)  # the model's name -> the client's tool
    echo: list[dict[str, Any]] = field(default_factory=list)  # tools as the response object repeats them
    hosted: list[str] = field(default_factory=list)  # declared types ember does not offer
    held_inputs: bool = False  # a custom tool's grammar can hold its input in the model's call format


def read_tools(f: Fields, tool_format: str | None) -> ResponsesTools:
    """`tool_format`: the name of the format the model writes calls in (None: tool calls are off)."""
    result = ResponsesTools(held_inputs=tool_format is not None and holds_input_grammar(tool_format))
    for i, raw in enumerate(tool_items(f)):
        tool = Fields(raw, f"tools[{i}]")
        kind = tool.string("type")
        if kind == "function":
            result.echo.append(_add_function(tool, None, result))
        elif kind == "custom":
            result.echo.append(_add_custom(tool, None, result))
        elif kind == "namespace":
            result.echo.append(_add_namespace(tool, result))
        elif kind in HOSTED_TOOLS:
            result.hosted.append(kind)
            result.echo.append(dict(raw))
            note_ignored(tool.path)
        elif kind is None:
            raise InvalidRequest(f"{tool.path_of('type')} is required", param=tool.path_of("type"))
        else:
            raise InvalidRequest(f"{tool.path_of('type')} is '{kind}', a tool type this server does not know",
                                 param=tool.path_of("type"))
    if result.hosted:
        logger.info("tools of type %s are not offered to the model: this server cannot run them",
                    ", ".join(sorted(set(result.hosted))))
    return result


def _register(tool: Fields, spec: ToolSpec, ref: ToolRef, result: ResponsesTools) -> None:
    declare_tool(result.specs, spec, tool)
    result.refs[spec.name] = ref


def _refuse_unsupported_options(tool: Fields) -> None:
    if tool.boolean("defer_loading", False):
        raise unsupported(tool.path_of("defer_loading"), "deferred tool loading needs tool search, which this server "
                                                    "does not run")
    callers = tool.array("allowed_callers")
    if callers is not None and "direct" not in callers:
        raise unsupported(tool.path_of("allowed_callers"), "the model calls tools directly here; allowed_callers must "
                                                      "include 'direct'")


def _add_function(tool: Fields, namespace: str | None, result: ResponsesTools) -> dict[str, Any]:
    name = tool_name(tool)
    _refuse_unsupported_options(tool)
    parameters = tool_schema(tool, "parameters", {})
    description = tool.string("description")
    strict = tool.boolean("strict", False)
    _register(tool, ToolSpec(visible_name(name, namespace), parameters, description, strict=strict),
              ToolRef("function", name, namespace), result)
    return {"type": "function", "name": name, "description": description, "parameters": tool.raw("parameters"),
            "strict": tool.boolean("strict")}


def _add_custom(tool: Fields, namespace: str | None, result: ResponsesTools) -> dict[str, Any]:
    name = tool_name(tool)
    _refuse_unsupported_options(tool)
    description = tool.string("description")
    fmt = tool.object("format")
    text = description or ""
    grammar = None
    if fmt is not None and fmt.string("type", choices=("text", "grammar")) == "grammar":
        grammar = _read_grammar(fmt)
        text += f"\n\nThe input must follow this {fmt.raw('syntax', 'lark')} grammar:\n{grammar.text}"
        if not result.held_inputs:
            note_ignored(fmt.path)  # shown to the model, but not enforced
            grammar = None
    parameters = {"type": "object", "properties": {CUSTOM_INPUT: {
        "type": "string", "description": "The tool's whole input, as free-form text."}}, "required": [CUSTOM_INPUT]}
    _register(tool, ToolSpec(visible_name(name, namespace), parameters, text.strip() or None, input_grammar=grammar),
              ToolRef("custom", name, namespace), result)
    return {"type": "custom", "name": name, "description": description,
            "format": dict(fmt.obj) if fmt is not None else {"type": "text"}}


def _read_grammar(fmt: Fields) -> GrammarSpec:
    syntax = fmt.string("syntax", "lark")
    if syntax not in GRAMMAR_SYNTAXES:
        raise unsupported(fmt.path_of("syntax"), f"{fmt.path_of('syntax')} is '{syntax}'; ember holds a custom tool's "
                                                 "input to a grammar with xgrammar, which takes lark or regex")
    definition = fmt.string("definition", non_empty=True)
    if definition is None:
        raise InvalidRequest(f"{fmt.path_of('definition')} is required for a grammar format",
                             param=fmt.path_of("definition"))
    return GrammarSpec(GRAMMAR_SYNTAXES[syntax], definition, fmt.path_of("definition"))


def _add_namespace(tool: Fields, result: ResponsesTools) -> dict[str, Any]:
    namespace = tool_name(tool)
    members = tool.array("tools", non_empty=True)
    if members is None:
        raise InvalidRequest(f"{tool.path_of('tools')} is required: the namespace's functions",
                             param=tool.path_of("tools"))
    echo = []
    for j, raw in enumerate(members):
        member = Fields(raw, f"{tool.path_of('tools')}[{j}]")
        kind = member.string("type", "function")
        if kind == "function":
            echo.append(_add_function(member, namespace, result))
        elif kind == "custom":
            echo.append(_add_custom(member, namespace, result))
        else:
            raise InvalidRequest(f"{member.path_of('type')} is '{kind}'; a namespace holds function or custom tools",
                                 param=member.path_of("type"))
    return {"type": "namespace", "name": namespace, "description": tool.string("description", ""), "tools": echo}


def unwrap_call(ref: ToolRef, arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote for it: its `input` string, else the
    arguments text as written (nothing is lost)."""
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(decoded, dict) and isinstance(decoded.get(CUSTOM_INPUT), str):
        return decoded[CUSTOM_INPUT]
    return arguments


# ---- tool_choice ------------------------------------------------------------------------------------

def read_tool_choice(f: Fields, tools: ResponsesTools) -> tuple[str, list[ToolSpec], Any]:
    """(the neutral choice, the tools the model may call, tool_choice as the response repeats it)."""
    raw = f.raw("tool_choice")
    callable_tools = list(tools.specs)
    if raw is None:
        return (AUTO if callable_tools else NONE), callable_tools, AUTO
    if isinstance(raw, str):
        if raw not in (NONE, AUTO, REQUIRED):
            raise InvalidRequest(f"tool_choice must be none, auto, required or an object; got '{raw}'",
                                 param="tool_choice")
        if raw == REQUIRED and not callable_tools:
            raise InvalidRequest("tool_choice 'required' needs at least one function or custom tool in tools"
                                 + (" (hosted tools cannot be run here)" if tools.hosted else ""),
                                 param="tool_choice")
        return raw, callable_tools, raw
    choice = Fields(raw, "tool_choice")
    kind = choice.string("type")
    if kind in ("function", "custom"):
        return FUNCTION, [_chosen(choice, tools, kind)], dict(raw)
    if kind == "allowed_tools":
        mode = choice.string("mode", AUTO, choices=(AUTO, REQUIRED))
        entries = choice.array("tools", non_empty=True)
        if entries is None:
            raise InvalidRequest("tool_choice.tools is required", param="tool_choice.tools")
        chosen = []
        for j, entry in enumerate(entries):
            item = Fields(entry, f"tool_choice.tools[{j}]")
            item_kind = item.string("type", "function")
            if item_kind in ("function", "custom"):
                chosen.append(_chosen(item, tools, item_kind))
            elif item_kind in HOSTED_TOOLS:
                note_ignored(item.path)
            else:
                raise InvalidRequest(f"{item.path_of('type')} is '{item_kind}', not a tool type this server knows",
                                     param=item.path_of("type"))
        if not chosen and mode == REQUIRED:
            raise unsupported("tool_choice.tools", "tool_choice requires a call to hosted tools only, which this "
                                                   "server cannot run")
        return (mode if chosen else NONE), chosen, dict(raw)
    if kind in HOSTED_TOOLS:
        raise unsupported("tool_choice", f"tool_choice forces the hosted tool '{kind}', which this server "
                                         "cannot run")
    if kind is None:
        raise InvalidRequest("tool_choice.type is required", param="tool_choice.type")
    raise InvalidRequest(f"tool_choice.type is '{kind}'; use function, custom or allowed_tools",
                         param="tool_choice.type")


def _chosen(choice: Fields, tools: ResponsesTools, kind: str) -> ToolSpec:
    name = choice.string("name")
    namespace = choice.string("namespace")
    if name is None:
        raise InvalidRequest(f"{choice.path_of('name')} is required", param=choice.path_of("name"))
    for spec in tools.specs:
        ref = tools.refs[spec.name]
        if ref.kind == kind and (ref.name, ref.namespace) == (name, namespace):
            return spec
        if ref.kind == kind and namespace is None and spec.name == name:  # the name the model sees
            return spec
    where = f" in namespace '{namespace}'" if namespace else ""
    raise InvalidRequest(f"{choice.path_of('name')} names the {kind} tool '{name}'{where}, which is not among the "
                         "declared tools", param=choice.path_of("name"))
