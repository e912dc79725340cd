"""Chat Completions validation: pure logic, no model."""

from __future__ import annotations

import pytest

from ember.errors import InvalidRequest
from ember.media.sources import DATA, URL, ImageRef
from ember.protocols.errors import ModelNotFound
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.neutral import ChatPrompt, ModelInfo, prompt_images
from ember.protocols.openai_chat import parse_chat

MODEL = ModelInfo(name="served", aliases=("alias",), max_model_len=512, vocab_size=1000,
                  chat=ChatFeatures(ThinkMarkers(), HERMES))
HI = [{"role": "user", "content": "Hi"}]


def parse(**fields):
    return parse_chat({"messages": HI, **fields}, MODEL)


def refused(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat(body, MODEL)
    return caught.value


def test_defaults():
    request = parse()
    assert isinstance(request.prompt, ChatPrompt)
    assert request.prompt.messages == [{"role": "user", "content": "Hi"}]
    assert request.prompt.add_generation_prompt is True
    assert request.n == 1 and not request.stream and not request.include_usage
    assert request.params.max_tokens is None and request.params.logprobs is None
    assert request.prompt_param == "messages"


def test_sampling_fields_reach_sampling_params():
    request = parse(max_tokens=10, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                    frequency_penalty=-0.5, repetition_penalty=1.1, seed=7, stop="END", ignore_eos=True,
                    min_tokens=2, logit_bias={"5": -100, "6": 2.5}, stop_token_ids=[3])
    p = request.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (10, 0.5, 0.9, 40, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.seed) == (0.5, -0.5, 1.1, 7)
    assert p.stop == ["END"] and p.ignore_eos and p.min_tokens == 2 and p.stop_token_ids == [3]
    assert p.logit_bias == {5: -100.0, 6: 2.5}


def test_max_completion_tokens_is_max_tokens_and_integral_floats_count_as_integers():
    assert parse(max_tokens=9, max_completion_tokens=9).params.max_tokens == 9
    assert refused({"messages": HI, "max_tokens": 5, "max_completion_tokens": 9}).code == "conflicting_parameters"
    assert parse(max_tokens=12.0).params.max_tokens == 12
    assert refused({"messages": HI, "max_tokens": 12.5}).param == "max_tokens"


def test_model_field():
    assert parse(model="served").n == 1
    assert parse(model="alias").n == 1
    assert parse(model=None).n == 1
    with pytest.raises(ModelNotFound) as caught:
        parse(model="other")
    assert caught.value.status == 404 and caught.value.code == "model_not_found"


def test_roles_parts_and_history():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ]
    out = parse_chat({"messages": messages}, MODEL).prompt.messages
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[1] == {"role": "user", "content": "ab", "name": "ann"}
    assert out[2]["content"] == "" and out[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert out[3] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert out[4]["content"] == "no"


def test_audio_video_and_file_parts_are_refused_by_position():
    for kind in ("input_audio", "video_url", "file", "input_image"):
        error = refused({"messages": [HI[0], {"role": "user", "content": [{"type": "text", "text": "x"},
                                                                          {"type": kind}]}]})
        assert (error.param, error.code) == ("messages[1].content[1]", "unsupported_content")


PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def image_url(url=PNG_URL, **extra):
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def test_image_parts_become_image_refs_in_order():
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare "}, image_url(detail="auto"),
                                             {"type": "text", "text": "and"}, {"type": "text", "text": " "},
                                             {"type": "image_url", "image_url": "https://example.com/b.png"}]}]
    [message] = parse_chat({"messages": messages}, MODEL).prompt.messages
    first = ImageRef(DATA, PNG_URL, "messages[0].content[1].image_url.url")
    second = ImageRef(URL, "https://example.com/b.png", "messages[0].content[4].image_url")
    assert message == {"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image", "image": first}, {"type": "text", "text": "and "},
        {"type": "image", "image": second}]}
    assert prompt_images(parse_chat({"messages": messages}, MODEL).prompt) == [first, second]


def test_a_tool_result_may_hold_images():
    messages = [HI[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "here"}, image_url()]}]
    tool = parse_chat({"messages": messages}, MODEL).prompt.messages[2]
    ref = ImageRef(DATA, PNG_URL, "messages[2].content[1].image_url.url")
    assert tool["content"] == [{"type": "text", "text": "here"}, {"type": "image", "image": ref}]


@pytest.mark.parametrize("part, param, code", [
    (image_url(detail="low"), "messages[0].content[0].image_url.detail", "unsupported_parameter"),
    (image_url(detail="high"), "messages[0].content[0].image_url.detail", "unsupported_parameter"),
    (image_url(detail="huge"), "messages[0].content[0].image_url.detail", None),
    (image_url("ftp://example.com/a.png"), "messages[0].content[0].image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": "file:///etc/passwd"}, "messages[0].content[0].image_url", "invalid_media"),
    ({"type": "image_url", "image_url": {"detail": "auto"}}, "messages[0].content[0].image_url.url", None),
    ({"type": "image_url", "image_url": {"url": ""}}, "messages[0].content[0].image_url.url", None),
    ({"type": "image_url"}, "messages[0].content[0].image_url", None),
    ({"type": "image_url", "image_url": 7}, "messages[0].content[0].image_url", None),
])
def test_malformed_image_parts_are_refused_by_name(part, param, code):
    error = refused({"messages": [{"role": "user", "content": [part]}]})
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize("role", ["assistant", "system", "developer"])
def test_an_image_outside_user_and_tool_turns_is_refused(role):
    error = refused({"messages": [{"role": role, "content": [image_url()]}, *HI]})
    assert (error.param, error.code) == ("messages[0].content[0]", "unsupported_content")
    assert role in error.message


