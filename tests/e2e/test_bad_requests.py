"""Malformed requests: each gets the right status and names the field at fault; none reaches the engine."""

from __future__ import annotations

import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return {"messages": HI, "max_tokens": 4, **fields}


def completion(**fields):
    return {"prompt": "Hi", "max_tokens": 4, **fields}


# (route, body, status, param)
CASES = [
    # messages
    (CHAT, {"max_tokens": 4}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "Hi"}, 400, "messages"),
    (CHAT, {"messages": ["Hi"]}, 400, "messages[0]"),
    (CHAT, {"messages": [{"content": "Hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": 42}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "messages[0].content[1].image_url.url"),  # a text model: vision_disabled, naming the image's URL
    (CHAT, {"messages": [HI[0], {"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, 400, "messages[1].content[0]"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, 400, "messages[0].content[0].text"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400, "messages[0].content[0]"),
    # numbers: wrong types, out of range, non-finite, booleans
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, chat(temperature=-1), 400, "temperature"),
    (CHAT, chat(temperature=True), 400, "temperature"),
    (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    (CHAT, chat(top_k=2.5), 400, "top_k"),
    (CHAT, chat(min_p=2), 400, "min_p"),
    (CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty=-2.5), 400, "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    (CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    (CHAT, chat(max_tokens=True), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=-5), 400, "max_completion_tokens"),
    (CHAT, chat(seed="abc"), 400, "seed"),
    (CHAT, chat(n=0), 400, "n"),
    (CHAT, chat(n=9), 400, "n"),
    (CHAT, chat(min_tokens=8), 400, "min_tokens"),
    (CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"10": 500}), 400, "logit_bias.10"),
    (CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (CHAT, chat(logprobs="yes"), 400, "logprobs"),
    # stop lists
    (CHAT, chat(stop=5), 400, "stop"),
    (CHAT, chat(stop=["ok", ""]), 400, "stop[1]"),
    (CHAT, chat(stop=["ok", 3]), 400, "stop[1]"),
    (CHAT, chat(stop=[str(i) for i in range(20)]), 400, "stop"),
    # flags and objects
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    (CHAT, chat(stream_options=[]), 400, "stream_options"),
    (CHAT, chat(ignore_eos=1), 400, "ignore_eos"),
    (CHAT, chat(user=12), 400, "user"),
    (CHAT, chat(metadata="x"), 400, "metadata"),
    (CHAT, chat(chat_template_kwargs="x"), 400, "chat_template_kwargs"),
    (CHAT, chat(chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs.tokenize"),
    # features ember cannot honour
    (CHAT, chat(response_format={"type": "json_object"}, guided_regex="a"), 400, "guided_regex"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]), 400,
     "tools[0].function.strict"),
    (CHAT, chat(tools=[{"type": "custom", "name": "f"}]), 400, "tools[0].type"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, chat(reasoning_effort="none", enable_thinking=True), 400, "reasoning_effort"),
    (CHAT, chat(guided_json=[{"type": "object"}]), 400, "guided_json"),
    # the model
    (CHAT, chat(model="gpt-4o"), 404, "model"),
    (CHAT, chat(model=12), 400, "model"),
    # completions
    (COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    (COMPLETIONS, completion(prompt=""), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=["one", "two"]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[1, 2, -3]), 400, "prompt[2]"),
    (COMPLETIONS, completion(prompt=[1, 10_000_000]), 400, "prompt[1]"),
    (COMPLETIONS, completion(prompt=[1, True]), 400, "prompt[1]"),
    (COMPLETIONS, completion(prompt={"text": "Hi"}), 400, "prompt"),
    (COMPLETIONS, completion(logprobs=True), 400, "logprobs"),
    (COMPLETIONS, completion(logprobs=2, echo=True), 400, "echo"),
    (COMPLETIONS, completion(suffix="end"), 400, "suffix"),
    (COMPLETIONS, completion(best_of=3), 400, "best_of"),
    (COMPLETIONS, completion(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
]


@pytest.mark.parametrize("route, body, status, param", CASES,
                         ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_request_names_the_field(http, route, body, status, param):
    reply = http.post(route, json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"] and error["type"]
    assert reply.headers["x-request-id"]


@pytest.mark.parametrize("body", [b'{"messages": [', b"not json at all", b"[1, 2", b"\xff\xfe"])
def test_malformed_json_is_400(http, body):
    reply = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


def test_body_that_is_not_a_json_object_is_400(http):
    reply = http.post(CHAT, json=[1, 2, 3])
    assert reply.status_code == 400 and "JSON object" in reply.json()["error"]["message"]


def test_non_finite_numbers_are_refused(http):
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}'
    reply = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "temperature"
    body = b'{"prompt": "Hi", "top_p": Infinity}'
    reply = http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_p"


def test_a_body_that_is_not_json_is_415(http):
    reply = http.post(CHAT, content=b"messages=hi", headers={"content-type": "application/x-www-form-urlencoded"})
    assert reply.status_code == 415 and reply.json()["error"]["code"] == "unsupported_media_type"
    reply = http.post(COMPLETIONS, content=b"Hi", headers={"content-type": "text/plain"})
    assert reply.status_code == 415


def test_unknown_fields_are_ignored_and_listed(http):
    reply = http.post(CHAT, json=chat(temperature=0, some_future_field={"x": 1}, another=[1, 2]))
    assert reply.status_code == 200
    assert reply.headers["x-ember-ignored-fields"] == "some_future_field, another"


def test_bad_requests_never_reach_the_engine(http):
    """After the whole table the engine saw no request from it, and the server is healthy."""
    before = http.get("/health").json()["engine"]
    for route, body, _, _ in CASES[:20]:
        http.post(route, json=body)
    after = http.get("/health").json()
    assert after["status"] == "ok"
    assert after["engine"]["prompt_tokens"] == before["prompt_tokens"]
    assert after["engine"]["generation_tokens"] == before["generation_tokens"]
