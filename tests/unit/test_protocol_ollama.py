"""Ollama's dialect: validation of /api/chat and /api/generate into the neutral request, options,
format, think and keep_alive, the NDJSON rendering and the refusals. Pure logic, no model."""

from __future__ import annotations

import json

import pytest

from ember.constraint_spec import JSON_OBJECT, JSON_SCHEMA
from ember.errors import InvalidRequest
from ember.media.sources import BASE64
from ember.parsers.events import ContentText, ReasoningText, ThinkMarkers, ToolCall
from ember.parsers.hermes import HERMES
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.errors import Forbidden, ModelNotFound
from ember.protocols.neutral import ChatPrompt, ResponseMeta, RunResult, TextPrompt, ModelInfo
from ember.protocols.ollama_admin import is_load_request, load_request, parse_pull, refuse_delete
from ember.protocols.ollama_chat import CHAT, parse_chat
from ember.protocols.ollama_common import OLLAMA_ERRORS, parse_duration, served_name
from ember.protocols.ollama_generate import parse_generate
from ember.protocols.ollama_render import ChatRenderer, GenerateRenderer
from ember.protocols.stream_format import NDJSON
from ember.protocols.unknown_fields import watch_fields
from ember.types import FinishReason, GenerationOutput, RequestTimings

MODEL = ModelInfo(name="served", aliases=("alias",), max_model_len=2048, vocab_size=1000,
                  chat=ChatFeatures(ThinkMarkers(), HERMES))
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def chat(**fields):
    return parse_chat({"model": "served", "messages": HI, **fields}, MODEL)


def generate(**fields):
    return parse_generate({"model": "served", "prompt": "Hi", **fields}, MODEL)


def refusal(parse, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    return caught.value


# ---- the model ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, served", [("served", "served"), ("served:latest", "served"), ("alias", "alias"),
                                          ("alias:latest", "alias")])
def test_the_served_name_or_an_alias_with_or_without_latest_is_accepted(name, served):
    assert served_name(name, MODEL) == served
    assert chat(model=name).dialect_options.model_label == name  # echoed as sent


def test_another_model_is_a_404_naming_it_and_the_model_is_required():
    with pytest.raises(ModelNotFound) as caught:
        chat(model="llama3.2")
    assert caught.value.status == 404 and "llama3.2" in caught.value.message
    with pytest.raises(InvalidRequest) as missing:
        parse_chat({"messages": HI}, MODEL)
    assert missing.value.param == "model"


# ---- chat messages and tools ------------------------------------------------------------------------

def test_messages_become_template_messages_with_images_thinking_and_calls():
    job = chat(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is this?", "images": ["aGVsbG8="]},
        {"role": "assistant", "content": "", "thinking": "Look first.",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ], tools=[WEATHER])
    system, user, assistant, tool = job.prompt.messages
    assert system == {"role": "system", "content": "Be brief."}
    image, text = user["content"]
    assert image["image"].kind == BASE64 and image["image"].value == "aGVsbG8=" and text["text"] == "What is this?"
    assert assistant["reasoning_content"] == "Look first."
    assert assistant["tool_calls"] == [{"type": "function",
                                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert tool == {"role": "tool", "content": "sunny", "name": "get_weather"}
    assert [t.name for t in job.chat.tools] == ["get_weather"] and job.chat.tool_choice == "auto"
    assert job.prompt.tools[0]["function"]["name"] == "get_weather"


def test_message_refusals_name_their_field():
    assert refusal(chat, messages=[{"role": "robot", "content": "x"}]).param == "messages[0].role"
    assert refusal(chat, messages=[{"role": "assistant", "content": "x", "images": ["aGk="]}]).param == \
        "messages[0].images"
    bad_arguments = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    assert refusal(chat, messages=bad_arguments).param == "messages[0].tool_calls[0].function.arguments"
    assert refusal(chat, messages=[]).param == "messages"
    assert refusal(chat, tools=[{"type": "retrieval"}]).param == "tools[0].type"


def test_streaming_is_the_default():
    assert chat().stream is True and chat(stream=False).stream is False


# ---- options, format, think, keep_alive -----------------------------------------------------------------

def test_options_reach_the_sampling_params_under_their_ember_names():
    params = chat(options={"temperature": 0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "num_predict": 12,
                           "stop": ["\n"], "seed": 42, "repeat_penalty": 1.2, "presence_penalty": 0.5,
                           "frequency_penalty": 0.25}).params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens) == (0, 0.5, 7, 0.1, 12)
    assert (params.stop, params.seed, params.repetition_penalty) == (["\n"], 42, 1.2)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.25)


