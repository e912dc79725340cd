"""Cache hints and priority in every dialect that has them: validation (400 naming the field), where
breakpoints land in the neutral conversation, and their token positions under the default model's
real tokenizer and chat template."""

from __future__ import annotations

import pytest

from ember.errors import InvalidRequest
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.protocols.anthropic_messages import parse_messages
from ember.protocols.cache_hints import Breakpoint, probe_messages
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.neutral import ModelInfo, encode_prompt, resolve_sampling
from ember.protocols.openai_chat import parse_chat
from ember.protocols.openai_responses import ResponsesContext, parse_responses
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.tokenization.tokenizer import Tokenizer
from ember.types import CachePin
from gguf_models import default_gguf_model

MODEL = ModelInfo(name="served", max_model_len=2048, vocab_size=49152, chat=ChatFeatures(ThinkMarkers(), HERMES))
EPHEMERAL = {"type": "ephemeral"}
PERSONA = "You are a patient guide to the tide pools of the northern coast. " * 3


def anthropic(**fields):
    return parse_messages({"model": "claude", "max_tokens": 16, **fields}, MODEL)


def refused(parse, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    return caught.value


def chat(**fields):
    return parse_chat({"messages": [{"role": "user", "content": "Hi"}], **fields}, MODEL)


def responses(**fields):
    context = ResponsesContext(ReasoningSeal(), history_of=lambda _: None, save=lambda *_: None)
    return parse_responses({"input": "Hi", **fields}, MODEL, context)


def text(value, **extra):
    return {"type": "text", "text": value, **extra}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(default_gguf_model().metadata)


# ---- Anthropic cache_control ----------------------------------------------------------------------

def test_anthropic_breakpoints_land_at_the_end_of_their_blocks():
    request = anthropic(system=[text("Rules. "), text("More rules.", cache_control=EPHEMERAL), text(" Tail.")],
                        messages=[{"role": "user", "content": [text("Question one", cache_control={
                            "type": "ephemeral", "ttl": "1h"}), text(" and two.")]}])
    assert request.prompt.messages[0]["content"] == "Rules. More rules. Tail."
    assert request.prompt.cache_breakpoints == [Breakpoint(1, len("Rules. More rules."), 300.0),
                                                Breakpoint(2, len("Question one"), 3600.0)]
    assert all("ember_cache_breakpoints" not in m for m in request.prompt.messages)


def test_anthropic_tools_results_and_the_request_level_mark():
    tool = {"name": "look", "input_schema": {"type": "object"}, "cache_control": EPHEMERAL}
    messages = [{"role": "user", "content": "Find it."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [text("found", cache_control=EPHEMERAL)]},
                                             text("Thanks.")]}]
    request = anthropic(tools=[tool], system="Be brief.", messages=messages, cache_control={"type": "ephemeral",
                                                                                           "ttl": "1h"})
    roles = [m["role"] for m in request.prompt.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert request.prompt.cache_breakpoints == [
        Breakpoint(1, None, 300.0),  # the tools: through the system part
        Breakpoint(4, None, 300.0),  # the tool result, whole
        Breakpoint(5, None, 3600.0),  # the request-level mark: the last block
    ]


def test_a_request_level_mark_on_an_already_marked_last_block_adds_nothing():
    request = anthropic(cache_control=EPHEMERAL, messages=[{"role": "user", "content": [
        text("Hi", cache_control={"type": "ephemeral", "ttl": "1h"})]}])
    assert request.prompt.cache_breakpoints == [Breakpoint(1, 2, 3600.0)]


@pytest.mark.parametrize("control, param", [
    ({"type": "persistent"}, "system[0].cache_control.type"),
    ({"ttl": "5m"}, "system[0].cache_control.type"),
    ({"type": "ephemeral", "ttl": "10m"}, "system[0].cache_control.ttl"),
    ("ephemeral", "system[0].cache_control"),
])
def test_malformed_cache_control_is_named(control, param):
    error = refused(anthropic, system=[text("S", cache_control=control)], messages=[{"role": "user", "content": "Hi"}])
    assert error.param == param and error.status == 400


def test_a_fifth_breakpoint_is_refused_naming_it():
    blocks = [text(f"part {i}", cache_control=EPHEMERAL) for i in range(5)]
    error = refused(anthropic, messages=[{"role": "user", "content": blocks}])
    assert error.param == "messages[0].content[4].cache_control"
    four = anthropic(messages=[{"role": "user", "content": blocks[:4]}])
    assert len(four.prompt.cache_breakpoints) == 4
    assert refused(anthropic, cache_control=EPHEMERAL, messages=[{"role": "user", "content": blocks[:4] + [
        text("last")]}]).param == "cache_control"


# ---- OpenAI prompt_cache_breakpoint and prompt_cache_options ----------------------------------------

def test_chat_breakpoints_take_the_options_ttl_and_the_latest_writes():
    parts = [{"type": "text", "text": f"p{i}.", "prompt_cache_breakpoint": {"mode": "explicit"}} for i in range(5)]
    implicit = chat(messages=[{"role": "user", "content": parts}])
    assert [b.cut for b in implicit.prompt.cache_breakpoints] == [9, 12, 15]  # three beside the implicit one
    assert {b.ttl_s for b in implicit.prompt.cache_breakpoints} == {1800.0}
    explicit = chat(messages=[{"role": "user", "content": parts}],
                    prompt_cache_options={"mode": "explicit", "ttl": "1h"})
    assert [(b.cut, b.ttl_s) for b in explicit.prompt.cache_breakpoints] == [(c, 3600.0) for c in (6, 9, 12, 15)]


@pytest.mark.parametrize("fields, param", [
    ({"prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options.mode"),
    ({"prompt_cache_options": {"ttl": "forever"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"ttl": "30s"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"ttl": "25h"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": "explicit"}, "prompt_cache_options"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                 "prompt_cache_breakpoint": {"mode": "implicit"}}]}]},
     "messages[0].content[0].prompt_cache_breakpoint.mode"),
])
def test_malformed_openai_cache_hints_are_named(fields, param):
    assert refused(chat, **fields).param == param


def test_responses_breakpoints_mark_this_request_input():
    request = responses(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Read this.", "prompt_cache_breakpoint": {"mode": "explicit"}},
        {"type": "input_text", "text": " Then answer."}]}], prompt_cache_options={"mode": "explicit"})
    assert request.prompt.cache_breakpoints == [Breakpoint(1, len("Read this."), 1800.0)]
    assert request.spec.input_items[0]["content"][0]["prompt_cache_breakpoint"] == {"mode": "explicit"}
    assert refused(responses, prompt_cache_options={"ttl": "0m"}).param == "prompt_cache_options.ttl"


# ---- images: one unit of a cut each -----------------------------------------------------------------

PNG_URL = "data:image/png;base64,iVBORw0KGgo="
BASE64_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def test_every_dialect_counts_an_image_as_one_unit_of_its_cut():
    explicit = {"prompt_cache_breakpoint": {"mode": "explicit"}}
    request = chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "ab", **explicit}, {"type": "image_url", "image_url": {"url": PNG_URL}, **explicit},
        {"type": "text", "text": "cd", **explicit}]}], prompt_cache_options={"mode": "explicit"})
    assert [b.cut for b in request.prompt.cache_breakpoints] == [2, 3, 5]
    request = responses(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": PNG_URL, **explicit}, {"type": "input_text", "text": "ab", **explicit}]}],
        prompt_cache_options={"mode": "explicit"})
    assert [b.cut for b in request.prompt.cache_breakpoints] == [1, 3]
    request = anthropic(messages=[{"role": "user", "content": [
        text("ab"), {**BASE64_IMAGE, "cache_control": EPHEMERAL}, text("cd", cache_control=EPHEMERAL)]}])
    assert [b.cut for b in request.prompt.cache_breakpoints] == [3, 5]


