"""return_token_ids and token_sha on every dialect, whole and streamed, against a real ember serve:
token_sha is the hash of exactly the ids return_token_ids gives, and two runs of one greedy
request carry the same ids and the same hash."""

from __future__ import annotations

import hashlib

import anthropic
import pytest

from tests.e2e.conftest import wait_idle

ASK = "Name three colors."
GREEDY = {"temperature": 0, "max_tokens": 12}


def sha(token_ids: list[int]) -> str:
    """The documented definition, written out independently of the server's code."""
    return hashlib.sha256(",".join(str(t) for t in token_ids).encode()).hexdigest()


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def test_chat_token_ids_and_sha_whole_and_streamed(client, model_id, http):
    fields = {"model": model_id, "messages": [{"role": "user", "content": ASK}], **GREEDY,
              "extra_body": {"return_token_ids": True}}
    whole = client.chat.completions.create(**fields).model_dump()
    choice = whole["choices"][0]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 12
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    assert choice["token_sha"] == sha(choice["token_ids"])

    ids, finish_sha = [], None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for streamed in chunk.model_dump()["choices"]:
            ids += streamed.get("token_ids") or []
            finish_sha = streamed.get("token_sha") or finish_sha
    assert ids == choice["token_ids"] and finish_sha == choice["token_sha"]

    plain = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": ASK}],
                                           **GREEDY).model_dump()["choices"][0]
    assert "token_ids" not in plain and plain["token_sha"] == choice["token_sha"], "the hash needs no ids"
    other = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Say hi."}],
                                           **GREEDY).model_dump()["choices"][0]
    assert other["token_sha"] != choice["token_sha"]
    wait_idle(http)


def test_completions_token_sha_whole_and_streamed(client, model_id):
    fields = {"model": model_id, "prompt": "The capital of France is", **GREEDY,
              "extra_body": {"return_token_ids": True}}
    choice = client.completions.create(**fields).model_dump()["choices"][0]
    assert choice["token_sha"] == sha(choice["token_ids"])
    streamed = [c for chunk in client.completions.create(**fields, stream=True)
                for c in chunk.model_dump()["choices"] if c.get("token_sha")]
    assert [c["token_sha"] for c in streamed] == [choice["token_sha"]]


def test_responses_token_ids_and_sha_whole_and_streamed(client, model_id, http):
    fields = {"model": model_id, "input": ASK, "temperature": 0, "max_output_tokens": 12,
              "extra_body": {"return_token_ids": True}}
    whole = client.responses.create(**fields).model_dump()
    assert len(whole["token_ids"]) == whole["usage"]["output_tokens"] == 12
    assert len(whole["prompt_token_ids"]) == whole["usage"]["input_tokens"]
    assert whole["token_sha"] == sha(whole["token_ids"])
    final = None
    for event in client.responses.create(**fields, stream=True):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response.model_dump()
    assert (final["token_ids"], final["token_sha"]) == (whole["token_ids"], whole["token_sha"])
    stored = client.responses.retrieve(whole["id"]).model_dump()
    assert stored["token_sha"] == whole["token_sha"]
    plain = client.responses.create(model=model_id, input=ASK, temperature=0, max_output_tokens=12).model_dump()
    assert "token_ids" not in plain and plain["token_sha"] == whole["token_sha"]
    wait_idle(http)


def test_messages_token_ids_and_sha_whole_and_streamed(claude, http):
    fields = {"model": "ember-local", "max_tokens": 12, "messages": [{"role": "user", "content": ASK}],
              "extra_body": {"temperature": 0, "return_token_ids": True}}
    whole = claude.messages.create(**fields).model_dump()
    assert len(whole["token_ids"]) == whole["usage"]["output_tokens"] == 12
    assert whole["token_sha"] == sha(whole["token_ids"])
    assert len(whole["prompt_token_ids"]) == whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"]
    with claude.messages.stream(**fields) as stream:
        deltas = [event.model_dump() for event in stream if event.type == "message_delta"]
    assert [(d["token_ids"], d["token_sha"]) for d in deltas] == [(whole["token_ids"], whole["token_sha"])]
    wait_idle(http)


def test_generate_meta_info_token_sha(http):
    body = http.post("/generate", json={"text": "The capital of France is",
                                        "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert body["meta_info"]["token_sha"] == sha(body["output_ids"])
