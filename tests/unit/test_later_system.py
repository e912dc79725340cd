"""A system message after the start of a conversation, for a template that takes one at the start
only: it becomes a user turn that says it is a system message, instead of a refusal. With the
default model's tokenizer."""

from __future__ import annotations

import pytest

from ember.loaders import load_model_source
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.parsers.tool_prompt import prepare_conversation
from ember.protocols.anthropic_messages import parse_messages
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.neutral import ChatPrompt, ModelInfo, encode_prompt
from ember.tokenization.chat_prompt import TemplateTraits, probe_template

# As Qwen3.5's template does: a system message anywhere but first is refused.
LEADING_SYSTEM_ONLY = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL = ModelInfo(name="served", max_model_len=2048, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))
TRAITS = TemplateTraits(takes_tools=False, takes_system=True, later_system_refused=True)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = load_model_source(None).tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = LEADING_SYSTEM_ONLY
    tokenizer.__dict__.pop("template_traits", None)
    yield tokenizer
    tokenizer.chat_template = original
    tokenizer.__dict__.pop("template_traits", None)


def render(tokenizer, messages) -> str:
    return tokenizer.decode(encode_prompt(ChatPrompt(messages, {}), tokenizer), skip_special_tokens=False)


def test_the_probe_tells_a_template_that_takes_a_system_message_at_the_start_only(tokenizer):
    assert probe_template(tokenizer).later_system_refused is True


def test_leading_system_messages_join_and_a_later_one_leads_the_next_user_turn(tokenizer):
    text = render(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be kind."},
                              {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                              {"role": "system", "content": "Answer in French now."},
                              {"role": "user", "content": "How are you?"}])
    assert text == ("<|im_start|>system\nBe brief.\n\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n"
                    "<|im_start|>user\n[System message]\nAnswer in French now.\n\nHow are you?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_a_later_system_message_with_no_user_turn_after_it_is_a_user_turn_of_its_own():
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Note A"},
                {"role": "system", "content": "Note B"}, {"role": "assistant", "content": "Hello."},
                {"role": "system", "content": "Wrap up."}]
    prepared, _ = prepare_conversation(messages, None, TRAITS, HERMES)
    assert prepared == [{"role": "user", "content": "Hi"},
                        {"role": "user", "content": "[System message]\nNote A\n\n[System message]\nNote B"},
                        {"role": "assistant", "content": "Hello."},
                        {"role": "user", "content": "[System message]\nWrap up."}]
    assert messages[1] == {"role": "system", "content": "Note A"}  # the caller's messages are not changed


def test_a_mid_conversation_system_turn_of_a_messages_request_renders_instead_of_a_400(tokenizer):
    body = {"model": "claude", "max_tokens": 16, "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                         {"role": "system", "content": "The user is on a phone."},
                         {"role": "user", "content": "Weather?"}]}
    request = parse_messages(body, MODEL)
    text = render(tokenizer, request.prompt.messages)
    assert "<|im_start|>user\n[System message]\nThe user is on a phone.\n\nWeather?<|im_end|>" in text
    assert text.count("<|im_start|>system") == 1
