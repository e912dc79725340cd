"""Custom tools with a grammar (as Codex declares apply_patch): the grammar holds the call's input
through xgrammar, as raw text where the model writes it so (the Qwen3 XML format) and as the body
of a JSON string where it writes JSON (hermes); a syntax or definition xgrammar cannot take is
refused by name. Matches run on xgrammar with the default model's tokenizer."""

from __future__ import annotations

import json

import pytest

from ember.constraint_spec import LARK, REGEX, GrammarSpec
from ember.errors import InvalidRequest
from ember.grammar.compiler import Grammars
from ember.grammar.realize import ConstraintBuilder
from ember.loaders import load_model_source
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.parsers.qwen3_xml import QWEN3_XML
from ember.protocols.chat_reply import ChatFeatures, plan_reply
from ember.protocols.grammar_plan import build_constraints
from ember.protocols.neutral import ModelInfo
from ember.protocols.openai_responses import parse_responses
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.protocols.unknown_fields import watch_fields
from ember.server.response_store import MemoryResponseStore
from ember.server.responses_routes import make_context

APPLY_PATCH = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change: (change_context | change_line)+
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
%import common.LF
"""
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello, world\n*** End Patch\n"
XML_MODEL = ModelInfo(name="served", max_model_len=2048, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), QWEN3_XML))
HERMES_MODEL = ModelInfo(name="served", max_model_len=2048, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))


def patch_tool(syntax="lark", definition=APPLY_PATCH) -> dict:
    return {"type": "custom", "name": "apply_patch", "description": "Edit files.",
            "format": {"type": "grammar", "syntax": syntax, "definition": definition}}


def parse(model=XML_MODEL, **fields):
    return parse_responses({"input": "Add hello.txt", **fields}, model, make_context(MemoryResponseStore(),
                                                                                     ReasoningSeal(b"k" * 32)))


def refusal(model=XML_MODEL, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(model, **fields)
    return caught.value


@pytest.fixture(scope="module")
def builder():
    tokenizer = load_model_source(None).tokenizer
    hf = tokenizer.hf
    return ConstraintBuilder(tokenizer.token_bytes, Grammars(hf, len(hf), [hf.eos_token_id]))


def constraint_spec(request, model=XML_MODEL):
    plan = plan_reply(request.chat, model.chat, "", None)
    return build_constraints(request, plan, True)


def xml_call(name: str, value: str) -> str:
    return f"<tool_call>\n<function={name}>\n<parameter=input>\n{value}\n</parameter>\n</function>\n</tool_call>"


def matches(builder, spec, text: str) -> bool:
    matcher = builder.grammars.matcher(builder.compile(spec))
    return matcher.accept_string(text)


def test_the_grammar_travels_with_the_tool_where_the_model_writes_raw_input():
    with watch_fields(False) as report:
        request = parse(tools=[patch_tool(), patch_tool("regex", r"[a-z]+") | {"name": "word"}])
    grammars = [tool.input_grammar for tool in request.chat.tools]
    assert grammars == [GrammarSpec(LARK, APPLY_PATCH, "tools[0].format.definition"),
                        GrammarSpec(REGEX, "[a-z]+", "tools[1].format.definition")]
    assert report.ignored == []
    assert "lark grammar" in request.prompt.tools[0]["function"]["description"]  # still shown to the model


def test_a_call_the_reply_opens_is_held_to_the_grammar(builder):
    spec = constraint_spec(parse(tools=[patch_tool()]))
    assert spec.grammar_param == "tools" and spec.checks == [(LARK, APPLY_PATCH, "tools[0].format.definition")]
    assert matches(builder, spec, "I will add it.\n" + xml_call("apply_patch", PATCH))
    assert not matches(builder, spec, xml_call("apply_patch", "just write hello.txt"))


def test_a_forced_regex_tool_is_held_to_its_pattern(builder):
    tool = patch_tool("regex", r"(ls|pwd)( -l)?") | {"name": "shell"}
    spec = constraint_spec(parse(tools=[tool], tool_choice={"type": "custom", "name": "shell"}))
    assert matches(builder, spec, xml_call("shell", "ls -l"))
    assert not matches(builder, spec, xml_call("shell", "rm -rf /"))
    assert not matches(builder, spec, "Sure.")  # forced: the call and nothing else


def test_a_definition_xgrammar_cannot_compile_is_refused_by_name(builder):
    for syntax, definition in (("lark", "start: ???"), ("regex", "a(")):
        spec = constraint_spec(parse(tools=[patch_tool(syntax, definition)]))
        with pytest.raises(InvalidRequest) as caught:
            builder.compile(spec)
        assert (caught.value.param, caught.value.code) == ("tools[0].format.definition", "invalid_grammar")


@pytest.mark.parametrize("fmt, param", [
    ({"type": "grammar", "syntax": "ebnf", "definition": "root ::= \"a\""}, "tools[0].format.syntax"),
    ({"type": "grammar", "syntax": "lark"}, "tools[0].format.definition"),
    ({"type": "grammar", "definition": ""}, "tools[0].format.definition"),
])
def test_a_grammar_xgrammar_cannot_take_is_refused_by_name(fmt, param):
    tool = {"type": "custom", "name": "apply_patch", "format": fmt}
    assert refusal(tools=[tool]).param == param
    assert refusal(HERMES_MODEL, tools=[tool]).param == param  # whatever format the model writes calls in


def hermes_call(name: str, value: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"input": value}}, ensure_ascii=False) + \
        "\n</tool_call>"


def test_where_the_model_writes_json_the_grammar_holds_the_string_s_body(builder):
    with watch_fields(False) as report:
        request = parse(HERMES_MODEL, tools=[{"type": "function", "name": "f"}, patch_tool()])
    assert [tool.input_grammar for tool in request.chat.tools] == [
        None, GrammarSpec(LARK, APPLY_PATCH, "tools[1].format.definition")]
    assert report.ignored == []
    spec = constraint_spec(request, HERMES_MODEL)
    assert matches(builder, spec, "I will add it.\n" + hermes_call("apply_patch", PATCH))
    assert not matches(builder, spec, hermes_call("apply_patch", "just write hello.txt"))
    raw = hermes_call("apply_patch", "").replace('""', '"' + PATCH + '"')  # newlines not escaped: not JSON
    assert not matches(builder, spec, raw)


def test_a_forced_hermes_call_is_held_to_its_regex_and_decodes_to_the_match(builder):
    tool = patch_tool("regex", r'(ls|echo "a\\b")( -l)?') | {"name": "shell"}
    request = parse(HERMES_MODEL, tools=[tool], tool_choice={"type": "custom", "name": "shell"})
    spec = constraint_spec(request, HERMES_MODEL)
    call = hermes_call("shell", 'echo "a\\b" -l')
    assert matches(builder, spec, call)
    assert not matches(builder, spec, hermes_call("shell", "rm -rf /"))
    tools = {t.name: t for t in request.chat.tools}
    body = call.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert json.loads(HERMES.parse(body, tools)[1]) == {"input": 'echo "a\\b" -l'}


def test_a_definition_xgrammar_cannot_read_is_refused_by_name_before_a_hermes_reply_runs():
    for syntax, definition in (("lark", "start: ???"), ("regex", "a(")):
        request = parse(HERMES_MODEL, tools=[patch_tool(syntax, definition)])
        with pytest.raises(InvalidRequest) as caught:
            constraint_spec(request, HERMES_MODEL)
        assert (caught.value.param, caught.value.code) == ("tools[0].format.definition", "invalid_grammar")


def test_without_xgrammar_a_grammar_tool_is_refused_with_the_install_command():
    request = parse(tools=[patch_tool()])
    plan = plan_reply(request.chat, XML_MODEL.chat, "", None)
    with pytest.raises(InvalidRequest) as caught:
        build_constraints(request, plan, False)
    assert caught.value.param == "tools[0].format.definition" and "pip install xgrammar" in caught.value.message


def test_the_input_a_held_call_carries_is_the_text_the_grammar_matched():
    request = parse(tools=[patch_tool()])
    tools = {tool.name: tool for tool in request.chat.tools}
    body = xml_call("apply_patch", PATCH).removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert QWEN3_XML.parse(body, tools) == ("apply_patch", json.dumps({"input": PATCH}))
