"""Anthropic Messages: validation into the neutral request, the block assembler, stop reasons and the
error shape. Pure logic, no model."""

from __future__ import annotations

import hmac
import json
from dataclasses import replace

import pytest

from ember.errors import ContextLengthExceeded, InvalidRequest
from ember.media.sources import BASE64, URL, ImageRef
from ember.parsers.events import (
    ContentText, ReasoningText, ThinkMarkers, ToolCall, ToolCallDelta, ToolCallStart, streamed_call,
)
from ember.parsers.hermes import HERMES
from ember.protocols.anthropic_errors import anthropic_error_body, anthropic_status
from ember.protocols.anthropic_messages import parse_count_tokens, parse_messages
from ember.protocols.anthropic_render import BlockAssembler, MessagesRenderer, thinking_signature
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.errors import ModelLoading, QueueTimeout, RequestTooLarge, ServerOverloaded, Unauthorized
from ember.protocols.neutral import ModelInfo, ResponseMeta, RunResult, resolve_sampling, token_sha
from ember.protocols.partial_json import members_so_far
from ember.types import FinishReason


def signature_matches(text: str, signature: str) -> bool:
    return hmac.compare_digest(thinking_signature(text), signature)

MODEL = ModelInfo(name="served", max_model_len=2048, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                            "properties": {"city": {"type": "string"}}}, "cache_control": {"type": "ephemeral"},
           "eager_input_streaming": True}


def parse(**fields):
    return parse_messages({"model": "claude-sonnet", "max_tokens": 64, "messages": HI, **fields}, MODEL)


def refused(**fields) -> InvalidRequest:
    body = {"model": "claude-sonnet", "max_tokens": 64, "messages": HI, **fields}
    with pytest.raises(InvalidRequest) as caught:
        parse_messages({k: v for k, v in body.items() if v is not None}, MODEL)
    return caught.value


def test_a_plain_request():
    request = parse()
    assert request.prompt.messages == [{"role": "user", "content": "Hi"}]
    assert request.prompt.add_generation_prompt is True
    assert request.prompt.template_kwargs == {"enable_thinking": False}  # no thinking field: no thinking
    assert request.model_label == "claude-sonnet" and request.params.max_tokens == 64
    assert request.chat.thinking is False and request.chat.tools == ()
    assert not request.stream


def test_the_model_is_any_non_empty_label_and_max_tokens_is_optional():
    request = parse_messages({"messages": HI}, MODEL)
    assert request.model_label == "served" and request.params.max_tokens is None
    assert refused(model="").param == "model"
    assert refused(max_tokens=-1).param == "max_tokens"


def test_system_blocks_drop_the_billing_header_only_in_first_place():
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
              {"type": "text", "text": "You are a helper.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "\nBe brief."}]
    request = parse(system=system)
    assert request.prompt.messages[0] == {"role": "system", "content": "You are a helper.\nBe brief."}
    header_later = parse(system=[system[1], system[0]])
    assert "x-anthropic-billing-header" in header_later.prompt.messages[0]["content"]
    assert parse(system="x-anthropic-billing-header: a").prompt.messages[0]["role"] == "system"
    assert refused(system=[{"type": "image", "source": {}}]).param == "system[0]"
    assert refused(system=7).param == "system"


def test_turns_of_one_role_are_joined_and_a_system_turn_stays_in_place():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}, {"role": "system", "content": "note"},
                {"role": "user", "content": "d"}]
    assert parse(messages=messages).prompt.messages == [
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"},
        {"role": "system", "content": "note"}, {"role": "user", "content": "d"}]


