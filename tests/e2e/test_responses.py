"""OpenAI Responses end to end through the openai library: create, stream, store, continue, retrieve,
delete, input items, input token counts, tools, refusals."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response

from tests.e2e.conftest import wait_idle
from tests.e2e.responses_stream import check_stream, raw_events

BLOCK_SIZE = 16  # the engine's KV block: the prefix cache finds whole blocks
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": False}
ASK = "What is the weather in Paris?"


def create(client, model_id, **fields) -> Response:
    fields = {"model": model_id, "temperature": 0, "max_output_tokens": 32, **fields}
    return client.responses.create(**fields)


def streamed(http, model_id, **fields) -> dict:
    return check_stream(raw_events(http, {"model": model_id, "temperature": 0, "max_output_tokens": 32, **fields}))


def error_of(reply) -> dict:
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_a_created_response_has_every_field_and_is_stored(client, model_id, http):
    reply = create(client, model_id, input="Tell me about the sea.", instructions="Answer briefly.",
                   metadata={"topic": "sea"})
    raw = http.get(f"/v1/responses/{reply.id}").json()
    Response.model_validate(raw)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == model_id
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert raw["completed_at"] is None and isinstance(raw["created_at"], int)
    [message] = reply.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "output_text" and reply.output_text
    usage = reply.usage
    assert usage.output_tokens == 32 and usage.total_tokens == usage.input_tokens + 32
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert reply.instructions == "Answer briefly." and reply.metadata == {"topic": "sea"}
    assert reply.temperature == 0 and reply.max_output_tokens == 32 and reply.store is not False
    assert raw["output"] == reply.model_dump(mode="json", exclude_unset=True)["output"]

    done = create(client, model_id, input="Say hi.", max_output_tokens=200)
    assert done.status == "completed" and done.completed_at >= done.created_at
    assert done.incomplete_details is None
    wait_idle(http)


def test_a_stream_follows_the_event_lifecycle_and_is_retrievable_once_done(client, model_id, http):
    final = streamed(http, model_id, input="Count from one to five.")
    assert http.get(f"/v1/responses/{final['id']}").json() == final
    whole = create(client, model_id, input="Count from one to five.")
    assert final["status"] == whole.status
    assert [p["text"] for p in final["output"][0]["content"]] == [whole.output_text]
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens

    # The SDK's typed events carry the same lifecycle.
    kinds = [event.type for event in create(client, model_id, input="Count from one to five.", stream=True)]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == f"response.{whole.status}"


def test_a_three_turn_chain_reuses_the_cached_prefix(client, model_id, http):
    first = create(client, model_id, input="Name a colour.", instructions="You answer in one sentence.")
    second = create(client, model_id, input="Name another one.", previous_response_id=first.id)
    third = create(client, model_id, input="And a third.", previous_response_id=second.id)
    assert second.previous_response_id == first.id and second.instructions is None
    for before, after in ((first, second), (second, third)):
        # The new prompt starts with the exact tokens of the last prompt and reply; the cache finds every
        # whole block of them (the reply's last token was never computed, so it cannot be cached).
        seen = before.usage.input_tokens + before.usage.output_tokens - 1
        assert after.usage.input_tokens_details.cached_tokens >= seen // BLOCK_SIZE * BLOCK_SIZE
        assert after.usage.input_tokens > seen
    items = client.responses.input_items.list(third.id, order="asc")
    assert [item.type for item in items.data] == ["message"]
    assert items.data[0].content[0].text == "And a third."

    # Instructions are for their own request only: the third turn counts the same tokens without them.
    count = http.post("/v1/responses/input_tokens", json={"model": model_id, "input": "And a third.",
                                                          "previous_response_id": second.id}).json()
    assert count == {"object": "response.input_tokens", "input_tokens": third.usage.input_tokens}
    wait_idle(http)


def test_deleting_a_response_keeps_its_continuations(client, model_id, http):
    first = create(client, model_id, input="Name a fruit.")
    second = create(client, model_id, input="Another one.", previous_response_id=first.id)
    assert http.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response.deleted",
                                                                "deleted": True}
    gone = http.get(f"/v1/responses/{first.id}")
    assert gone.status_code == 404 and error_of(gone)["code"] == "response_not_found"
    assert http.delete(f"/v1/responses/{first.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    third = create(client, model_id, input="And one more.", previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens
    refused = http.post("/v1/responses", json={"model": model_id, "input": "x", "previous_response_id": first.id})
    assert refused.status_code == 404 and error_of(refused)["param"] == "previous_response_id"


def test_store_false_cannot_be_retrieved_or_continued(client, model_id, http):
    reply = create(client, model_id, input="Hello.", store=False)
    assert http.get(f"/v1/responses/{reply.id}").status_code == 404
    refused = http.post("/v1/responses", json={"model": model_id, "input": "x", "previous_response_id": reply.id})
    assert refused.status_code == 404 and error_of(refused)["param"] == "previous_response_id"


def test_input_items_are_listed_in_pages(client, model_id, http):
    items = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Three."}], "id": "msg_mine"}]
    reply = create(client, model_id, input=items, max_output_tokens=4)
    everything = client.responses.input_items.list(reply.id, order="asc")
    assert [item.role for item in everything.data] == ["system", "user", "assistant", "user"]
    assert everything.data[-1].id == "msg_mine" and len({item.id for item in everything.data}) == 4
    newest = http.get(f"/v1/responses/{reply.id}/input_items", params={"limit": 2}).json()
    assert newest["object"] == "list" and newest["has_more"] is True
    assert [item["id"] for item in newest["data"]] == [item.id for item in everything.data[::-1][:2]]
    assert newest["first_id"] == "msg_mine" and newest["last_id"] == newest["data"][1]["id"]
    rest = http.get(f"/v1/responses/{reply.id}/input_items", params={"limit": 2, "after": newest["last_id"]}).json()
    assert [item["id"] for item in rest["data"]] == [item.id for item in everything.data[:2][::-1]]
    assert rest["has_more"] is False
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_unknown"}, "after")):
        bad = http.get(f"/v1/responses/{reply.id}/input_items", params=params)
        assert bad.status_code == 400 and error_of(bad)["param"] == param


def test_input_tokens_equal_the_usage_of_the_same_create(client, model_id, http):
    body = {"model": model_id, "input": ASK, "instructions": "Use the tools.", "tools": [WEATHER],
            "tool_choice": "required"}
    count = http.post("/v1/responses/input_tokens", json=body).json()
    reply = create(client, model_id, **{k: v for k, v in body.items() if k != "model"}, max_output_tokens=48)
    assert count["input_tokens"] == reply.usage.input_tokens
    plain = http.post("/v1/responses/input_tokens", json={"model": model_id, "input": ASK}).json()
    assert plain["input_tokens"] < count["input_tokens"]


def test_a_function_call_round_trip(client, model_id, http):
    called = create(client, model_id, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=48)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls, called.output
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments), dict) and call.namespace is None

    # Tools are sent again; the first prompt is a cached prefix of the second. (The call itself is
    # re-rendered by ember in the canonical hermes form, which may differ from what the model wrote.)
    # Every call of the turn gets its result (the model may have written more than one).
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 24 C"} for c in calls]
    answer = create(client, model_id, previous_response_id=called.id, tools=[WEATHER], input=results)
    assert answer.output and all(item.type == "message" for item in answer.output) and answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens >= called.usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE

    # The same turn without stored state: the call item is sent back with its result.
    stateless = create(client, model_id, tools=[WEATHER], tool_choice="none", store=False, input=[
        {"role": "user", "content": ASK},
        *({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls),
        *results])
    assert stateless.output_text

    final = streamed(http, model_id, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=48)
    streamed_calls = [item for item in final["output"] if item["type"] == "function_call"]
    assert streamed_calls[0]["arguments"] == call.arguments and streamed_calls[0]["name"] == "get_weather"
    wait_idle(http)


@pytest.mark.parametrize("items, param", [
    ([{"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}], "input[1].call_id"),
    ([{"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "call_a", "output": "x"},
      {"type": "function_call_output", "call_id": "call_a", "output": "y"}], "input[3].call_id"),
    ([{"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{}"},
      {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{}"}], "input[2].call_id"),
])
def test_tool_results_must_match_their_calls(http, model_id, items, param):
    reply = http.post("/v1/responses", json={"model": model_id, "tools": [WEATHER],
                                             "input": [{"role": "user", "content": ASK}, *items]})
    assert reply.status_code == 400 and error_of(reply)["param"] == param


def test_namespace_tools_come_back_with_their_namespace(client, model_id, http):
    namespace = {"type": "namespace", "name": "weather", "description": "Weather service", "tools": [
        {"type": "function", "name": "get_current", "description": "Get the current weather in a city",
         "parameters": WEATHER["parameters"]}]}
    choice = {"type": "function", "name": "get_current", "namespace": "weather"}
    called = create(client, model_id, input=ASK, tools=[namespace], tool_choice=choice, max_output_tokens=48)
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_current" and call.namespace == "weather"
    assert called.tools[0].type == "namespace"

    final = streamed(http, model_id, input=ASK, tools=[namespace], tool_choice=choice, max_output_tokens=48)
    item = next(item for item in final["output"] if item["type"] == "function_call")
    assert (item["name"], item["namespace"]) == ("get_current", "weather")

    answer = create(client, model_id, tools=[namespace], tool_choice="none", previous_response_id=called.id,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rain"}])
    assert answer.status in ("completed", "incomplete") and answer.output


def test_a_custom_tool_returns_its_free_form_input(client, model_id, http):
    patch = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to files"}
    final = streamed(http, model_id, input="Add the line hello to notes.txt", tools=[patch],
                     tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=80)
    calls = [item for item in final["output"] if item["type"] == "custom_tool_call"]
    assert calls and calls[0]["name"] == "apply_patch" and isinstance(calls[0]["input"], str)
    assert calls[0]["call_id"].startswith("call_")
    follow = create(client, model_id, tools=[patch], tool_choice="none", previous_response_id=final["id"],
                    input=[{"type": "custom_tool_call_output", "call_id": calls[0]["call_id"], "output": "done"}])
    assert follow.output


def test_hosted_tools_are_not_offered_and_cannot_be_forced(client, model_id, http, server):
    mark = len(server.lines)
    reply = create(client, model_id, input="Hello.", tools=[{"type": "web_search"}, WEATHER])
    assert [tool.type for tool in reply.tools] == ["web_search", "function"]
    assert any("web_search" in line and "not offered" in line for line in server.log_since(mark))
    alone = create(client, model_id, input="Hello.", tools=[{"type": "web_search"}])
    assert alone.output_text
    forced = http.post("/v1/responses", json={"model": model_id, "input": "Hello.", "tools": [{"type": "web_search"}],
                                              "tool_choice": {"type": "web_search"}})
    assert forced.status_code == 400 and error_of(forced)["param"] == "tool_choice"
    required = http.post("/v1/responses", json={"model": model_id, "input": "Hello.",
                                                "tools": [{"type": "web_search"}], "tool_choice": "required"})
    assert required.status_code == 400 and error_of(required)["param"] == "tool_choice"


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].image_url"),  # a text model: vision_disabled
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input[0].content[0]"),
    ({"previous_response_id": "resp_never_stored"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "no_such_tool"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice.name"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "forged"}]}, "input[0].encrypted_content"),
    ({"model": "another-model"}, "model"),
])
def test_refusals_name_the_field(http, model_id, fields, param):
    body = {"model": model_id, "input": "Hello.", **fields}
    reply = http.post("/v1/responses", json=body)
    assert reply.status_code in (400, 404), reply.text
    assert error_of(reply)["param"] == param


def test_cancel_and_compact_are_refused_with_a_reason(client, model_id, http):
    reply = create(client, model_id, input="Hello.", max_output_tokens=2)
    cancel = http.post(f"/v1/responses/{reply.id}/cancel")
    assert cancel.status_code == 400 and "background" in error_of(cancel)["message"]
    compact = http.post("/v1/responses/compact", json={"model": model_id, "input": "Hello."})
    assert compact.status_code == 400 and error_of(compact)["code"] == "compaction_not_supported"
    stream_again = http.get(f"/v1/responses/{reply.id}", params={"stream": "true"})
    assert stream_again.status_code == 400 and error_of(stream_again)["param"] == "stream"


# ---- a server with a reasoning template and a small store ----------------------------------------------

@pytest.fixture(scope="module")
def thinking(thinking_server):
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client, client.models.list().data[0].id


def test_reasoning_items_and_usage(thinking, thinking_server):
    client, model = thinking
    reply = create(client, model, input="Why is the sky blue?", max_output_tokens=40)
    reasoning = reply.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert reasoning.encrypted_content is None
    assert reply.usage.output_tokens_details.reasoning_tokens >= 12
    import httpx
    with httpx.Client(base_url=thinking_server.url, timeout=120) as http:
        final = check_stream(raw_events(http, {"model": model, "input": "Why is the sky blue?", "temperature": 0,
                                               "max_output_tokens": 40}))
    assert final["output"][0]["content"][0]["text"] == reasoning.content[0].text

    off = create(client, model, input="Why is the sky blue?", reasoning={"effort": "none"})
    assert all(item.type != "reasoning" for item in off.output)
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_encrypted_reasoning_restores_the_history_without_state(thinking, thinking_server):
    client, model = thinking
    question = {"role": "user", "content": "Why is the sky blue?"}
    first = create(client, model, input=[question], store=False, include=["reasoning.encrypted_content"],
                   max_output_tokens=40)
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    sealed = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    answer = {"role": "assistant", "content": "Because of scattering."}
    follow = {"role": "user", "content": "Say it again."}
    import httpx
    with httpx.Client(base_url=thinking_server.url, timeout=120) as http:
        def count(items):
            # earlier turns' reasoning reaches the prompt only when kept (preserve_thinking)
            reply = http.post("/v1/responses/input_tokens", json={"model": model, "input": items,
                                                                  "preserve_thinking": True})
            assert reply.status_code == 200, reply.text
            return reply.json()["input_tokens"]

        restored = count([question, sealed, answer, follow])
        plain = count([question, answer, follow])
        with_text = count([question, {"type": "reasoning", "summary": [], "content": reasoning.model_dump()["content"]},
                           answer, follow])
        assert restored == with_text > plain
        tampered = dict(sealed, encrypted_content=reasoning.encrypted_content[:-4] + "AAAA")
        refused = http.post("/v1/responses", json={"model": model, "input": [question, tampered, answer, follow]})
        assert refused.status_code == 400 and error_of(refused)["param"] == "input[1].encrypted_content"
    second = create(client, model, input=[question, sealed, answer, follow], store=False,
                    include=["reasoning.encrypted_content"])
    assert second.output


def test_the_store_evicts_the_least_recently_used(thinking, thinking_server):
    client, model = thinking
    first, second, third = (create(client, model, input=f"Say {word}.", max_output_tokens=4,
                                   reasoning={"effort": "none"}) for word in ("one", "two", "three"))
    client.responses.retrieve(first.id)  # now the most recently used
    fourth = create(client, model, input="Say four.", max_output_tokens=4, reasoning={"effort": "none"})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    for kept in (first, third, fourth):
        assert client.responses.retrieve(kept.id).id == kept.id

    import httpx
    with httpx.Client(base_url=thinking_server.url, timeout=120) as http:
        big = http.post("/v1/responses", json={"model": model, "input": "word " * 20000, "max_output_tokens": 4})
        assert big.status_code == 400
        assert error_of(big)["code"] == "response_store_capacity_exceeded" and error_of(big)["param"] == "store"
