"""/generate, /tokenize and /detokenize validation and rendering: pure logic."""

from __future__ import annotations

import pytest

from ember.errors import InvalidRequest
from ember.media.sources import BASE64, DATA, URL, ImageRef
from ember.protocols.native_generate import DEFAULT_MAX_NEW_TOKENS, GenerateRenderer, finish_reason_body, \
    parse_generate
from ember.protocols.native_tokens import parse_detokenize, parse_tokenize, render_tokenize
from ember.protocols.neutral import ChatPrompt, ChoiceResult, ModelInfo, ResponseMeta, RunResult, TextPrompt, \
    TokenPrompt
from ember.types import FinishReason, GenerationOutput, RequestTimings, TokenLogprob

MODEL = ModelInfo(name="served", max_model_len=100, vocab_size=1000)


def refused(parse, body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(body, MODEL)
    return caught.value


def test_one_text_and_its_sampling_params():
    job = parse_generate({"text": "Hi", "sampling_params": {
        "max_new_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "stop": ["x"],
        "stop_token_ids": [2], "ignore_eos": True, "seed": 5, "repetition_penalty": 1.1, "presence_penalty": 0.2,
        "frequency_penalty": 0.3, "min_new_tokens": 2, "no_stop_trim": True}}, MODEL)
    assert job.prompt == TextPrompt("Hi") and job.batch is None and not job.stream
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.stop, p.stop_token_ids) == \
        (7, 0, 0.5, 3, 0.1, ["x"], [2])
    assert (p.ignore_eos, p.seed, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == \
        (True, 5, 1.1, 0.2, 0.3)
    assert (p.min_tokens, p.include_stop_str_in_output, p.logprobs) == (2, True, None)


def test_defaults_and_token_ids():
    job = parse_generate({"input_ids": [1, 2, 3]}, MODEL)
    assert job.prompt == TokenPrompt([1, 2, 3]) and job.params.max_tokens == DEFAULT_MAX_NEW_TOKENS
    assert job.prompt_param == "input_ids"


def test_batches_run_one_prompt_each():
    job = parse_generate({"text": ["a", "b"], "rid": ["r1", "r2"],
                          "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]}, MODEL)
    assert [run.prompt for run in job.batch] == [TextPrompt("a"), TextPrompt("b")]
    assert [run.params.max_tokens for run in job.batch] == [2, 3]
    assert [run.prompt_param for run in job.batch] == ["text[0]", "text[1]"]
    assert job.dialect_options.rids == ["r1", "r2"] and job.dialect_options.is_batch
    ids = parse_generate({"input_ids": [[1], [2, 3]], "sampling_params": {"max_new_tokens": 4}}, MODEL)
    assert [run.prompt for run in ids.batch] == [TokenPrompt([1]), TokenPrompt([2, 3])]
    assert [run.params.max_tokens for run in ids.batch] == [4, 4]


def test_logprob_fields():
    job = parse_generate({"text": "a", "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [5, 9],
                          "logprob_start_len": -1}, MODEL)
    assert job.params.logprobs == 3 and job.params.logprob_token_ids == [5, 9]
    assert parse_generate({"text": "a", "top_logprobs_num": 3}, MODEL).params.logprobs is None


@pytest.mark.parametrize("body, param", [
    ({}, "text"),
    ({"text": ""}, "text"),
    ({"text": "a", "input_ids": [1]}, "input_ids"),
    ({"text": []}, "text"),
    ({"text": ["a", 3]}, "text[1]"),
    ({"text": ["a"] * 65}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 1000]}, "input_ids[1]"),
    ({"input_ids": [[1], []]}, "input_ids[1]"),
    ({"input_ids": [[1], [2, True]]}, "input_ids[1][1]"),
    ({"text": "a", "logprob_start_len": 0}, "logprob_start_len"),
    ({"text": "a", "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": "a", "token_ids_logprob": [1000]}, "token_ids_logprob[0]"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"stop": 3}}, "sampling_params.stop"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [1000]}}, "sampling_params.stop_token_ids[0]"),
    ({"text": "a", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}}, "sampling_params.min_new_tokens"),
    ({"text": "a", "sampling_params": {"sampling_seed": 1}}, "sampling_params.sampling_seed"),
    ({"text": "a", "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"stream_interval": 4}}, "sampling_params.stream_interval"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
    ({"text": "a", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ({"text": "a", "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_k": "x"}]}, "sampling_params[1].top_k"),
    ({"text": ["a", "b"], "sampling_params": [{"regex": "a"}, {}]}, "sampling_params"),
    ({"text": "a", "sampling_params": 3}, "sampling_params"),
    ({"text": ["a", "b"], "rid": "r"}, "rid"),
    ({"text": ["a", "b"], "rid": ["r", "r"]}, "rid"),
    ({"text": "a", "rid": 5}, "rid"),
    ({"text": "a", "input_embeds": [[0.1]]}, "input_embeds"),
    ({"text": "a", "lora_path": "x"}, "lora_path"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "a", "stream": "yes"}, "stream"),
])
def test_generate_refusals_name_the_field(body, param):
    assert refused(parse_generate, body).param == param


