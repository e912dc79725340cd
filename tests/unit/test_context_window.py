"""The one rule for fitting a prompt and its reply into the context window (ember.context_window)."""

from __future__ import annotations

import pytest

from ember.context_window import ContextWindow, fit_output
from ember.errors import ContextLengthExceeded, InvalidRequest

WINDOW = ContextWindow(max_model_len=100)


def test_the_window_is_the_smaller_of_the_model_and_the_cache():
    assert WINDOW.tokens == 100
    assert ContextWindow(100, kv_capacity_tokens=60).tokens == 60
    assert ContextWindow(100, kv_capacity_tokens=400).tokens == 100


@pytest.mark.parametrize("over_room", ["cap", "refuse"])
def test_refusals_are_the_same_under_both_policies(over_room):
    with pytest.raises(InvalidRequest) as caught:
        fit_output(WINDOW, 0, 4, over_room=over_room, prompt_param="messages")
    assert caught.value.param == "messages" and "empty" in caught.value.message
    for prompt in (100, 101):
        with pytest.raises(ContextLengthExceeded) as caught:
            fit_output(WINDOW, prompt, None, over_room=over_room, prompt_param="input")
        assert caught.value.param == "input" and caught.value.code == "context_length_exceeded"
        assert f"maximum context length is 100 tokens; your request has {prompt} prompt tokens" in caught.value.message


def test_a_prompt_only_request_may_fill_the_window():
    assert fit_output(WINDOW, 100, 0).max_tokens == 0
    with pytest.raises(ContextLengthExceeded):
        fit_output(WINDOW, 101, 0)


def test_no_max_tokens_runs_to_the_window_or_the_default():
    assert fit_output(WINDOW, 30, None).max_tokens == 70
    assert fit_output(WINDOW, 30, None).reaches_window
    assert fit_output(WINDOW, 30, None, default_max_tokens=16).max_tokens == 16
    assert not fit_output(WINDOW, 30, None, default_max_tokens=16).reaches_window
    assert fit_output(WINDOW, 90, None, default_max_tokens=16).max_tokens == 10


def test_beyond_the_room_http_caps_and_the_python_api_refuses():
    capped = fit_output(WINDOW, 90, 32000)
    assert (capped.max_tokens, capped.room, capped.reaches_window) == (10, 10, True)
    assert fit_output(WINDOW, 90, 10, over_room="refuse").max_tokens == 10
    with pytest.raises(InvalidRequest) as caught:
        fit_output(WINDOW, 90, 11, over_room="refuse")
    assert caught.value.param == "max_tokens" and caught.value.code == "context_length_exceeded"
    assert "max_tokens (11) plus the prompt (90 tokens)" in caught.value.message
    with pytest.raises(InvalidRequest, match="the KV cache holds 50 tokens"):
        fit_output(ContextWindow(100, 50), 40, 20, over_room="refuse")
