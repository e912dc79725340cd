"""Structured outputs, read from any dialect into one neutral `GrammarSpec` (ember.constraint_spec):
plain data that the server compiles (ember/grammar) and enforces token by token.

    OpenAI Chat and Completions   response_format {"type": "json_schema", "json_schema": {name, schema,
                                  strict}} | {"type": "json_object"} | {"type": "text"};
                                  vLLM's guided_json, guided_regex, guided_choice, guided_grammar and
                                  structured_outputs {json | json_object | regex | choice | grammar};
                                  llama.cpp's json_schema and grammar
    Responses text.format,        `read_flat_format` (or build a spec with `json_schema_spec` /
    Anthropic output_config.format  `json_object_spec`), then `check_grammar_with_tools` against the
                                  request's neutral tool choice

At most one of these fields may be set; each refusal names the field at fault.
"""

from __future__ import annotations

import json
from typing import Any

from ember.constraint_spec import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, GrammarSpec
from ember.errors import InvalidRequest
from ember.protocols.fields import Fields, as_string, json_type

MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 256 * 1024  # any one schema, pattern or grammar text

# Top-level fields (after response_format) and the kind each one holds.
_TOP_LEVEL = (("guided_json", JSON_SCHEMA), ("guided_regex", REGEX), ("guided_choice", CHOICE),
              ("guided_grammar", GRAMMAR), ("json_schema", JSON_SCHEMA), ("grammar", GRAMMAR))
_STRUCTURED_OUTPUTS = (("json", JSON_SCHEMA), ("json_object", JSON_OBJECT), ("regex", REGEX), ("choice", CHOICE),
                       ("grammar", GRAMMAR))


# ---- neutral builders (every dialect) -------------------------------------------------------------