def test_tool_use_and_tool_results_round_trip_their_ids():
    messages = [*HI,
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "anything"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_def", "name": "get_weather", "input": {"city": "Atlantis"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_abc", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "toolu_def", "is_error": True,
                     "content": [{"type": "text", "text": "no such city"}]},
                    {"type": "text", "text": "And tomorrow?"}]}]
    got = parse(messages=messages, tools=[WEATHER]).prompt.messages
    assert got[1] == {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
                      "tool_calls": [{"id": "toolu_abc", "type": "function",
                                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                                     {"id": "toolu_def", "type": "function",
                                      "function": {"name": "get_weather", "arguments": {"city": "Atlantis"}}}]}
    assert got[2] == {"role": "tool", "tool_call_id": "toolu_abc", "content": "sunny"}
    assert got[3]["tool_call_id"] == "toolu_def" and got[3]["content"].startswith("Error: ")
    assert got[4] == {"role": "user", "content": "And tomorrow?"}


def test_tools_and_tool_choice():
    request = parse(tools=[WEATHER])
    assert request.chat.tool_choice == "auto" and request.chat.tools[0].name == "get_weather"
    assert request.prompt.tools[0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}
    assert parse(tools=[WEATHER], tool_choice={"type": "any"}).chat.tool_choice == "required"
    named = parse(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather",
                                                 "disable_parallel_tool_use": True}).chat
    assert named.tool_choice == "function" and not named.parallel_tool_calls
    none = parse(tools=[WEATHER], tool_choice={"type": "none"})
    assert none.chat.tool_choice == "none" and none.prompt.tools is None
    assert refused(tools=[WEATHER], tool_choice={"type": "tool", "name": "other"}).param == "tool_choice.name"
    assert refused(tool_choice={"type": "any"}).param == "tool_choice"
    assert refused(tools=[WEATHER], tool_choice={"type": "maybe"}).param == "tool_choice.type"
    assert refused(tools=[{"type": "web_search_20250305", "name": "web_search"}]).param == "tools[0].type"
    assert refused(tools=[{**WEATHER, "strict": "yes"}]).param == "tools[0].strict"
    assert refused(tools=[WEATHER, WEATHER]).param == "tools[1].name"
    assert refused(tools=[{**WEATHER, "input_schema": "object"}]).param == "tools[0].input_schema"


def test_thinking_modes():
    enabled = parse(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 1024})
    assert enabled.chat.thinking is True and enabled.chat.thinking_budget == 1024
    assert enabled.prompt.template_kwargs["enable_thinking"] is True
    adaptive = parse(thinking={"type": "adaptive"})
    assert adaptive.chat.thinking is True and adaptive.chat.thinking_budget is None
    disabled = parse(thinking={"type": "disabled"})
    assert disabled.chat.thinking is False and disabled.prompt.template_kwargs["enable_thinking"] is False
    assert refused(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 1000}).param == \
        "thinking.budget_tokens"
    assert refused(max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024}).param == \
        "thinking.budget_tokens"
    assert refused(thinking={"type": "enabled"}).param == "thinking.budget_tokens"
    assert refused(thinking={"type": "adaptive", "display": "omitted"}).param == "thinking.display"
    assert refused(thinking={"type": "sometimes"}).param == "thinking.type"


def test_effort_reaches_the_template():
    assert parse(output_config={"effort": "high"}).prompt.template_kwargs["reasoning_effort"] == "high"
    assert parse(output_config={"effort": "max"}).chat.reasoning_effort == "xhigh"
    assert refused(output_config={"effort": "huge"}).param == "output_config.effort"


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}


def test_output_config_format_becomes_the_grammar():
    request = parse(output_config={"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}})
    assert (request.grammar.kind, request.grammar.param) == ("json_schema", "output_config.format.schema")
    assert json.loads(request.grammar.text) == SCHEMA and request.chat.reasoning_effort == "low"
    older = parse(output_format={"type": "json_schema", "schema": SCHEMA})
    assert (older.grammar.param, json.loads(older.grammar.text)) == ("output_format.schema", SCHEMA)
    assert parse(output_config={"format": None}).grammar is None and parse().grammar is None
    assert parse(tools=[WEATHER], tool_choice={"type": "auto"},
                 output_config={"format": {"type": "json_schema", "schema": SCHEMA}}).grammar is not None
    count = parse_count_tokens({"messages": HI, "output_config": {"format": {"type": "json_schema",
                                                                               "schema": SCHEMA}}}, MODEL)
    assert count.grammar is None


@pytest.mark.parametrize("fields, param", [
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "text"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": "{"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
      "output_format": {"type": "json_schema", "schema": SCHEMA}}, "output_format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": SCHEMA}, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "get_weather"}}, "output_format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
      "messages": [*HI, {"role": "assistant", "content": "{"}]}, "output_config.format.schema"),
])
def test_output_format_refusals_name_the_field(fields, param):
    assert refused(**fields).param == param


