"""Request bodies read with limits (ember.protocols.json_body): every refusal a 400 that says where."""

from __future__ import annotations

import pytest

from ember.errors import InvalidRequest
from ember.protocols.json_body import MAX_DEPTH, MAX_ITEMS, parse_body


def refusal(body: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_body(body)
    assert caught.value.status == 400 and caught.value.code == "invalid_json"
    return caught.value


def test_ordinary_bodies_read_as_json():
    assert parse_body(b'{"messages": [{"role": "user", "content": "h\\u00e9 \\ud83d\\ude00"}], "t": 0.5}') == {
        "messages": [{"role": "user", "content": "h\u00e9 \U0001F600"}], "t": 0.5}
    assert parse_body(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None


def test_deep_nesting_is_refused_whatever_the_depth():
    for depth in (MAX_DEPTH + 1, 5_000, 100_000):
        error = refusal(b"[" * depth + b"]" * depth)
        assert f"deeper than {MAX_DEPTH}" in error.message
    error = refusal(b'{"tools": [' + b'{"a": ' * MAX_DEPTH + b"1" + b"}" * MAX_DEPTH + b"]}")
    assert error.param.startswith("tools[0].a.a")


@pytest.mark.parametrize("body, param, words", [
    (b'{"messages": [{"content": "a\\u0000b"}]}', "messages[0].content", "NUL"),
    (b'{"stop": ["\\ud800"]}', "stop[0]", "surrogate"),
    (b'{"x\\u0000": 1}', "x\x00", "NUL"),
    (b'{"temperature": 1e999}', "temperature", "beyond the range"),
    (b'{"logit_bias": {"5": -1e400}}', "logit_bias.5", "beyond the range"),
    (b'{"top_p": NaN}', "top_p", "not a JSON number"),
    (b'{"top_p": Infinity}', "top_p", "not a JSON number"),
])
def test_values_that_are_not_text_or_numbers_are_named(body, param, words):
    error = refusal(body)
    assert error.param == param and words in error.message


def test_bytes_that_are_not_utf8_or_not_json_are_refused():
    assert "not UTF-8" in refusal(b'{"a": "\xff"}').message
    assert "not valid JSON" in refusal(b'{"a": ').message
    assert "empty" in refusal(b"  ").message
    assert "not valid JSON" in refusal(b'{"n": ' + b"9" * 5000 + b"}").message  # more digits than Python converts


def test_an_array_of_too_many_entries_is_refused():
    error = refusal(b'{"messages": [' + b",".join([b"0"] * (MAX_ITEMS + 1)) + b"]}")
    assert error.param == "messages" and str(MAX_ITEMS) in error.message
