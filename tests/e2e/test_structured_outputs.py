"""Structured outputs end to end on the default model: JSON schemas, JSON objects, regexes, choices and
EBNF grammars in Chat Completions and Completions, schema-valid forced and strict tool calls, and the
refusals, through the openai client."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.e2e.conftest import wait_idle

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                                                  "email": {"type": "string", "maxLength": 30}},
                 "required": ["id"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                       "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "bounds": {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                                "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
               "required": ["temperature", "humidity"]},
    "optional": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                  "subtitle": {"type": "string", "maxLength": 30},
                                                  "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
                 "required": ["title"]},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                                           "y": {"type": "integer", "minimum": -99, "maximum": 99}},
                                "required": ["x", "y"]}},
            "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"]},
    "objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 15},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["name", "qty"]}}}, "required": ["items"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5},
    "union": {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"const": "report"},
                                               "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                                                                   {"type": "null"}]}},
              "required": ["ok", "kind", "score"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "string", "enum": ["x", "y"]}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
               "required": ["city", "hours"]}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city",
                                         "parameters": TIME_PARAMS}}
PARAMETERS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
EBNF = 'root ::= greeting " " name "!"\ngreeting ::= "Hello" | "Hi"\nname ::= [A-Z] [a-z]{0,10}'
EBNF_AS_REGEX = r"(Hello|Hi) [A-Z][a-z]{0,10}!"


def chat(client, model_id, content: str, **fields):
    fields = {"temperature": 0, "max_tokens": 200, **fields}
    return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": content}], **fields)


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_every_reply_parses_and_validates_against_its_schema(client, model_id, http):
    def ask(name):
        return name, chat(client, model_id, f"Reply with a JSON value for '{name}'.", response_format=schema_format(name))

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch: the grammars share the engine's steps
        replies = dict(pool.map(ask, SCHEMAS))
    unfinished = {name: r.choices[0].message.content for name, r in replies.items()
                  if r.choices[0].finish_reason != "stop"}
    assert not unfinished
    for name, reply in replies.items():
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[name])
    wait_idle(http)


def test_a_streamed_reply_equals_the_whole_one(client, model_id):
    whole = chat(client, model_id, "Describe a user.", response_format=schema_format("nested"))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in
                   chat(client, model_id, "Describe a user.", response_format=schema_format("nested"), stream=True)
                   if chunk.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"extra_body": {"structured_outputs": {"json_object": True}}},
])
def test_json_object_replies_parse_as_objects(client, model_id, fields):
    reply = chat(client, model_id, "Give me a JSON object with the keys name and age of a person.", **fields)
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("field", ["guided_regex", "structured_outputs"])
def test_regex_replies_match(client, model_id, field):
    pattern = r"[0-9]{3}-[0-9]{4}"
    body = {"guided_regex": pattern} if field == "guided_regex" else {"structured_outputs": {"regex": pattern}}
    reply = chat(client, model_id, "Give me a phone number.", extra_body=body)
    assert re.fullmatch(pattern, reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"


def test_choice_replies_are_one_of_the_choices(client, model_id):
    choices = ["sunny", "rainy", "cloudy with a chance of rain"]
    for question in ("What is the weather like?", "Is it going to rain?"):
        reply = chat(client, model_id, question, extra_body={"guided_choice": choices})
        assert reply.choices[0].message.content in choices


@pytest.mark.parametrize("field", ["guided_grammar", "grammar"])
def test_an_ebnf_reply_is_a_sentence_of_the_grammar(client, model_id, field):
    reply = chat(client, model_id, "Greet me.", extra_body={field: EBNF})
    assert re.fullmatch(EBNF_AS_REGEX, reply.choices[0].message.content)


def test_completions_take_the_same_fields(client, model_id):
    reply = client.completions.create(model=model_id, prompt="A person as JSON:", temperature=0, max_tokens=120,
                                      extra_body={"guided_json": SCHEMAS["person"]})
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMAS["person"])
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt="The answer is", temperature=0, max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}}) if c.choices)
    assert text in ("yes", "no")


def test_a_reply_cut_by_max_tokens_is_length(client, model_id):
    reply = chat(client, model_id, "Describe a user.", response_format=schema_format("nested"), max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


# ---- tool calls ---------------------------------------------------------------------------------

def streamed_call(client, model_id, **fields) -> tuple[list[tuple[str, str]], str]:
    """([(name, arguments)] of a stream's calls, its finish_reason)."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chat(client, model_id, stream=True, **fields):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += (delta.function.name or "") if delta.function else ""
                entry[1] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def assert_valid_calls(calls, expected_names):
    assert calls, "the reply holds a call"
    for name, arguments in calls:
        assert name in expected_names
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize("tool_choice, strict, names", [
    ("required", False, {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, False, {"get_time"}),
    ("required", True, {"get_weather", "get_time"}),
])
def test_forced_and_strict_calls_carry_schema_valid_arguments(client, model_id, tool_choice, strict, names):
    tools = [{**t, "function": {**t["function"], "strict": strict}} for t in (WEATHER, TIME)]
    fields = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": False, "max_tokens": 120}
    whole = chat(client, model_id, "What is the weather in Paris?", **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert_valid_calls(calls, names)
    streamed, finish = streamed_call(client, model_id, content="What is the weather in Paris?", **fields)
    assert finish == "tool_calls"
    assert streamed == calls


def test_a_strict_tool_under_auto_is_accepted_and_held_to_its_schema(client, model_id):
    tools = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]
    reply = chat(client, model_id, "Call get_weather for Paris.", tools=tools, max_tokens=120)
    choice = reply.choices[0]
    assert choice.message.tool_calls, choice.message.content
    assert_valid_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
                       {"get_weather"})


def test_a_grammar_beside_auto_tools_gives_either_a_call_or_the_grammar(client, model_id):
    reply = chat(client, model_id, "Is it sunny in Paris?", tools=[WEATHER],
                 extra_body={"guided_choice": ["yes", "no"]})
    message = reply.choices[0].message
    if message.tool_calls:
        assert_valid_calls([(c.function.name, c.function.arguments) for c in message.tool_calls], {"get_weather"})
    else:
        assert message.content in ("yes", "no")


# ---- refusals -----------------------------------------------------------------------------------

def refused(http, model_id, path: str, body: dict) -> dict:
    reply = http.post(path, json={"model": model_id, **body})
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


ASK = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
     "response_format.json_schema.schema", "could not be compiled"),
    ({"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar", "could not be compiled"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "cannot be combined"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs.choice", "cannot be combined"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"},
     "response_format", "forces a tool call"),
    ({"guided_choice": ["a"], "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}},
     "guided_choice", "forces a tool call"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True,
                                         "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}]},
     "tools", "could not be compiled"),
])
def test_chat_refusals_name_the_field(http, model_id, body, param, words):
    error = refused(http, model_id, "/v1/chat/completions", {**ASK, **body})
    assert error["param"] == param
    assert words in error["message"]
    streamed = refused(http, model_id, "/v1/chat/completions", {**ASK, **body, "stream": True})
    assert streamed["param"] == param


def test_completions_refusals_name_the_field(http, model_id):
    error = refused(http, model_id, "/v1/completions", {"prompt": "Hi", "guided_regex": "[", "max_tokens": 4})
    assert error["param"] == "guided_regex"
    error = refused(http, model_id, "/v1/completions", {"prompt": "Hi", "guided_choice": ["a"], "grammar": "root"})
    assert error["param"] == "grammar"


def test_the_openai_client_sees_a_bad_request(client, model_id):
    with pytest.raises(openai.BadRequestError):
        chat(client, model_id, "Hi", extra_body={"guided_regex": "(("})
