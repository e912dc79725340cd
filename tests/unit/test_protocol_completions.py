"""Completions validation and the neutral request's context-window arithmetic: pure logic."""

from __future__ import annotations

import pytest

from ember.errors import ContextLengthExceeded, InvalidRequest
from ember.protocols.neutral import GenerationRequest, ModelInfo, TextPrompt, TokenPrompt, choice_seeds, \
    resolve_sampling
from ember.protocols.openai_completions import parse_completion
from ember.types import SamplingParams

MODEL = ModelInfo(name="served", max_model_len=100, vocab_size=1000)


def parse(**fields):
    return parse_completion({"prompt": "Hi", **fields}, MODEL)


def refused(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_completion(body, MODEL)
    return caught.value


def test_prompt_forms():
    assert parse().prompt == TextPrompt("Hi")
    assert parse(prompt=["Hi"]).prompt == TextPrompt("Hi")
    assert parse(prompt=[1, 2, 3]).prompt == TokenPrompt([1, 2, 3])
    assert parse(prompt=[[4, 5]]).prompt == TokenPrompt([4, 5])
    assert parse().prompt_param == "prompt"


@pytest.mark.parametrize("prompt, param", [
    ("", "prompt"), ([], "prompt"), ([[]], "prompt"), (["a", "b"], "prompt"), ([[1], [2]], "prompt"),
    ([1, "a"], "prompt[1]"), ([1, 2.5], "prompt[1]"), ([0, 1000], "prompt[1]"), (7, "prompt"), (None, "prompt"),
])
def test_bad_prompts(prompt, param):
    assert refused({"prompt": prompt}).param == param


def test_completion_fields():
    request = parse(echo=True, n=2, best_of=2, logprobs=None, stream=True, return_token_ids=True)
    assert request.echo and request.n == 2 and request.stream and request.return_token_ids
    assert parse(logprobs=3).params.logprobs == 3
    assert refused({"prompt": "x", "logprobs": 1, "echo": True}).param == "echo"
    assert refused({"prompt": "x", "best_of": 4}).param == "best_of"
    assert refused({"prompt": "x", "suffix": "y"}).param == "suffix"
    assert parse(suffix="").n == 1


def request_with(max_tokens=None, min_tokens=0, param="prompt") -> GenerationRequest:
    return GenerationRequest(TextPrompt("x"), SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens),
                             prompt_param=param)


def fitted(request, num_prompt_tokens, model) -> tuple[int, bool]:
    params, fit = resolve_sampling(request, num_prompt_tokens, model)
    assert params.max_tokens == fit.max_tokens
    return fit.max_tokens, fit.reaches_window


def test_max_tokens_is_capped_to_the_room_left():
    assert fitted(request_with(32000), 90, MODEL) == (10, True)
    assert fitted(request_with(5), 90, MODEL) == (5, False)
    assert fitted(request_with(None), 40, MODEL) == (60, True)
    defaulted = ModelInfo(name="m", max_model_len=100, vocab_size=10, default_max_tokens=16)
    assert fitted(request_with(None), 40, defaulted) == (16, False)
    assert fitted(request_with(None), 95, defaulted) == (5, True)
    small_cache = ModelInfo(name="m", max_model_len=100, vocab_size=10, kv_capacity_tokens=50)
    assert fitted(request_with(None), 40, small_cache) == (10, True)


def test_a_prompt_that_fills_the_window_is_refused_with_the_usual_words():
    for num_prompt_tokens in (100, 150):
        with pytest.raises(ContextLengthExceeded) as caught:
            resolve_sampling(request_with(4, param="messages"), num_prompt_tokens, MODEL)
        error = caught.value
        assert error.code == "context_length_exceeded" and error.param == "messages" and error.status == 400
        assert (f"This model's maximum context length is 100 tokens; your request has {num_prompt_tokens} "
                f"prompt tokens") in error.message
    with pytest.raises(InvalidRequest) as caught:
        resolve_sampling(request_with(4), 0, MODEL)
    assert caught.value.param == "prompt"


def test_min_tokens_beyond_the_room_is_refused():
    with pytest.raises(InvalidRequest) as caught:
        resolve_sampling(request_with(50, min_tokens=20), 90, MODEL)
    assert caught.value.param == "min_tokens"


def test_seeded_choices_get_distinct_seeds():
    params = SamplingParams(seed=10, temperature=1.0)
    assert [p.seed for p in choice_seeds(params, 3)] == [10, 11, 12]
    unseeded = SamplingParams(temperature=1.0)
    assert choice_seeds(unseeded, 2) == [unseeded, unseeded]
