"""Structured outputs on the Responses and Anthropic Messages routes, through the official clients:
Responses `text.format` (json_schema, json_object), Anthropic `output_config.format`, and forced and
strict tool calls whose arguments validate against the tool's schema, whole and streamed."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.e2e.conftest import wait_idle
from tests.e2e.responses_stream import check_stream as check_responses_stream, raw_events
from tests.e2e.test_anthropic import check_stream as check_messages_stream

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
INVENTORY = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 15},
                                     "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"],
    "additionalProperties": False}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
               "required": ["city", "hours"], "additionalProperties": False}
PARAMETERS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = "What is the weather in Paris?"


def assert_valid_call(name: str, arguments: str | dict, names) -> None:
    assert name in names, name
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, PARAMETERS[name])


# ---- Responses ----------------------------------------------------------------------------------------

def responses_tools(strict: bool) -> list[dict]:
    return [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
             "parameters": WEATHER_PARAMS, "strict": strict},
            {"type": "function", "name": "get_time", "description": "Get the local time in a city",
             "parameters": TIME_PARAMS, "strict": strict}]


def respond(client, model_id, prompt: str, **fields):
    fields = {"temperature": 0, "max_output_tokens": 160, **fields}
    return client.responses.create(model=model_id, input=prompt, **fields)


@pytest.mark.parametrize("name, schema, prompt", [
    ("person", PERSON, "Describe a famous scientist as JSON."),
    ("inventory", INVENTORY, "List what is in a small kitchen as JSON."),
])
def test_responses_text_format_json_schema_is_honoured_whole_and_streamed(client, http, model_id, name, schema,
                                                                          prompt):
    fmt = {"type": "json_schema", "name": name, "description": f"A {name}", "schema": schema, "strict": True}
    reply = respond(client, model_id, prompt, text={"format": fmt})
    assert reply.status == "completed", reply.incomplete_details
    jsonschema.validate(json.loads(reply.output_text), schema)
    echoed = reply.text.format
    assert (echoed.type, echoed.name, echoed.description, echoed.strict) == ("json_schema", name, f"A {name}", True)
    assert echoed.schema_ == schema

    events = list(respond(client, model_id, prompt, text={"format": fmt}, stream=True))
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == reply.output_text == events[-1].response.output_text
    final = check_responses_stream(raw_events(http, {"model": model_id, "input": prompt, "temperature": 0,
                                                     "max_output_tokens": 160, "text": {"format": fmt}}))
    assert final["status"] == "completed" and final["text"]["format"] == fmt
    assert final["output"][-1]["content"][0]["text"] == text
    wait_idle(http)


def test_responses_text_format_json_object_parses(client, model_id):
    # A prompt with a short object to copy: the model ends it in about ten tokens, far inside the
    # limit, whatever a processor's rounding does to its choices (an open-ended prompt can keep a
    # small model adding keys past any limit, which says nothing about the format).
    reply = respond(client, model_id, 'Answer with a JSON object like {"ok": true}.',
                    text={"format": {"type": "json_object"}}, max_output_tokens=200)
    assert reply.text.format.type == "json_object"
    assert reply.status == "completed", reply.output_text
    assert isinstance(json.loads(reply.output_text), dict)


@pytest.mark.parametrize("tool_choice, strict, names", [
    ("required", False, {"get_weather", "get_time"}),
    ("required", True, {"get_weather", "get_time"}),
    ({"type": "function", "name": "get_time"}, True, {"get_time"}),
])
def test_responses_forced_and_strict_calls_carry_schema_valid_arguments(client, model_id, tool_choice, strict,
                                                                        names):
    fields = {"tools": responses_tools(strict), "tool_choice": tool_choice, "parallel_tool_calls": False}
    reply = respond(client, model_id, ASK, **fields)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls, reply.output
    for call in calls:
        assert_valid_call(call.name, call.arguments, names)
    assert [t.strict for t in reply.tools] == [strict, strict]

    events = list(respond(client, model_id, ASK, stream=True, **fields))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]


def test_responses_strict_tool_under_auto_is_held_to_its_schema(client, model_id):
    reply = respond(client, model_id, "Call get_weather for Paris.", tools=responses_tools(True)[:1])
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls, reply.output
    for call in calls:
        assert_valid_call(call.name, call.arguments, {"get_weather"})


def test_responses_grammar_with_a_forced_call_is_refused(http, model_id):
    reply = http.post("/v1/responses", json={
        "model": model_id, "input": ASK, "tools": responses_tools(True), "tool_choice": "required",
        "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON}}})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "text.format.schema"


# ---- Anthropic Messages ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def anthropic_tools(strict: bool) -> list[dict]:
    return [{"name": "get_weather", "description": "Get the current weather in a city",
             "input_schema": WEATHER_PARAMS, "strict": strict},
            {"name": "get_time", "description": "Get the local time in a city", "input_schema": TIME_PARAMS,
             "strict": strict}]


def message(claude, prompt: str, *, stream: bool = False, **fields):
    body = {"model": "ember-local", "max_tokens": 160, "messages": [{"role": "user", "content": prompt}], **fields}
    extra = {"temperature": 0, **body.pop("extra_body", {})}
    if not stream:
        return claude.messages.create(extra_body=extra, **body).to_dict()
    with claude.messages.create(stream=True, extra_body=extra, **body) as events:
        return check_messages_stream([event.to_dict() for event in events])


@pytest.mark.parametrize("schema, prompt", [
    (PERSON, "Describe a famous scientist as JSON."),
    (INVENTORY, "List what is in a small kitchen as JSON."),
])
def test_anthropic_output_config_format_is_honoured_whole_and_streamed(claude, http, schema, prompt):
    fmt = {"type": "json_schema", "schema": schema}
    whole = message(claude, prompt, output_config={"format": fmt})
    assert whole["stop_reason"] == "end_turn"
    [block] = whole["content"]
    jsonschema.validate(json.loads(block["text"]), schema)
    streamed = message(claude, prompt, stream=True, output_config={"format": fmt})
    assert streamed["stop_reason"] == "end_turn" and streamed["content"] == whole["content"]
    older = message(claude, prompt, extra_body={"output_format": fmt})  # the field's earlier name
    assert older["content"] == whole["content"]
    wait_idle(http)


@pytest.mark.parametrize("tool_choice, strict, names", [
    ({"type": "any"}, False, {"get_weather", "get_time"}),
    ({"type": "any"}, True, {"get_weather", "get_time"}),
    ({"type": "tool", "name": "get_time"}, True, {"get_time"}),
])
def test_anthropic_forced_and_strict_calls_carry_schema_valid_input(claude, tool_choice, strict, names):
    fields = {"tools": anthropic_tools(strict),
              "tool_choice": {**tool_choice, "disable_parallel_tool_use": True}}
    whole = message(claude, ASK, **fields)
    assert whole["stop_reason"] == "tool_use"
    uses = [block for block in whole["content"] if block["type"] == "tool_use"]
    assert uses, whole["content"]
    for use in uses:
        assert_valid_call(use["name"], use["input"], names)
    streamed = message(claude, ASK, stream=True, **fields)
    assert streamed["stop_reason"] == "tool_use"
    assert [(b["name"], b["input"]) for b in streamed["content"] if b["type"] == "tool_use"] == \
        [(u["name"], u["input"]) for u in uses]


def test_anthropic_grammar_with_a_forced_call_is_refused(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        message(claude, ASK, tools=anthropic_tools(True), tool_choice={"type": "any"},
                output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert "output_config.format" in caught.value.body["error"]["message"]
