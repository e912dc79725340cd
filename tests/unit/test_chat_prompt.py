"""Fitting conversations to what a chat template can take, with the default model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.loaders import load_model_source
from ember.parsers.hermes import HERMES
from ember.parsers.qwen3_xml import QWEN3_XML
from ember.parsers.tool_prompt import prepare_conversation
from ember.protocols.neutral import ChatPrompt, encode_prompt
from ember.tokenization.chat_prompt import EFFORTS, TemplateTraits, probe_template

TEMPLATES = Path(__file__).parents[1] / "e2e" / "templates"
NO_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I need the tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_source(None).tokenizer


def with_template(tokenizer, text: str | None):
    tokenizer.chat_template = text
    tokenizer.__dict__.pop("template_traits", None)
    return tokenizer


def render(tokenizer, messages, tools=None, tool_format=HERMES, **kwargs) -> str:
    ids = encode_prompt(ChatPrompt(messages, kwargs, tools), tokenizer, tool_format)
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_probes_tell_what_each_template_takes(tokenizer):
    original = tokenizer.chat_template
    try:
        assert probe_template(with_template(tokenizer, original)) == TemplateTraits(False, True)
        assert probe_template(with_template(tokenizer, NO_SYSTEM)) == TemplateTraits(False, False)
        hermes = (TEMPLATES / "think_hermes.jinja").read_text()
        # it writes whatever effort it is given into the system turn, so it tells every effort apart; it
        # renders a system message at the start only (a later one would be lost)
        assert probe_template(with_template(tokenizer, hermes)) == TemplateTraits(True, True, EFFORTS, True)
    finally:
        with_template(tokenizer, original)


def test_tools_go_into_the_system_message_when_the_template_cannot_list_them(tokenizer):
    text = render(tokenizer, HISTORY, tools=[WEATHER])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert '"name": "get_weather"' in system and "<tools>" in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "..."}}\n</tool_call>' in system
    # History as text: the past call in the assistant turn, both results in one user turn.
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n21 C\n</tool_response>" in text


def test_past_calls_use_the_chosen_format(tokenizer):
    text = render(tokenizer, HISTORY, tools=[WEATHER], tool_format=QWEN3_XML)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>" in text


def test_a_template_that_refuses_system_gets_it_in_the_first_user_turn(tokenizer):
    original = tokenizer.chat_template
    try:
        text = render(with_template(tokenizer, NO_SYSTEM), HISTORY[:2], tools=[WEATHER])
    finally:
        with_template(tokenizer, original)
    assert "<|im_start|>system" not in text
    assert text.startswith("<|im_start|>user\nBe brief.\n\nYou may call functions")
    assert text.split("<|im_end|>")[0].endswith("Weather in Paris?")


def test_a_template_with_tools_gets_them_and_the_history_as_is(tokenizer):
    original = tokenizer.chat_template
    try:
        text = render(with_template(tokenizer, (TEMPLATES / "think_hermes.jinja").read_text()), HISTORY,
                      tools=[WEATHER], reasoning_effort="low")
    finally:
        with_template(tokenizer, original)
    assert "Think with low effort." in text and "Functions you may call" in text
    assert "<think>\nI need the tool.\n</think>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_the_callers_messages_are_not_changed():
    messages = [dict(m) for m in HISTORY]
    prepare_conversation(messages, [WEATHER], TemplateTraits(False, False), HERMES)
    assert messages == HISTORY


IMAGE = {"type": "image", "image": "an ImageRef"}


def test_list_contents_take_the_system_text_and_tool_results_in_order():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [IMAGE]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
                {"role": "tool", "content": [{"type": "text", "text": "map:"}, IMAGE], "tool_call_id": "c1"},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    prepared, _ = prepare_conversation(messages, [WEATHER], TemplateTraits(False, False), HERMES)
    assert prepared[0]["content"][1:] == [IMAGE]
    assert prepared[0]["content"][0]["text"].startswith("Be brief.\n\nYou may call functions")
    assert prepared[2] == {"role": "user", "content": [
        {"type": "text", "text": "<tool_response>\nmap:"}, IMAGE,
        {"type": "text", "text": "\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"}]}
    assert messages[1]["content"] == [IMAGE]  # the caller's messages are not changed
