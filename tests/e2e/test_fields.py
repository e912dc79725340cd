"""Fields the seeds define, honoured or refused by name, against a real `ember serve` through the
`openai` and `anthropic` libraries: Anthropic sampling fields, Responses aliases, spellings that
conflict, fresh seeds recorded for replay, prompt-only requests, matched_stop, n, health names, and
stream errors (an in-process server with an injected engine fault)."""

from __future__ import annotations

import asyncio
import json
import uuid

import anthropic
import openai
import pytest

from tests.e2e.conftest import wait_idle
from tests.e2e.responses_stream import check_stream, raw_events

STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper and the sea."}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def claude_text(claude, **body) -> tuple[str, object]:
    message = claude.messages.create(model="claude", max_tokens=body.pop("max_tokens", 24), messages=STORY,
                                     extra_body=body)
    return "".join(block.text for block in message.content if block.type == "text"), message


@pytest.fixture(scope="module")
def ask(client, model_id):
    """A chat completion on the served model, of STORY unless other messages are given."""
    def create(**fields):
        return client.chat.completions.create(model=model_id, messages=fields.pop("messages", STORY), **fields)
    return create


# ---- 1. Anthropic Messages: seed, min_p, penalties, stop, max_completion_tokens ---------------------------

def test_a_seeded_anthropic_reply_is_reproducible_and_another_seed_changes_it(claude):
    first, _ = claude_text(claude, temperature=1.0, seed=11)
    again, _ = claude_text(claude, temperature=1.0, seed=11)
    other, _ = claude_text(claude, temperature=1.0, seed=12)
    assert first and first == again
    assert other != first
    narrowed, _ = claude_text(claude, temperature=1.0, seed=11, min_p=0.5)
    assert narrowed != first  # the same draws, from fewer tokens


def test_anthropic_penalties_stop_and_max_completion_tokens_take_effect(claude):
    plain, _ = claude_text(claude, temperature=0, max_tokens=40)
    penalized, _ = claude_text(claude, temperature=0, max_tokens=40, repetition_penalty=2.0)
    assert penalized != plain
    word = plain.split()[3]
    cut, message = claude_text(claude, temperature=0, max_tokens=40, stop=[word])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert plain.startswith(cut) and word not in cut
    message = claude.messages.create(model="claude", max_tokens=40, messages=STORY,
                                     extra_body={"temperature": 0, "max_completion_tokens": 40})
    assert message.usage.output_tokens == 40 and message.stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="claude", max_tokens=40, messages=STORY,
                               extra_body={"max_completion_tokens": 8})
    assert "max_tokens" in str(caught.value) and "max_completion_tokens" in str(caught.value)


# ---- 2. Responses: max_tokens and other chat spellings ---------------------------------------------------

def test_responses_max_tokens_bounds_the_output_and_stop_sequences_and_ignore_eos_apply(client, model_id):
    bounded = client.responses.create(model=model_id, input="Tell me about the sea.", temperature=0,
                                      extra_body={"max_tokens": 5})
    assert bounded.usage.output_tokens == 5 and bounded.status == "incomplete"
    assert bounded.max_output_tokens == 5
    also = client.responses.create(model=model_id, input="Tell me about the sea.", temperature=0,
                                   extra_body={"max_completion_tokens": 6})
    assert also.usage.output_tokens == 6

    whole = client.responses.create(model=model_id, input="Tell me about the sea.", temperature=0,
                                    max_output_tokens=40)
    word = whole.output_text.split()[3]
    cut = client.responses.create(model=model_id, input="Tell me about the sea.", temperature=0,
                                  max_output_tokens=40, extra_body={"stop_sequences": [word]})
    assert whole.output_text.startswith(cut.output_text) and word not in cut.output_text
    assert cut.status == "completed"

    short = client.responses.create(model=model_id, input="Say hi.", temperature=0, max_output_tokens=60)
    assert short.status == "completed" and short.usage.output_tokens < 60  # it ends by itself
    kept_going = client.responses.create(model=model_id, input="Say hi.", temperature=0, max_output_tokens=60,
                                         extra_body={"ignore_eos": True})
    assert kept_going.usage.output_tokens == 60


