"""Tool calls end to end on the default model, whose own template cannot list tools: ember describes
them in the system message, forces the call when asked, and reads the hermes format back."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import wait_idle

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
DECLARED = {"get_weather", "get_time"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def call(client, model_id, **fields):
    fields = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 64, **fields}
    return client.chat.completions.create(model=model_id, **fields)


def streamed_calls(client, model_id, **fields) -> tuple[dict[int, dict], str, str]:
    """(calls by index with id, name and joined arguments, content, finish_reason) of a stream."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in call(client, model_id, stream=True, **fields):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"ids": set(), "name": "", "arguments": "", "pieces": 0})
            if delta.id:
                entry["ids"].add(delta.id)
            if delta.function and delta.function.name:
                assert not entry["arguments"], "the name comes before any argument piece"
                entry["name"] += delta.function.name
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
                entry["pieces"] += 1
        finish = choice.finish_reason or finish
    return calls, content, finish


@pytest.mark.parametrize("question, tool_choice, expected", [
    ("What is the weather in Paris?", "required", DECLARED),
    ("What time is it in Paris right now?", {"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_a_forced_call_names_a_declared_tool_with_json_arguments(client, model_id, http, question, tool_choice,
                                                                 expected):
    messages = [{"role": "user", "content": question}]
    whole = call(client, model_id, tool_choice=tool_choice, messages=messages)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) >= 1
    first = choice.message.tool_calls[0]
    assert first.type == "function" and first.id.startswith("call_")
    assert first.function.name in expected
    assert isinstance(json.loads(first.function.arguments), dict)

    calls, content, finish = streamed_calls(client, model_id, tool_choice=tool_choice, messages=messages)
    assert finish == "tool_calls"
    assert content == (choice.message.content or "")
    assert sorted(calls) == list(range(len(calls)))
    for index, streamed in calls.items():
        expected_call = choice.message.tool_calls[index]
        assert len(streamed["ids"]) == 1, "one id per call, sent once"
        assert streamed["name"] == expected_call.function.name
        assert streamed["arguments"] == expected_call.function.arguments
    wait_idle(http)


def test_tool_choice_none_gives_no_call(client, model_id):
    reply = call(client, model_id, tool_choice="none")
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_tool_round_trip_renders_and_answers(client, model_id):
    first = call(client, model_id, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    made = first.choices[0].message.tool_calls[0]
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": made.id, "type": "function",
                    "function": {"name": made.function.name, "arguments": made.function.arguments}}]},
               {"role": "tool", "tool_call_id": made.id, "content": json.dumps({"sky": "sunny", "celsius": 21})}]
    answer = call(client, model_id, messages=history, max_tokens=32)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert message.content or message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result reached the prompt


def test_the_legacy_function_role_renders_as_a_tool_result(client, model_id):
    history = [*ASK, {"role": "assistant", "content": "Let me look.",
                      "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "function", "name": "get_weather", "content": "sunny"}]
    reply = call(client, model_id, messages=history, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