def test_strict_tools_are_held_to_their_schema():
    request = parse(tools=[{**WEATHER, "strict": True}, {**WEATHER, "name": "loose"}], tool_choice={"type": "any"})
    assert [(t.name, t.strict) for t in request.chat.tools] == [("get_weather", True), ("loose", False)]


def test_claude_code_fields_are_accepted():
    request = parse(metadata={"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
                    service_tier="auto", thinking={"type": "adaptive"},
                    context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                    output_config={"effort": "medium"}, max_tokens=32000, cache_control={"type": "ephemeral"},
                    messages=[{"role": "user", "content": [{"type": "text", "text": "Hi",
                                                            "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])
    assert request.params.max_tokens == 32000 and request.chat.thinking


def test_clear_thinking_keeps_the_last_turns():
    def turn(k):
        return {"role": "assistant", "content": [{"type": "thinking", "thinking": f"t{k}", "signature": ""},
                                                 {"type": "text", "text": f"a{k}"}]}
    messages = [*HI, turn(1), {"role": "user", "content": "more"}, turn(2), {"role": "user", "content": "again"}]
    got = parse(messages=messages, context_management={"edits": [{"type": "clear_thinking_20251015"}]})
    assert [m.get("reasoning_content") for m in got.prompt.messages if m["role"] == "assistant"] == [None, "t2"]
    kept = parse(messages=messages, context_management={"edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}]})
    assert [m.get("reasoning_content") for m in kept.prompt.messages if m["role"] == "assistant"] == ["t1", "t2"]


def test_a_final_assistant_text_is_a_prefill():
    request = parse(messages=[*HI, {"role": "assistant", "content": "The answer is"}])
    assert request.prompt.add_generation_prompt is False
    assert request.prompt.template_kwargs["continue_final_message"] is True
    assert request.prompt.messages[-1] == {"role": "assistant", "content": "The answer is"}
    empty = parse(messages=[*HI, {"role": "assistant", "content": ""}])
    assert empty.prompt.add_generation_prompt is True and empty.prompt.messages == HI
    assert refused(messages=[*HI, {"role": "assistant", "content": "Trailing "}]).param == "messages[1]"
    assert refused(messages=[*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]).param == "messages[1]"
    assert refused(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 1024},
                   messages=[*HI, {"role": "assistant", "content": "So"}]).param == "thinking"


@pytest.mark.parametrize("block, param", [
    ({"type": "document", "source": {}}, "messages[0].content[0]"),
    ({"type": "search_result", "source": "s", "title": "t", "content": []}, "messages[0].content[0]"),
    ({"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}, "messages[0].content[0]"),
    ({"type": "hologram"}, "messages[0].content[0]"),
    ({"type": "text", "text": 5}, "messages[0].content[0].text"),
    ({"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}, "messages[0].content[0]"),
    ({"type": "tool_result", "content": "x"}, "messages[0].content[0].tool_use_id"),
    ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document", "source": {}}]},
     "messages[0].content[0].content[0]"),
])
def test_refused_blocks_are_named(block, param):
    assert refused(messages=[{"role": "user", "content": [block]}]).param == param


PNG_DATA = "iVBORw0KGgo="


def image(media_type="image/png", data=PNG_DATA, **extra):
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}, **extra}


def test_image_blocks_become_image_refs_in_order():
    url_block = {"type": "image", "source": {"type": "url", "url": "https://x.org/a.jpg"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, image(media_type="image/webp"),
                                             url_block]},
                {"role": "user", "content": [{"type": "text", "text": "Which?"}]}]
    [message] = parse(messages=messages).prompt.messages
    assert message == {"role": "user", "content": [
        {"type": "text", "text": "Look: "},
        {"type": "image", "image": ImageRef(BASE64, PNG_DATA, "messages[0].content[1].source.data", "image/webp")},
        {"type": "image", "image": ImageRef(URL, "https://x.org/a.jpg", "messages[0].content[2].source.url")},
        {"type": "text", "text": "Which?"}]}


def test_a_tool_result_keeps_its_text_and_images_in_order():
    messages = [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                              "content": [{"type": "text", "text": "blurry"}, image()]},
                                             {"type": "text", "text": "Again?"}]}]
    tool, user = parse(messages=messages).prompt.messages[2:]
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": [
        {"type": "text", "text": "Error: blurry"},
        {"type": "image", "image": ImageRef(BASE64, PNG_DATA, "messages[2].content[0].content[1].source.data",
                                            "image/png")}]}
    assert user == {"role": "user", "content": "Again?"}


def test_count_tokens_reads_images_as_create_does():
    body = {"messages": [{"role": "user", "content": [image(), {"type": "text", "text": "What?"}]}]}
    assert parse_count_tokens(body, MODEL).prompt.messages == parse(**body).prompt.messages


@pytest.mark.parametrize("block, param, code", [
    (image(media_type="image/bmp"), "messages[0].content[0].source.media_type", None),
    (image(media_type=None), "messages[0].content[0].source.media_type", None),
    (image(data=""), "messages[0].content[0].source.data", None),
    ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, "messages[0].content[0].source.type",
     "unsupported_content"),
    ({"type": "image", "source": {"type": "url"}}, "messages[0].content[0].source.url", None),
    ({"type": "image", "source": {"type": "url", "url": "gopher://x"}}, "messages[0].content[0].source.url",
     "invalid_media"),
    ({"type": "image", "source": {"type": "text"}}, "messages[0].content[0].source.type", None),
    ({"type": "image"}, "messages[0].content[0].source", None),
    ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {"type": "file"}}]},
     "messages[0].content[0].content[0].source.type", "unsupported_content"),
])
def test_malformed_image_blocks_are_refused_by_name(block, param, code):
    error = refused(messages=[{"role": "user", "content": [block]}])
    assert (error.param, error.code) == (param, code)