# ---- 3. Chat and Completions: stop_sequences, conflicting spellings ----------------------------------

def test_chat_stop_sequences_is_stop_and_conflicting_spellings_are_refused_naming_both(client, model_id, ask):
    whole = ask(temperature=0, max_tokens=40)
    text = whole.choices[0].message.content
    word = text.split()[3]
    cut = ask(temperature=0, max_tokens=40, extra_body={"stop_sequences": [word]})
    assert cut.choices[0].finish_reason == "stop" and text.startswith(cut.choices[0].message.content)
    assert cut.choices[0].model_dump()["matched_stop"] == word
    plain = client.completions.create(model=model_id, prompt="The sea is", temperature=0, max_tokens=20)
    stop = plain.choices[0].text.split()[2]
    completion = client.completions.create(model=model_id, prompt="The sea is", temperature=0, max_tokens=20,
                                           extra_body={"stop_sequences": [stop]})
    assert completion.choices[0].finish_reason == "stop" and stop not in completion.choices[0].text

    for extra in ({"max_tokens": 5, "max_completion_tokens": 6}, {"stop": ["a"], "stop_sequences": ["b"]}):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(extra_body=extra)
        names = list(extra)
        assert all(name in caught.value.body["message"] for name in names)
        assert caught.value.body["param"] in names and caught.value.body["code"] == "conflicting_parameters"


# ---- 4. fresh seeds, recorded so a reply can be redone -------------------------------------------------

def test_a_request_without_a_seed_records_the_seed_it_drew_and_replaying_it_gives_the_same_reply(ask, http):
    for seed in (None, -1):
        request_id = f"fresh-seed-{uuid.uuid4().hex[:8]}"
        extra = {} if seed is None else {"seed": seed}
        reply = ask(temperature=1.0, max_tokens=24, extra_body=extra,
                     extra_headers={"x-request-id": request_id})
        entry = next(e for e in http.get("/debug/requests").json()["data"] if e["request_id"] == request_id)
        drawn = entry["sampling"]["seed"]
        assert isinstance(drawn, int) and drawn >= 0
        replay = ask(temperature=1.0, max_tokens=24, seed=drawn)
        assert replay.choices[0].message.content == reply.choices[0].message.content


# ---- 5. a zero output limit: the prompt only --------------------------------------------------------------

def test_max_tokens_zero_prefills_the_prompt_in_every_dialect_and_leaks_nothing(client, model_id, ask, claude, http):
    long_prompt = f"Session {uuid.uuid4().hex}. " + "The keeper logged the weather each hour. " * 12
    messages = [{"role": "user", "content": long_prompt}]
    warm = ask(messages=messages, max_tokens=0)
    assert warm.choices[0].message.content == "" and warm.choices[0].finish_reason == "length"
    assert warm.usage.completion_tokens == 0 and warm.usage.prompt_tokens > 50
    after = ask(messages=messages, max_tokens=3, temperature=0)
    warmed = after.usage.prompt_tokens_details.cached_tokens - warm.usage.prompt_tokens_details.cached_tokens
    assert warmed >= 48  # the prompt-only request left its whole blocks in the prefix cache
    assert after.usage.completion_tokens == 3

    again = ask(messages=messages, max_completion_tokens=0, stream=True,
                 stream_options={"include_usage": True})
    chunks = list(again)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == warm.usage.prompt_tokens

    message = claude.messages.create(model="claude", max_tokens=0, messages=messages)
    assert message.content == [] and message.usage.output_tokens == 0 and message.stop_reason == "max_tokens"
    assert message.usage.cache_read_input_tokens >= 48
    response = client.responses.create(model=model_id, input=long_prompt, max_output_tokens=0)
    assert response.output == [] and response.usage.output_tokens == 0 and response.usage.input_tokens > 50
    text = client.completions.create(model=model_id, prompt=long_prompt, max_tokens=0)
    assert text.choices[0].text == "" and text.usage.completion_tokens == 0
    wait_idle(http)


