"""Ollama's API end to end: the `ollama` Python client, unchanged, against a real `ember serve` on the
default model (the shared `server`), and the reasoning template's (`thinking_server`) for `think`.
Greedy replies equal the OpenAI route's for the same request."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from tests.e2e.conftest import wait_idle

ASK = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0, "seed": 7, "num_predict": 16}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def olla(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def openai_reply(client: openai.OpenAI, model: str, messages, max_tokens: int = 16, **fields):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, seed=7,
                                          max_tokens=max_tokens, **fields).choices[0]


def test_chat_whole_and_streamed_equal_the_openai_route(olla, client, model_id, http):
    whole = olla.chat(model=model_id, messages=ASK, options=GREEDY, stream=False)
    assert whole.done is True and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.message.content == openai_reply(client, model_id, ASK).message.content
    assert whole.eval_count > 0 and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.eval_duration > 0 and whole.prompt_eval_duration > 0
    parts = list(olla.chat(model=model_id, messages=ASK, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason
    wait_idle(http)


def test_generate_whole_and_streamed_equal_the_openai_chat_route(olla, client, model_id):
    whole = olla.generate(model=model_id + ":latest", prompt="Name three colors.", options=GREEDY, stream=False)
    assert whole.model == model_id + ":latest"
    assert whole.response == openai_reply(client, model_id, ASK).message.content
    streamed = "".join(part.response for part in olla.generate(model=model_id, prompt="Name three colors.",
                                                               options=GREEDY, stream=True))
    assert streamed == whole.response


def test_raw_generate_continues_the_text_as_it_is(olla, client, model_id):
    reply = olla.generate(model=model_id, prompt="The capital of France is", raw=True, options=GREEDY)
    completion = client.completions.create(model=model_id, prompt="The capital of France is", temperature=0,
                                           seed=7, max_tokens=16)
    assert reply.response == completion.choices[0].text


def test_format_json_and_a_schema_hold_the_answer(olla, client, model_id):
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    loose = olla.chat(model=model_id, messages=ask, format="json", options={"temperature": 0, "num_predict": 24})
    expected = openai_reply(client, model_id, ask, max_tokens=24, response_format={"type": "json_object"})
    assert loose.message.content.startswith("{") and loose.message.content == expected.message.content
    held = olla.generate(model=model_id, prompt="Describe a person as JSON.", format=PERSON,
                         options={"temperature": 0, "num_predict": 64})
    person = json.loads(held.response)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)


def test_tool_calls_carry_object_arguments_and_equal_the_openai_route(olla, client, model_id):
    ask = [{"role": "user", "content": "Call get_weather with city Paris"}]
    reply = olla.chat(model=model_id, messages=ask, tools=[WEATHER], options={"temperature": 0, "num_predict": 64})
    expected = openai_reply(client, model_id, ask, max_tokens=64, tools=[WEATHER]).message.tool_calls
    assert expected, "the default model calls the tool at this prompt"
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in expected]
    streamed = [call for part in olla.chat(model=model_id, messages=ask, tools=[WEATHER], stream=True,
                                           options={"temperature": 0, "num_predict": 64})
                for call in part.message.tool_calls or []]
    assert streamed == list(reply.message.tool_calls)
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": reply.message.tool_calls},
               {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    answer = olla.chat(model=model_id, messages=history, tools=[WEATHER], options=GREEDY)
    assert answer.prompt_eval_count > reply.prompt_eval_count  # the call and its result reached the prompt


def test_think_gives_the_reasoning_apart_as_the_openai_route_does(thinking_server):
    olla = ollama.Client(host=thinking_server.url, timeout=120)
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model_id = client.models.list().data[0].id
    reply = olla.chat(model=model_id, messages=ASK, think=True, options={"temperature": 0, "num_predict": 32})
    expected = client.chat.completions.create(model=model_id, messages=ASK, temperature=0, max_tokens=32,
                                              extra_body={"enable_thinking": True}).choices[0].message
    assert reply.message.thinking and reply.message.thinking == expected.reasoning_content
    assert reply.message.content == expected.content
    assert "thinking" in olla.show(model_id).capabilities


def test_list_show_ps_and_version_describe_the_served_model(olla, model_id, http):
    (listed,) = olla.list().models
    assert listed.model == model_id and listed.details.format == "gguf" and listed.size > 0
    assert listed.details.family and listed.details.parameter_size and listed.details.quantization_level
    shown = olla.show(model_id)
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.template and "num_ctx" in shown.parameters
    assert shown.modelinfo["general.architecture"] == listed.details.family
    (running,) = olla.ps().models
    assert running.model == model_id and running.context_length == 1024 and running.size > 0
    assert running.expires_at.year > 2100  # one model, loaded for good
    assert http.get("/api/version").json()["version"]


def test_a_load_request_of_the_loaded_model_answers_at_once(http, model_id):
    reply = http.post("/api/chat", json={"model": model_id, "messages": []})
    assert reply.status_code == 200 and reply.json()["done_reason"] == "load"
    assert reply.json()["message"] == {"role": "assistant", "content": ""}
    reply = http.post("/api/generate", json={"model": model_id, "keep_alive": -1})
    assert reply.json()["response"] == "" and "x-ember-ignored-fields" not in reply.headers
    assert http.post("/api/generate", json={"model": "other-model"}).status_code == 404


def test_unknown_and_runner_options_are_listed_and_unmatched_samplers_refused(http, model_id):
    body = {"model": model_id, "prompt": "Hi", "stream": False,
            "options": {"num_predict": 2, "num_gpu": 1, "glitter": 2}}
    reply = http.post("/api/generate", json=body)
    assert reply.status_code == 200 and reply.headers["x-ember-ignored-fields"] == "options.num_gpu, options.glitter"
    refused = http.post("/api/generate", json={**body, "options": {"mirostat": 2}})
    assert refused.status_code == 400 and "mirostat" in refused.json()["error"]


@pytest.mark.parametrize("path, body, status, words", [
    ("/api/chat", {"model": "llama3.2", "messages": ASK}, 404, "llama3.2"),
    ("/api/chat", {"messages": ASK}, 400, "model is required"),
    ("/api/chat", {"model": "M", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/api/generate", {"model": "M", "prompt": "x", "suffix": "y"}, 400, "fill-in-the-middle"),
    ("/api/generate", {"model": "M", "prompt": "x", "format": "yaml"}, 400, "format"),
    ("/api/generate", {"model": "M", "prompt": "x", "images": ["aGVsbG8="]}, 400, "images"),
    ("/api/pull", {"model": "llama3.2"}, 400, "not a Hugging Face repo id"),
])
def test_bad_bodies_get_ollama_shaped_errors(http, model_id, path, body, status, words):
    body = {**body, "model": model_id} if body.get("model") == "M" else body
    reply = http.post(path, json=body)
    assert reply.status_code == status and list(reply.json()) == ["error"] and words in reply.json()["error"]


def test_not_json_is_an_ollama_shaped_400(server):
    reply = httpx.post(server.url + "/api/chat", content=b"{", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and list(reply.json()) == ["error"]


def test_pull_of_the_served_model_succeeds_and_delete_is_refused(olla, model_id):
    assert [part.status for part in olla.pull(model_id, stream=True)] == ["pulling manifest", "success"]
    assert olla.pull(model_id).status == "success"
    with pytest.raises(ollama.ResponseError) as refused:
        olla.delete(model_id)
    assert refused.value.status_code == 403 and "does not delete" in refused.value.error