@pytest.mark.parametrize("cut, content", [
    (2, "ab"),
    (3, [{"type": "text", "text": "ab"}, {"type": "image", "image": "I"}]),
    (4, [{"type": "text", "text": "ab"}, {"type": "image", "image": "I"}, {"type": "text", "text": "c"}]),
])
def test_a_probe_keeps_the_images_before_its_cut(cut, content):
    message = {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image", "image": "I"},
                                           {"type": "text", "text": "cd"}]}
    [probe] = probe_messages([message], Breakpoint(1, cut, 300.0))
    assert probe["content"] == content


# ---- token positions --------------------------------------------------------------------------------

def test_a_breakpoint_becomes_the_prompt_prefix_its_text_renders_to(tokenizer):
    request = anthropic(system=[text(PERSONA, cache_control=EPHEMERAL)],
                        messages=[{"role": "user", "content": "Where do crabs hide?"}])
    ids = encode_prompt(request.prompt, tokenizer, HERMES)
    [pin] = request.prompt.cache_pins
    assert 0 < pin.num_tokens < len(ids) and pin.ttl_s == 300.0
    covered = tokenizer.decode(ids[:pin.num_tokens], skip_special_tokens=False)
    assert PERSONA.strip() in covered and "crabs" not in covered
    params, _ = resolve_sampling(request, len(ids), MODEL)
    assert params.cache_pins == [CachePin(pin.num_tokens, 300.0)]


def test_a_breakpoint_on_the_last_message_covers_all_but_the_generation_prompt(tokenizer):
    request = chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Tell me about tides.", "prompt_cache_breakpoint": {"mode": "explicit"}}]}])
    ids = encode_prompt(request.prompt, tokenizer, HERMES)
    [pin] = request.prompt.cache_pins
    assert "tides." in tokenizer.decode(ids[:pin.num_tokens], skip_special_tokens=False)
    assert len(ids) - pin.num_tokens <= 6  # the turn's end and the assistant's opener


# ---- priority ------------------------------------------------------------------------------------

def test_priority_reaches_sampling_params_on_chat_and_responses():
    assert chat().params.priority == 0
    assert chat(priority="background").params.priority == 1
    assert chat(priority="foreground").params.priority == 0
    assert chat(priority=3).params.priority == 3
    assert responses(priority="background").params.priority == 1


@pytest.mark.parametrize("value", ["urgent", -1, 1.5, True, {"level": 1}])
def test_a_malformed_priority_is_named(value):
    assert refused(chat, priority=value).param == "priority"
    assert refused(responses, priority=value).param == "priority"