@pytest.mark.parametrize("num_predict", [-1, -2])
def test_a_negative_num_predict_leaves_the_window_as_the_limit(num_predict):
    assert chat(options={"num_predict": num_predict}).params.max_tokens is None


def test_samplers_ember_lacks_are_refused_unless_neutral():
    assert refusal(chat, options={"mirostat": 2}).param == "options.mirostat"
    assert refusal(chat, options={"typical_p": 0.7}).param == "options.typical_p"
    assert chat(options={"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}).params is not None
    assert refusal(chat, options={"temperature": "hot"}).param == "options.temperature"


def test_runner_options_and_another_window_are_listed_as_ignored_and_unknown_ones_follow_the_policy():
    with watch_fields(strict=False) as report:
        chat(options={"num_gpu": 1, "num_thread": 8, "num_ctx": 4096, "shiny": True})
    assert sorted(report.ignored) == ["options.num_ctx", "options.num_gpu", "options.num_thread", "options.shiny"]
    with watch_fields(strict=False) as report:
        chat(options={"num_ctx": 2048})  # the server's own window: nothing to report
    assert report.ignored == []
    with watch_fields(strict=True):
        assert refusal(chat, options={"shiny": True}).param == "options.shiny"


def test_format_is_json_or_a_schema():
    assert chat(format="json").grammar.kind == JSON_OBJECT
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}}
    spec = chat(format=schema).grammar
    assert spec.kind == JSON_SCHEMA and json.loads(spec.text) == schema and spec.param == "format"
    assert chat(format="").grammar is None
    assert refusal(chat, format="yaml").param == "format"


def test_think_switches_the_template_and_takes_an_effort():
    on, off, high = chat(think=True), chat(think=False), chat(think="high")
    assert on.chat.thinking is True and on.prompt.template_kwargs["enable_thinking"] is True
    assert off.chat.thinking is False and off.prompt.template_kwargs["enable_thinking"] is False
    assert high.prompt.template_kwargs["reasoning_effort"] == "high"
    assert refusal(chat, think="extreme").param == "think"


@pytest.mark.parametrize("text, seconds", [("5m", 300), ("1h30m", 5400), ("0", 0), ("-1m", -60), ("1.5s", 1.5),
                                           ("300ms", 0.3)])
def test_keep_alive_durations_read_as_go_does(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["5 minutes", "5", "", "m"])
def test_a_keep_alive_that_is_no_duration_is_refused(value):
    assert refusal(chat, keep_alive=value).param == "keep_alive"


def test_keep_alive_travels_with_the_request_in_seconds():
    for value, seconds in ((0, 0), ("5m", 300), (-1, -1), ("-1m", -60), (None, None)):
        with watch_fields(strict=False) as report:
            job = chat(keep_alive=value) if value is not None else chat()
        assert job.keep_alive == seconds and report.ignored == [], value


# ---- generate ---------------------------------------------------------------------------------------

def test_a_prompt_goes_through_the_template_after_the_system_text():
    job = generate(system="Be brief.")
    assert isinstance(job.prompt, ChatPrompt) and job.prompt_param == "prompt"
    assert job.prompt.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_raw_sends_the_text_as_it_is():
    job = generate(raw=True, prompt="<|im_start|>user")
    assert isinstance(job.prompt, TextPrompt) and job.prompt.text == "<|im_start|>user" and job.chat is None


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "return x"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"), ({"context": [1, 2]}, "context"),
    ({"raw": True, "images": ["aGk="]}, "images"), ({"raw": True, "think": True}, "think"),
])
def test_generate_refuses_what_it_cannot_honour_by_name(fields, param):
    assert refusal(generate, **fields).param == param