VISION = ModelInfo(name="served", max_model_len=100, vocab_size=1000, image_marker="<image>")
PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def test_image_data_one_string_or_a_list():
    job = parse_generate({"text": "<image>What is it?", "image_data": PNG_URL}, VISION)
    assert job.prompt == TextPrompt("<image>What is it?", images=[ImageRef(DATA, PNG_URL, "image_data")])
    job = parse_generate({"text": "<image> or <image> or <image>?",
                          "image_data": [PNG_URL, "iVBORw0KGgo=", "https://x.org/a.png"]}, VISION)
    assert job.prompt.images == [ImageRef(DATA, PNG_URL, "image_data[0]"),
                                 ImageRef(BASE64, "iVBORw0KGgo=", "image_data[1]"),
                                 ImageRef(URL, "https://x.org/a.png", "image_data[2]")]
    assert parse_generate({"text": "Hi", "image_data": []}, VISION).prompt == TextPrompt("Hi")


def test_image_data_on_a_text_model_is_refused():
    error = refused(parse_generate, {"text": "<image>", "image_data": PNG_URL})
    assert (error.param, error.code) == ("image_data", "vision_disabled")


@pytest.mark.parametrize("body, param, code", [
    ({"text": ["<image>", "<image>"], "image_data": [PNG_URL, PNG_URL]}, "image_data", "unsupported_parameter"),
    ({"input_ids": [1, 2], "image_data": PNG_URL}, "image_data", "unsupported_parameter"),
    ({"text": "What?", "image_data": PNG_URL}, "text", None),
    ({"text": "<image><image>", "image_data": [PNG_URL]}, "text", None),
    ({"text": "<image>", "image_data": [PNG_URL, 5]}, "image_data[1]", None),
    ({"text": "<image>", "image_data": [""]}, "image_data[0]", None),
    ({"text": "<image>", "image_data": {"url": PNG_URL}}, "image_data", None),
    ({"text": "<image>", "image_data": "ftp://x.org/a.png"}, "image_data", "invalid_media"),
])
def test_image_data_refusals_name_the_field(body, param, code):
    with pytest.raises(InvalidRequest) as caught:
        parse_generate(body, VISION)
    assert (caught.value.param, caught.value.code) == (param, code)


def _choice(reason, token_ids, stop_reason=None) -> ChoiceResult:
    return ChoiceResult(0, token_ids=token_ids, finish_reason=reason, stop_reason=stop_reason)


def test_finish_reasons_in_sglang_shape():
    assert finish_reason_body(_choice(FinishReason.LENGTH, [1, 2, 3])) == {"type": "length", "length": 3}
    assert finish_reason_body(_choice(FinishReason.STOP, [1, 2], "\n")) == {"type": "stop", "matched": "\n"}
    assert finish_reason_body(_choice(FinishReason.STOP, [1, 7], 7)) == {"type": "stop", "matched": 7}
    assert finish_reason_body(_choice(FinishReason.STOP, [1, 2])) == {"type": "stop", "matched": 2}  # the EOS
    assert finish_reason_body(_choice(None, [1])) is None