def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    """A JSON schema given as an object (or JSON text holding one)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"{param} is not valid JSON: {exc}", param=param) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON schema object, not {json_type(schema)}", param=param)
    return _sized(GrammarSpec(JSON_SCHEMA, json.dumps(schema, ensure_ascii=False), param))


def json_object_spec(param: str) -> GrammarSpec:
    """Any JSON object."""
    return GrammarSpec(JSON_OBJECT, "", param)


def regex_spec(pattern: Any, param: str) -> GrammarSpec:
    return _sized(GrammarSpec(REGEX, as_string(pattern, param, non_empty=True), param))


def choice_spec(choices: Any, param: str) -> GrammarSpec:
    if not isinstance(choices, list):
        raise InvalidRequest(f"{param} must be an array of strings, not {json_type(choices)}", param=param)
    if not choices:
        raise InvalidRequest(f"{param} must hold at least one string", param=param)
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"{param} holds {len(choices)} strings; at most {MAX_CHOICES} are allowed",
                             param=param)
    for i, choice in enumerate(choices):
        as_string(choice, f"{param}[{i}]", non_empty=True)
    return _sized(GrammarSpec(CHOICE, json.dumps(choices, ensure_ascii=False), param))


def grammar_spec(text: Any, param: str) -> GrammarSpec:
    """An EBNF grammar (GBNF-style rules, `root` first)."""
    return _sized(GrammarSpec(GRAMMAR, as_string(text, param, non_empty=True), param))


def read_flat_format(fmt: Fields, *, allow_text: bool = True, allow_json_object: bool = True) -> GrammarSpec | None:
    """A format object with the schema at its top level, as the Responses API's `text.format`
    ({"type": "json_schema", "name", "schema", "description", "strict"} | {"type": "json_object"} |
    {"type": "text"}) and Anthropic's `output_config.format` ({"type": "json_schema", "schema"}) spell
    it. None for text."""
    kinds = (("text",) if allow_text else ()) + ((JSON_OBJECT,) if allow_json_object else ()) + (JSON_SCHEMA,)
    kind = fmt.string("type", choices=kinds)
    if kind is None:
        raise InvalidRequest(f"{fmt.path_of('type')} is required: {', '.join(kinds)}", param=fmt.path_of("type"))
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return json_object_spec(fmt.path)
    return _read_json_schema(fmt)


def _read_json_schema(spec: Fields) -> GrammarSpec:
    """{"name", "description", "strict", "schema"}: the schema is required, the rest checked for type."""
    spec.string("name")
    spec.string("description")
    spec.boolean("strict")
    schema = spec.raw("schema")
    if schema is None:
        raise InvalidRequest(f"{spec.path_of('schema')} is required: the JSON schema the reply must match",
                             param=spec.path_of("schema"))
    return json_schema_spec(schema, spec.path_of("schema"))


def check_grammar_with_tools(grammar: GrammarSpec | None, tool_choice: str, tool_choice_param: str = "tool_choice"
                             ) -> None:
    """A grammar for the answer and a forced tool call cannot both hold: refused. `tool_choice` is the
    neutral choice (auto, none, required, function)."""
    if grammar is not None and tool_choice in ("required", "function"):
        raise InvalidRequest(f"{grammar.param} cannot be combined with a {tool_choice_param} that forces a tool "
                             f"call: the reply would have to be both", param=grammar.param,
                             code="conflicting_constraints")


def _sized(spec: GrammarSpec) -> GrammarSpec:
    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"{spec.param} is {len(spec.text)} characters long; at most {MAX_GRAMMAR_CHARS} are "
                             "allowed", param=spec.param)
    return spec


# ---- OpenAI Chat Completions and Completions ------------------------------------------------------

def read_openai_structured(f: Fields) -> GrammarSpec | None:
    """The one constraint field of an OpenAI-style request (or None); two at once are refused."""
    found: list[GrammarSpec] = []
    response_format = f.object("response_format")
    if response_format is not None:
        spec = read_response_format(response_format)
        if spec is not None:
            found.append(spec)
    for name, kind in _TOP_LEVEL:
        if f.has(name):
            found.append(_read_kind(kind, f.raw(name), name))
    outputs = f.object("structured_outputs")
    if outputs is not None:
        spec = _read_structured_outputs(outputs)
        if spec is not None:
            found.append(spec)
    if len(found) > 1:
        raise InvalidRequest(f"{found[1].param} cannot be combined with {found[0].param}: send one structured "
                             "output constraint", param=found[1].param, code="conflicting_constraints")
    return found[0] if found else None


def read_response_format(rf: Fields) -> GrammarSpec | None:
    kind = rf.string("type", choices=("text", JSON_OBJECT, JSON_SCHEMA))
    if kind is None:
        raise InvalidRequest(f"{rf.path_of('type')} is required: text, json_object or json_schema",
                             param=rf.path_of("type"))
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return json_object_spec(rf.path)
    spec = rf.object("json_schema")
    if spec is None:
        raise InvalidRequest(f"{rf.path_of('json_schema')} is required for type json_schema",
                             param=rf.path_of("json_schema"))
    return _read_json_schema(spec)


def _read_structured_outputs(so: Fields) -> GrammarSpec | None:
    found = []
    for name, kind in _STRUCTURED_OUTPUTS:
        value = so.raw(name)
        if value is None or (kind == JSON_OBJECT and value is False):
            continue
        if kind == JSON_OBJECT:
            so.boolean(name)
        found.append(_read_kind(kind, value, so.path_of(name)))
    if len(found) > 1:
        raise InvalidRequest(f"{found[1].param} cannot be combined with {found[0].param}: set one kind of "
                             "structured output", param=found[1].param, code="conflicting_constraints")
    if not found and so.has("structural_tag"):
        raise InvalidRequest(f"{so.path_of('structural_tag')} is not supported; use json, regex, choice or grammar",
                             param=so.path_of("structural_tag"))
    return found[0] if found else None


def _read_kind(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == JSON_SCHEMA:
        return json_schema_spec(value, param)
    if kind == JSON_OBJECT:
        return json_object_spec(param)
    if kind == REGEX:
        return regex_spec(value, param)
    if kind == CHOICE:
        return choice_spec(value, param)
    return grammar_spec(value, param)