def test_an_image_outside_user_turns_is_refused_and_a_prefill_holds_none():
    for role in ("assistant", "system"):
        error = refused(messages=[*HI, {"role": role, "content": [image()]}, {"role": "user", "content": "ok"}])
        assert (error.param, error.code) == ("messages[1].content[0]", "unsupported_content")
    prefill = refused(messages=[*HI, {"role": "assistant", "content": [{"type": "text", "text": "It is"}, image()]}])
    assert (prefill.param, prefill.code) == ("messages[1].content[1]", "unsupported_content")
    assert refused(system=[image()]).param == "system[0]"


def test_redacted_thinking_is_refused_by_name():
    messages = [*HI, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xyz"}]},
                {"role": "user", "content": "go on"}]
    error = refused(messages=messages)
    assert error.param == "messages[1].content[0]" and "redacted_thinking" in error.message


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"temperature": "warm"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"container": "c_1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
])
def test_malformed_fields_are_named(fields, param):
    assert refused(**fields).param == param


def test_sampling_fields():
    params = parse(temperature=0.3, top_p=0.9, top_k=20, stop_sequences=["END", "\n\n"]).params
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (0.3, 0.9, 20, ["END", "\n\n"])


def test_count_tokens_reads_the_same_prompt_without_output_fields():
    body = {"model": "m", "messages": HI, "system": "Be kind.", "tools": [WEATHER],
            "thinking": {"type": "enabled", "budget_tokens": 2000}}
    counted = parse_count_tokens(body, MODEL)
    created = parse_messages({**body, "max_tokens": 4000, "stream": True, "temperature": 0.5}, MODEL)
    assert counted.prompt == created.prompt
    assert parse_count_tokens({**body, "max_tokens": 0}, MODEL).prompt == created.prompt


# ---- rendering --------------------------------------------------------------------------------------

def test_blocks_open_on_text_and_thinking_signs_before_it_stops():
    blocks = BlockAssembler()
    events = []
    for item in [ReasoningText("\n"), ReasoningText("Let me think."), ContentText("\n\n"), ContentText("Hi"),
                 *streamed_call(ToolCall(0, "call_abc", "get_weather", '{"city": "Paris"}')), ContentText("  \n")]:
        events += blocks.feed(item)
    events += blocks.close()
    kinds = [(e.data["type"], e.data.get("delta", {}).get("type")) for e in events]
    assert kinds == [("content_block_start", None), ("content_block_delta", "thinking_delta"),
                     ("content_block_delta", "signature_delta"),
                     ("content_block_stop", None), ("content_block_start", None),
                     ("content_block_delta", "text_delta"), ("content_block_stop", None),
                     ("content_block_start", None), ("content_block_delta", "input_json_delta"),
                     ("content_block_stop", None)]
    assert [e.data["index"] for e in events] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    thinking, text, call = blocks.blocks
    assert thinking["thinking"] == "\nLet me think." and signature_matches(thinking["thinking"], thinking["signature"])
    assert text == {"type": "text", "text": "\n\nHi"}
    assert call == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}}