def test_logprobs_render_as_sglang_tuples():
    job = parse_generate({"text": "a", "return_logprob": True, "top_logprobs_num": 1, "token_ids_logprob": [4],
                          "return_text_in_logprobs": True}, MODEL)
    result = RunResult(1, [1, 2], received=100.0)
    meta = ResponseMeta("id1", 100, "served", "fp", lambda ids: f"<{ids[0]}>")
    renderer = GenerateRenderer(job, result, meta)
    body = renderer.logprobs([TokenLogprob(3, -0.5, [(3, -0.5)], [(4, float("-inf"))])])
    assert body["output_token_logprobs"] == [[-0.5, 3, "<3>"]]
    assert body["output_top_logprobs"] == [[[-0.5, 3, "<3>"]]]
    assert body["output_token_ids_logprobs"] == [[[None, 4, "<4>"]]]
    assert body["input_token_logprobs"] == []


def test_meta_info_splits_cached_tokens_by_tier_naming_every_tier():
    job = parse_generate({"text": ["a", "b"]}, MODEL)
    result = RunResult(2, [1, 2], received=100.0, batch_prompt_ids=[[1] * 40, [2] * 40])
    renderer = GenerateRenderer(job, result, ResponseMeta("id1", 100, "served", "fp", str))
    timings = RequestTimings(arrival=100.0, scheduled=100.0)
    outputs = [GenerationOutput("r0", [], [5], "x", [5], "x", None, None, FinishReason.STOP, 32, timings,
                                cached_tokens_by_tier={"device": 16, "host": 16}),
               GenerationOutput("r1", [], [5], "x", [5], "x", None, None, FinishReason.STOP, 0, timings,
                                cached_tokens_by_tier={"device": 0})]
    infos = [renderer.meta_info(result.add(index, output)) for index, output in enumerate(outputs)]
    assert infos[0]["cached_tokens"] == 32
    assert infos[0]["cached_tokens_details"] == {"device": 16, "host": 16, "disk": 0}
    assert infos[1]["cached_tokens"] == 0 and infos[1]["cached_tokens_details"] == {"device": 0, "host": 0, "disk": 0}


def test_tokenize_forms():
    job = parse_tokenize({"prompt": "Hi", "add_special_tokens": False}, MODEL)
    assert job.prompt == TextPrompt("Hi", add_special_tokens=False)
    chat = parse_tokenize({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False}, MODEL)
    assert isinstance(chat.prompt, ChatPrompt) and not chat.prompt.add_generation_prompt
    assert render_tokenize(job, [5, 6], MODEL, ["a", "b"]) == {"count": 2, "max_model_len": 100, "tokens": [5, 6]}
    strs = parse_tokenize({"prompt": "Hi", "return_token_strs": True}, MODEL)
    assert render_tokenize(strs, [5], MODEL, ["a"])["token_strs"] == ["a"]
    assert parse_detokenize({"tokens": [1, 2]}, MODEL) == [1, 2]


@pytest.mark.parametrize("parse, body, param", [
    (parse_tokenize, {}, "prompt"),
    (parse_tokenize, {"prompt": 3}, "prompt"),
    (parse_tokenize, {"prompt": "a", "messages": []}, "messages"),
    (parse_tokenize, {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
     "add_special_tokens"),
    (parse_tokenize, {"messages": [{"role": "user", "content": "a"}], "tools": [{}]}, "tools"),
    (parse_tokenize, {"messages": [{"role": "nobody", "content": "a"}]}, "messages[0].role"),
    (parse_detokenize, {}, "tokens"),
    (parse_detokenize, {"tokens": [1, -1]}, "tokens[1]"),
    (parse_detokenize, {"tokens": [1000]}, "tokens[0]"),
])
def test_token_route_refusals_name_the_field(parse, body, param):
    assert refused(parse, body).param == param
