"""Structured outputs with thinking on, on ember's Qwen3-style hermes test template: the reply reasons
first, and the grammar holds the answer after the think block closes (a thinking budget's forced
close counts as that point)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMS, "strict": True}}
QUESTION = [{"role": "user", "content": "Give me a person as JSON."}]


@pytest.fixture(scope="module")
def chat(thinking_server):
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def create(**fields):
        fields = {"messages": QUESTION, "temperature": 0, "max_tokens": 160, **fields}
        return client.chat.completions.create(model=model, **fields)
    return create


def joined(stream) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning, content


@pytest.mark.parametrize("budget", [None, 4])
def test_the_json_comes_after_the_reasoning(chat, budget):
    extra = {"thinking_budget": budget} if budget else {}
    whole = chat(response_format=FORMAT, extra_body=extra)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop", message.content
    assert message.reasoning_content, "the prompt opened a think block: the reply reasons first"
    assert "</think>" not in message.content
    jsonschema.validate(json.loads(message.content), PERSON)
    assert whole.usage.completion_tokens_details.reasoning_tokens > 0

    reasoning, content = joined(chat(response_format=FORMAT, extra_body=extra, stream=True))
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_with_thinking_off_the_grammar_holds_the_whole_reply(chat):
    whole = chat(response_format=FORMAT, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = whole.choices[0].message
    assert not message.reasoning_content
    jsonschema.validate(json.loads(message.content), PERSON)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_strict_call_after_the_reasoning_has_schema_valid_arguments(chat, tool_choice):
    fields = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
              "tool_choice": tool_choice, "parallel_tool_calls": False, "extra_body": {"thinking_budget": 4}}
    whole = chat(**fields)
    message = whole.choices[0].message
    assert message.reasoning_content
    assert whole.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