def _renderer(finish, stop_reason=None, tokens=4, prompt=10, max_tokens=None, limit=2048, parts=()):
    request = parse(max_tokens=max_tokens) if max_tokens else parse_messages({"messages": HI}, MODEL)
    _, fit = resolve_sampling(request, prompt, replace(MODEL, max_model_len=limit))
    result = RunResult(1, list(range(prompt)), fit=fit)
    choice = result.choices[0]
    choice.token_ids, choice.finish_reason, choice.stop_reason = list(range(tokens)), finish, stop_reason
    choice.text = "x"
    meta = ResponseMeta("msg_1", 0, "served", "fp", lambda ids: "", "req_1")
    return MessagesRenderer(request, result, meta)


def test_stop_reasons():
    assert _renderer(FinishReason.STOP, 2).response()["stop_reason"] == "end_turn"
    body = _renderer(FinishReason.STOP, "END").response()
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    assert _renderer(FinishReason.LENGTH, max_tokens=4).response()["stop_reason"] == "max_tokens"
    # max_tokens beyond the room the window leaves was capped: the window filled
    assert _renderer(FinishReason.LENGTH, max_tokens=32000, tokens=2038).response()["stop_reason"] == \
        "model_context_window_exceeded"
    assert _renderer(FinishReason.LENGTH, tokens=2038).response()["stop_reason"] == "model_context_window_exceeded"


def test_the_whole_message():
    body = _renderer(FinishReason.STOP, 2, tokens=4, prompt=10).response()
    assert body == {"id": "msg_1", "type": "message", "role": "assistant", "model": "served",
                    "content": [{"type": "text", "text": "x"}], "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                              "output_tokens": 4},
                    "token_sha": token_sha([0, 1, 2, 3])}


def test_errors_take_anthropic_statuses_and_types():
    cases = [(InvalidRequest("bad", param="x"), 400, "invalid_request_error"),
             (Unauthorized("no key"), 401, "authentication_error"),
             (RequestTooLarge(1024), 413, "request_too_large"),
             (ServerOverloaded(3, 2), 529, "overloaded_error"),
             (ModelLoading(), 529, "overloaded_error"),
             (QueueTimeout(1.0, 2), 504, "timeout_error")]
    for error, status, kind in cases:
        assert anthropic_status(error) == status
        body = anthropic_error_body(error, "req_9")
        assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]},
                        "request_id": "req_9"}
    too_long = anthropic_error_body(ContextLengthExceeded(1024, 1500))
    assert too_long["error"]["message"] == "prompt is too long: 1500 tokens > 1023 maximum"


def test_a_tool_use_block_streams_its_input_in_pieces_and_a_cut_one_keeps_its_whole_members():
    blocks = BlockAssembler()
    pieces = ['{"city": "Paris", ', '"days": 3, "no', 'te": "ra']
    events = blocks.feed(ToolCallStart(0, "call_abc", "get_weather"))
    for piece in pieces:
        events += blocks.feed(ToolCallDelta(0, piece))
    events += blocks.feed(ToolCall(0, "call_abc", "get_weather", "".join(pieces), complete=False))
    assert [e.data["type"] for e in events] == ["content_block_start"] + ["content_block_delta"] * 3 + [
        "content_block_stop"]
    assert [e.data["delta"]["partial_json"] for e in events[1:4]] == pieces
    assert blocks.blocks == [{"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                              "input": {"city": "Paris", "days": 3}}]


@pytest.mark.parametrize("text, members", [
    ("", {}), ("{", {}), ('{"a": "b', {}), ('{"a": "b"', {"a": "b"}), ('{"a": 1', {}), ('{"a": 1,', {"a": 1}),
    ('{"a": [1, {"b": tru', {"a": [1, {}]}), ('{"a": "x\\"}", "b', {"a": 'x"}'}), ('{"a": {}}', {"a": {}}),
    ("not json", {}),
])
def test_members_so_far(text, members):
    assert members_so_far(text) == members