# ---- rendering -------------------------------------------------------------------------------------

def finished_result(job, events, finish=FinishReason.STOP):
    result = RunResult(1, [1, 2, 3], received=100.0)
    timings = RequestTimings(100.0, scheduled=100.5, first_token=101.0, finished=103.0)
    result.add(0, GenerationOutput("r", [1, 2, 3], [7, 8], "", [7, 8], "", None, None, finish, 0, timings))
    result.choices[0].events = events
    return result


def renderer(cls, job, result):
    return cls(job, result, ResponseMeta("id", 0, "served", "fp", lambda ids: ""))


def test_stream_lines_carry_text_thinking_and_whole_calls_then_the_closing_numbers():
    job = chat()
    events = [ReasoningText("hmm"), ContentText("Hi"),
              ToolCall(0, "call_1", "get_weather", '{"city": "Paris"}'),
              ToolCall(1, "call_2", "get_weather", '{"city": "Par', complete=False)]
    result = finished_result(job, events)
    render = renderer(ChatRenderer, job, result)
    lines = [json.loads(text) for text in NDJSON.frames(render.stream_output(result.choices[0], None)).splitlines()]
    assert [line["message"] for line in lines] == [
        {"role": "assistant", "content": "", "thinking": "hmm"}, {"role": "assistant", "content": "Hi"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    assert all(line["done"] is False and line["model"] == "served" for line in lines)
    (last,) = render.stream_end()
    assert last.data["done"] is True and last.data["done_reason"] == "stop"
    assert last.data["prompt_eval_count"] == 3 and last.data["eval_count"] == 2
    assert last.data["total_duration"] == 3_000_000_000 and last.data["load_duration"] == 0
    assert last.data["prompt_eval_duration"] == 500_000_000 and last.data["eval_duration"] == 2_000_000_000


def test_a_whole_generate_reply_and_a_cut_one():
    job = generate(stream=False)
    result = finished_result(job, [ContentText("Hello")], FinishReason.LENGTH)
    result.choices[0].text = "Hello"
    body = renderer(GenerateRenderer, job, result).response()
    assert body["response"] == "Hello" and body["done"] is True and body["done_reason"] == "length"
    assert "message" not in body and "thinking" not in body


def test_errors_are_ollama_shaped():
    error = InvalidRequest("messages is required", param="messages")
    assert OLLAMA_ERRORS.body(error, "rid") == {"error": "messages is required"}
    assert OLLAMA_ERRORS.status(error) == 400
    assert CHAT.stream_format is NDJSON
    frames = NDJSON.frames(renderer(ChatRenderer, chat(), finished_result(chat(), [])).stream_error(error))
    assert frames == b'{"error":"messages is required"}\n'


# ---- load requests, pull, delete ---------------------------------------------------------------------------

def test_a_request_with_nothing_to_answer_loads_the_model():
    assert is_load_request({"model": "served", "messages": []}, "messages")
    assert is_load_request({"model": "served"}, "prompt")
    assert not is_load_request({"model": "served", "prompt": "", "images": ["aGk="]}, "prompt")
    with watch_fields(strict=False) as report:
        reply, keep_alive = load_request({"model": "served:latest", "messages": [], "keep_alive": 0}, chat=True)
    assert reply["done"] is True and reply["done_reason"] == "unload" and reply["model"] == "served:latest"
    assert reply["message"] == {"role": "assistant", "content": ""} and keep_alive == 0 and report.ignored == []
    reply, keep_alive = load_request({"model": "served", "keep_alive": "10m"}, chat=False)
    assert reply["done_reason"] == "load" and reply["response"] == "" and keep_alive == 600
    with pytest.raises(InvalidRequest):
        load_request({"messages": []}, chat=True)


def test_pull_and_delete_bodies():
    assert parse_pull({"model": "org/name", "stream": False}) == ("org/name", False)
    assert parse_pull({"name": "org/name"}) == ("org/name", True)
    with pytest.raises(Forbidden) as caught:
        refuse_delete({"model": "served"})
    assert caught.value.status == 403 and "served" in caught.value.message