def test_logprobs_fields():
    assert parse(logprobs=True).params.logprobs == 0
    assert parse(logprobs=True, top_logprobs=5).params.logprobs == 5
    assert parse(logprobs=False, top_logprobs=0).params.logprobs is None
    assert refused({"messages": HI, "top_logprobs": 2}).param == "top_logprobs"


def test_stream_options():
    assert parse(stream=True, stream_options={"include_usage": True}).include_usage
    assert not parse(stream=False, stream_options={"include_usage": True}).include_usage


def test_template_options():
    request = parse(chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False})
    assert request.prompt.template_kwargs == {"enable_thinking": False}
    assert request.prompt.add_generation_prompt is False
    request = parse(continue_final_message=True)
    assert request.prompt.template_kwargs == {"continue_final_message": True}
    assert request.prompt.add_generation_prompt is False
    assert refused({"messages": HI, "continue_final_message": True, "add_generation_prompt": True}).param == \
        "continue_final_message"
    assert refused({"messages": HI, "chat_template_kwargs": {"chat_template": "x"}}).param == \
        "chat_template_kwargs.chat_template"


def test_unknown_fields_are_ignored_and_neutral_values_accepted():
    request = parse(frobnicate=True, response_format={"type": "text"}, tools=[], tool_choice="none",
                    modalities=["text"], user="u1", metadata={"k": "v"}, parallel_tool_calls=False)
    assert request.n == 1


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": False}, "top_p"),
    ({"seed": 1 << 70}, "seed"),
    ({"n": 2.5}, "n"),
    ({"stop": [None]}, "stop[0]"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1": "high"}}, "logit_bias.1"),
    ({"stop_token_ids": [5000]}, "stop_token_ids[0]"),
    ({"return_token_ids": "yes"}, "return_token_ids"),
])
def test_refusals_name_the_field(fields, param):
    error = refused({"messages": HI, **fields})
    assert error.param == param and error.status == 400


def test_body_must_be_an_object():
    with pytest.raises(InvalidRequest) as caught:
        parse_chat(["not", "an", "object"], MODEL)
    assert caught.value.param is None


# ---- tools and thinking -----------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tools_reach_the_template_and_the_options():
    request = parse(tools=[WEATHER, TIME])
    assert [t.name for t in request.chat.tools] == ["get_weather", "get_time"]
    assert request.chat.tool_choice == "auto" and request.chat.parallel_tool_calls
    assert request.prompt.tools[0] == WEATHER
    assert request.prompt.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}


def test_tool_choice_none_hides_the_tools_from_the_template():
    request = parse(tools=[WEATHER], tool_choice="none")
    assert request.prompt.tools is None and not request.chat.calls_tools


def test_a_named_tool_choice_leaves_only_that_tool():
    request = parse(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert request.chat.tool_choice == "function"
    assert [t.name for t in request.chat.tools] == ["get_time"]
    assert [t["function"]["name"] for t in request.prompt.tools] == ["get_time"]


def test_allowed_tools_narrow_the_set_and_keep_their_mode():
    request = parse(tools=[WEATHER, TIME], tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "get_weather"}}]}})
    assert request.chat.tool_choice == "required" and [t.name for t in request.chat.tools] == ["get_weather"]


def test_reasoning_history_is_read_under_either_name():
    for key in ("reasoning_content", "reasoning"):
        request = parse(messages=[*HI, {"role": "assistant", "content": "4", key: "2+2"}, *HI])
        assert request.prompt.messages[1]["reasoning_content"] == "2+2"


@pytest.mark.parametrize("fields, kwargs, thinking", [
    ({}, {}, None),
    ({"reasoning_effort": "none"}, {"enable_thinking": False}, False),
    ({"reasoning_effort": "low"}, {"enable_thinking": True, "reasoning_effort": "low"}, True),
    ({"enable_thinking": False}, {"enable_thinking": False}, False),
    ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}, True),
    ({"chat_template_kwargs": {"reasoning_effort": "high"}}, {"enable_thinking": True, "reasoning_effort": "high"}, True),
    ({"reasoning_effort": "medium", "chat_template_kwargs": {"reasoning_effort": "low"}},
     {"enable_thinking": True, "reasoning_effort": "medium"}, True),
])
def test_thinking_switches_reach_the_template(fields, kwargs, thinking):
    request = parse(**fields)
    assert request.prompt.template_kwargs == kwargs and request.chat.thinking is thinking


def test_thinking_budget_zero_means_the_server_default():
    assert parse(thinking_budget=0).chat.thinking_budget is None
    assert parse(thinking_budget=64).chat.thinking_budget == 64


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": "none", "enable_thinking": True}, "reasoning_effort"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}, "reasoning_effort"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking"),
    ({"thinking_budget": -1}, "thinking_budget"),
    ({"function_call": {"name": "f"}}, "function_call"),
])
def test_tool_and_thinking_refusals_name_the_field(fields, param):
    error = refused({"messages": HI, **fields})
    assert error.param == param and error.status == 400


def test_tools_are_refused_when_the_server_turned_tool_calls_off():
    model = ModelInfo(name="served", max_model_len=512, vocab_size=1000, chat=ChatFeatures(None, None))
    with pytest.raises(InvalidRequest) as caught:
        parse_chat({"messages": HI, "tools": [WEATHER]}, model)
    assert caught.value.param == "tools"
