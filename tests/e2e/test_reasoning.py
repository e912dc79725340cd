"""Reasoning end to end with ember's two Qwen3-style test templates on the default model file: the
prompt opens a think block, ember reads it into reasoning_content, closes it when the budget is spent,
and forces tool calls after it."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import THINKING_BUDGET as DEFAULT_BUDGET

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OPENERS = {"think_hermes": '<tool_call>\n{"name": "get_weather"', "think_xml": "<tool_call>\n<function=get_weather>"}


@pytest.fixture(scope="module", params=["thinking_server", "thinking_xml_server"])
def reasoning_server(request):
    return request.getfixturevalue(request.param)  # the shared ones


@pytest.fixture(scope="module")
def close_tokens() -> int:
    """Tokens of the text ember writes to close a think block."""
    from ember.loaders import load_model_source
    return len(load_model_source(None).tokenizer.encode("\n</think>\n\n"))


@pytest.fixture(scope="module")
def chat(reasoning_server):
    import openai
    client = openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def create(**fields):
        fields = {"messages": QUESTION, "temperature": 0, "max_tokens": 48, **fields}
        return client.chat.completions.create(model=model, **fields)
    return create


def joined_stream(chat, **fields) -> tuple[str, str, int]:
    reasoning = content = ""
    usage = None
    for chunk in chat(stream=True, stream_options={"include_usage": True}, **fields):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning, content, usage.completion_tokens_details.reasoning_tokens


@pytest.mark.parametrize("budget", [4, None])
def test_reasoning_is_separated_and_held_to_the_budget(chat, close_tokens, budget):
    extra = {"thinking_budget": budget} if budget else {}
    whole = chat(extra_body=extra)
    message = whole.choices[0].message
    reasoning_tokens = whole.usage.completion_tokens_details.reasoning_tokens
    assert message.reasoning_content, "the prompt opened a think block, so the reply starts in it"
    assert "<think>" not in message.reasoning_content and "</think>" not in message.reasoning_content
    assert not (message.content or "").startswith("</think>")
    assert 0 < reasoning_tokens <= (budget or DEFAULT_BUDGET) + close_tokens
    assert reasoning_tokens <= whole.usage.completion_tokens

    reasoning, content, streamed_tokens = joined_stream(chat, extra_body=extra)
    assert reasoning == message.reasoning_content
    assert content == (message.content or "")
    assert streamed_tokens == reasoning_tokens


def test_reasoning_effort_none_gives_no_reasoning(chat):
    whole = chat(extra_body={"reasoning_effort": "none"})
    assert whole.choices[0].message.reasoning_content is None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    assert whole.choices[0].message.content


def test_a_required_call_opens_once_the_reasoning_is_closed(chat, reasoning_server):
    """The small model may write arguments the format cannot read; the forced opener and name are
    ember's, so the reply holds a call to the declared tool either way."""
    whole = chat(tools=[WEATHER], tool_choice="required", max_tokens=96, extra_body={"thinking_budget": 4})
    message = whole.choices[0].message
    assert message.reasoning_content
    if message.tool_calls:
        assert message.tool_calls[0].function.name == "get_weather"
        assert whole.choices[0].finish_reason == "tool_calls"
    else:
        assert message.content.startswith(OPENERS[reasoning_server.template])