# ---- 14. matched_stop and usage.reasoning_tokens --------------------------------------------------------

def test_chat_replies_carry_matched_stop_and_flat_reasoning_tokens(ask):
    ended = ask(messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=60)
    body = ended.model_dump()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(body["choices"][0]["matched_stop"], int)  # the end-of-sequence token's id
    assert body["usage"]["reasoning_tokens"] == 0
    cut = ask(temperature=0, max_tokens=3).model_dump()
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["matched_stop"] is None
    word = ask(temperature=0, max_tokens=40).choices[0].message.content.split()[2]
    streamed = list(ask(temperature=0, max_tokens=40, stop=[word], stream=True))
    closing = [c.model_dump() for c in streamed if c.choices and c.choices[0].finish_reason]
    assert closing[-1]["choices"][0]["matched_stop"] == word


# ---- 16. n on Responses and Messages ------------------------------------------------------------------

def test_n_above_one_is_refused_by_name_on_responses_and_messages(client, model_id, claude):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model_id, input="Hi", extra_body={"n": 2})
    assert caught.value.body["param"] == "n"
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="claude", max_tokens=8, messages=STORY, extra_body={"n": 2})
    assert "n must be 1" in str(refused.value)
    one = claude.messages.create(model="claude", max_tokens=4, messages=STORY, extra_body={"n": 1})
    assert one.usage.output_tokens >= 1


# ---- 12. health under the seeds' names ---------------------------------------------------------------

def test_healthz_and_the_seeds_health_names(ask, http):
    before = http.get("/healthz")
    assert before.status_code == 200
    body = before.json()
    assert body["status"] == "ok" and body["context_length"] <= body["max_model_len"] == 1024
    assert body["live_rows"] == body["requests_running"] and body["waiting"] == body["requests_waiting"]
    assert isinstance(body["busy"], bool)
    assert set(body["streams"]) == {"decoding", "prefilling", "max"} and body["streams"]["max"] == 24
    ask(max_tokens=2)
    after = wait_idle(http)
    assert after["requests_total"] > body["requests_total"] and after["rounds_total"] > body["rounds_total"]
    assert after["busy"] is False and http.head("/healthz").status_code == 200


# ---- 13. stream errors (a device fault injected into the engine worker) -------------------------------------

def test_a_chat_stream_error_carries_the_request_id_and_a_responses_stream_error_is_error_then_failed():
    from tests.e2e.test_faults import config, wait_for, with_app

    async def scenario(client):
        await wait_for(client, "ok")
        body = {"messages": STORY, "max_tokens": 50, "temperature": 0, "stream": True}
        reply = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "broken-chat-1"})
        events = [json.loads(line[6:]) for line in reply.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["error"]["type"] == "server_error" and events[-1]["request_id"] == "broken-chat-1"

    asyncio.run(with_app(scenario, config("raise@6")))

    async def responses_scenario(client):
        await wait_for(client, "ok")
        reply = await client.post("/v1/responses", json={"input": "Tell me about the sea.", "stream": True,
                                                         "temperature": 0, "max_output_tokens": 50})
        frames, name = [], None
        for line in reply.text.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                frames.append((name, json.loads(line[6:])))
        assert [data["type"] for _, data in frames[-2:]] == ["error", "response.failed"]
        assert "injected device fault" in frames[-2][1]["message"]
        final = check_stream(frames)
        assert final["status"] == "failed"

    asyncio.run(with_app(responses_scenario, config("raise@6")))


def test_a_responses_stream_that_ends_well_has_no_error_event(http):
    events = raw_events(http, {"input": "Hi", "temperature": 0, "max_output_tokens": 4})
    assert all(data["type"] != "error" for _, data in events)
    assert check_stream(events)["status"] == "incomplete"
