"""The reference servers' fields through the client libraries, on the shared servers: what ember
honours, refuses by name or lists as ignored; the thinking budget's room; timings; the message cap;
/generate's meta_info and chat's metadata; /health and the model card; sessions."""

from __future__ import annotations

import time

import anthropic
import openai
import pytest

from tests.e2e.conftest import THINKING_BUDGET, wait_idle

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def thinking_client(thinking_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value


def test_verbosity_store_and_the_other_route_s_prompt_field(client, model_id):
    reply = client.chat.completions.create(model=model_id, messages=HI, max_tokens=2, verbosity="medium",
                                           store=False)
    assert reply.choices[0].finish_reason in ("stop", "length")
    for fields, param in (({"verbosity": "low"}, "verbosity"), ({"store": True}, "store")):
        error = refused(lambda: client.chat.completions.create(model=model_id, messages=HI, max_tokens=2, **fields))
        assert error.body["param"] == param and error.body["code"] == "unsupported_parameter"
    error = refused(lambda: client.completions.create(model=model_id, prompt="Hi", max_tokens=2,
                                                      extra_body={"messages": HI}))
    assert error.body["param"] == "messages" and "/v1/chat/completions" in error.body["message"]
    error = refused(lambda: client.chat.completions.create(model=model_id, messages=HI, max_tokens=2,
                                                           extra_body={"prompt": "Hi"}))
    assert error.body["param"] == "prompt"


def test_responses_verbosity_and_summary_are_listed_as_ignored(client, model_id):
    raw = client.responses.with_raw_response.create(model=model_id, input="Hi", max_output_tokens=4,
                                                    text={"verbosity": "low"}, reasoning={"summary": "auto"})
    assert raw.headers["x-ember-ignored-fields"] == "text.verbosity, reasoning.summary"
    response = raw.parse()
    assert response.text.verbosity == "low" and response.reasoning.summary == "auto"


def test_a_thinking_budget_without_room_for_its_close_is_refused(thinking_client):
    model = thinking_client.models.list().data[0].id
    ask = lambda **fields: thinking_client.chat.completions.create(model=model, messages=HI, **fields)
    error = refused(lambda: ask(max_tokens=THINKING_BUDGET + 1))  # the server's budget, then no room
    assert error.body["code"] == "thinking_budget_capacity_insufficient" and error.body["param"] == "max_tokens"
    error = refused(lambda: ask(max_tokens=21, extra_body={"thinking_budget": 20}))
    assert error.body["code"] == "thinking_budget_capacity_insufficient" and error.body["param"] == "thinking_budget"
    reply = ask(max_tokens=THINKING_BUDGET, temperature=0)  # ends inside the budget: nothing to close
    assert reply.usage.completion_tokens <= THINKING_BUDGET
    reply = ask(max_tokens=THINKING_BUDGET + 12, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_timings_carry_per_token_milliseconds_on_the_finish_and_usage_chunks(client, model_id):
    whole = client.chat.completions.create(model=model_id, messages=HI, max_tokens=6, temperature=0)
    timings = whole.model_extra["timings"]
    assert timings["prompt_per_token_ms"] >= 0 and timings["predicted_per_token_ms"] >= 0
    if timings["prompt_n"] and timings["prompt_ms"]:
        assert timings["prompt_per_token_ms"] == pytest.approx(timings["prompt_ms"] / timings["prompt_n"])
    for include_usage in (False, True):
        chunks = list(client.chat.completions.create(model=model_id, messages=HI, max_tokens=6, temperature=0,
                                                     stream=True, stream_options={"include_usage": include_usage}))
        carrying = [c for c in chunks if "timings" in (c.model_extra or {})]
        assert len(carrying) == 1 and carrying[0] is chunks[-1]
        assert {"prompt_per_token_ms", "predicted_per_token_ms"} <= set(carrying[0].model_extra["timings"])
        assert bool(carrying[0].usage) == include_usage


def test_a_conversation_past_the_message_cap_is_refused_on_both_dialects(server, client, model_id):
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "ok"} for i in range(257)]
    error = refused(lambda: client.chat.completions.create(model=model_id, messages=long, max_tokens=1))
    assert error.body["param"] == "messages" and error.body["code"] == "too_many_messages"
    messages = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as caught:
        messages.messages.create(model=model_id, max_tokens=1, messages=long)
    assert "256" in caught.value.message


def test_generate_meta_info_and_chat_metadata(http, client, model_id):
    info = http.post("/generate", json={"text": "The capital of France is",
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()["meta_info"]
    assert info["weight_version"] == "default"
    assert info["weight_versions"] == [{"version": "default", "start": 0, "end": info["completion_tokens"]}]
    assert info["num_retractions"] == 0 and info["dp_rank"] is None and info["reasoning_tokens"] == 0
    assert (info["request_received_ts"] <= info["api_server_dispatch_finish_ts"] <= info["forward_entry_time"]
            <= info["response_sent_to_client_ts"])
    assert "cached_tokens_details" in info  # the cache tiers' split stays
    reply = client.chat.completions.create(model=model_id, messages=HI, max_tokens=3, temperature=0)
    assert reply.metadata["weight_version"] == "default"  # SDK types declare metadata as a string map


def test_health_and_the_model_card_say_what_is_loaded(http, model_id):
    health = http.get("/health").json()
    card = http.get(f"/v1/models/{model_id}").json()
    for body in (health, card):
        assert body["weights_format"] in ("safetensors", "gguf") and body["weights"]
        assert body["gb"] > 0 and 1 <= body["bpw"] <= 32
        assert body["prefix_cache"] is True and body["slots"] == 24
    assert health["deployment_id"].startswith("fp_") and len(health["component_set_sha"]) == 64
    assert health["routed_experts"] is None  # a dense model
    assert card["root"] == model_id and card["aliases"] == []


def test_a_session_is_tagged_in_debug_requests_and_counted(http, client, model_id):
    wait_idle(http)
    client.chat.completions.create(model=model_id, messages=HI, max_tokens=2, prompt_cache_key="conv-42")
    client.chat.completions.create(model=model_id, messages=HI, max_tokens=2,
                                   extra_headers={"X-Session-Id": "sess-7"})
    client.chat.completions.create(model=model_id, messages=HI, max_tokens=2, prompt_cache_key="conv-42",
                                   extra_headers={"X-Session-Id": "sess-7"})  # the body's key wins
    expected = ["conv-42", "sess-7", "conv-42"]
    deadline = time.monotonic() + 30  # a liveness wait: each entry is written as its request ends
    while (sessions := [e.get("session") for e in http.get("/debug/requests").json()["data"][-3:]]) != expected:
        assert time.monotonic() < deadline, sessions
        time.sleep(0.1)
    assert 'ember:session_requests_total{route="chat"}' in http.get("/metrics").text
