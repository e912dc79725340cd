"""Structured-output fields read into the neutral GrammarSpec; every refusal names its field."""

from __future__ import annotations

import json

import pytest

from ember.errors import InvalidRequest
from ember.grammar.compiler import choice_ebnf, compiler_reason, grammar_unavailable
from ember.protocols.grammar_plan import build_constraints
from ember.parsers.events import ToolSpec
from ember.parsers.hermes import HERMES
from ember.protocols.chat_reply import ChatFeatures, ChatOptions, plan_reply
from ember.protocols.fields import Fields
from ember.protocols.neutral import ChatPrompt, GenerationRequest, TextPrompt
from ember.protocols.structured import (
    check_grammar_with_tools, json_object_spec, json_schema_spec, read_openai_structured,
)
from ember.types import SamplingParams

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def read(body):
    return read_openai_structured(Fields(body))


def refusal(body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        read(body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("body, kind, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", "guided_json"),
    ({"guided_regex": r"\d+"}, "regex", "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
    ({"json_schema": SCHEMA}, "json_schema", "json_schema"),
    ({"grammar": 'root ::= "a"'}, "grammar", "grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "structured_outputs.grammar"),
])
def test_each_field_reads_into_one_spec(body, kind, param):
    spec = read(body)
    assert (spec.kind, spec.param) == (kind, param)


def test_a_schema_keeps_its_property_order():
    spec = read({"guided_json": SCHEMA})
    assert list(json.loads(spec.text)["properties"]) == ["b", "a"]


def test_text_and_absent_formats_are_no_constraint():
    assert read({"response_format": {"type": "text"}}) is None
    assert read({}) is None
    assert read({"structured_outputs": {"json_object": False}}) is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
])
def test_two_constraints_at_once_are_refused(body, param):
    error = refusal(body)
    assert error.param == param and error.code == "conflicting_constraints"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice[1]"),
    ({"guided_grammar": ["root"]}, "guided_grammar"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
])
def test_malformed_fields_are_refused_by_name(body, param):
    assert refusal(body).param == param


def test_a_grammar_with_a_forced_tool_choice_is_refused():
    spec = json_object_spec("response_format")
    for choice in ("required", "function"):
        with pytest.raises(InvalidRequest) as caught:
            check_grammar_with_tools(spec, choice)
        assert caught.value.param == "response_format"
    check_grammar_with_tools(spec, "auto")
    check_grammar_with_tools(None, "required")


def test_without_xgrammar_a_grammar_is_refused_naming_the_install_command():
    job = GenerationRequest(TextPrompt("x"), SamplingParams(), grammar=json_schema_spec(SCHEMA, "guided_json"))
    with pytest.raises(InvalidRequest) as caught:
        build_constraints(job, None, False)
    assert caught.value.param == "guided_json"
    assert "pip install xgrammar" in caught.value.message
    assert "pip install xgrammar" in grammar_unavailable("tools").message


def test_without_xgrammar_a_strict_tool_is_refused_and_a_forced_call_falls_back():
    strict = ToolSpec("f", {"type": "object"}, None, strict=True)
    loose = ToolSpec("f", {"type": "object"})
    features = ChatFeatures(tool_format=HERMES)
    for tool, choice, refused in ((strict, "auto", True), (loose, "required", False), (loose, "auto", False)):
        options = ChatOptions(tools=(tool,), tool_choice=choice)
        job = GenerationRequest(ChatPrompt([]), SamplingParams(), chat=options)
        plan = plan_reply(options, features, "", None)
        if refused:
            with pytest.raises(InvalidRequest) as caught:
                build_constraints(job, plan, False)
            assert caught.value.param == "tools"
        else:
            assert build_constraints(job, plan, False) is None


def test_choices_become_an_ebnf_of_quoted_strings():
    assert choice_ebnf(["yes", 'say "hi"\n']) == 'root ::= "yes" | "say \\"hi\\"\\n"'


def test_compiler_messages_lose_their_log_prefix():
    error = RuntimeError("[12:54:33] /project/cpp/regex_converter.cc:94: Regex parsing error at position 4: "
                         "The parenthesis is not closed.\n")
    assert compiler_reason(error) == "Regex parsing error at position 4: The parenthesis is not closed."


def test_chat_and_completions_requests_carry_the_spec_and_strict_tools():
    from ember.protocols.neutral import ModelInfo
    from ember.protocols.openai_chat import parse_chat
    from ember.protocols.openai_completions import parse_completion

    model = ModelInfo(name="m", max_model_len=1024, vocab_size=1000, chat=ChatFeatures(tool_format=HERMES))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                       "response_format": {"type": "json_object"}}, model)
    assert chat.grammar.kind == "json_object" and chat.chat.tools[0].strict
    completion = parse_completion({"prompt": "hi", "guided_choice": ["a", "b"]}, model)
    assert completion.grammar.kind == "choice" and json.loads(completion.grammar.text) == ["a", "b"]


def test_flat_formats_of_the_other_dialects():
    from ember.protocols.structured import read_flat_format

    spec = read_flat_format(Fields({"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True},
                                   "text.format"))
    assert (spec.kind, spec.param) == ("json_schema", "text.format.schema")
    assert read_flat_format(Fields({"type": "json_object"}, "text.format")).param == "text.format"
    assert read_flat_format(Fields({"type": "text"}, "text.format")) is None
    for body, param, options in (
            ({"type": "json_schema"}, "output_config.format.schema", {}),
            ({"type": "json_object"}, "output_config.format.type", {"allow_json_object": False, "allow_text": False}),
            ({}, "output_config.format.type", {}),
            ({"type": "json_schema", "schema": {}, "name": 3}, "output_config.format.name", {})):
        with pytest.raises(InvalidRequest) as caught:
            read_flat_format(Fields(body, "output_config.format"), **options)
        assert caught.value.param == param
