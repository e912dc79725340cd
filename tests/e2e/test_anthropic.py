"""Anthropic Messages end to end through the `anthropic` library: create, stream, count_tokens, tools,
thinking, prefill, stop sequences, prefix reuse across Claude Code's billing header, and every
refusal in Anthropic's error shape. Every stream goes through `check_stream`."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.e2e.conftest import MAIN_FLAGS, ServerProcess, wait_idle

TEMPLATES = Path(__file__).parent / "templates"
DEFAULT_BUDGET = 16
KEY = "anthropic-secret-key-42"
HI = [{"role": "user", "content": "Hello"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                            "properties": {"city": {"type": "string"}}, "required": ["city"]}}
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"}


# ---- the stream validator ----------------------------------------------------------------------------

def check_stream(events: list[dict], *, raw: bool = False) -> dict:
    """Check the Messages SSE lifecycle and return the message it builds: message_start (empty content,
    usage), ping (seen when `raw`), blocks with indices from 0, each start -> deltas of its own kind ->
    stop, a thinking block's one signature_delta right before its stop, input_json_delta pieces that join
    to a JSON object, then message_delta (stop_reason, usage) and message_stop last."""
    assert events and events[0]["type"] == "message_start", events[:2]
    message = json.loads(json.dumps(events[0]["message"]))
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["content"] == [] and message["stop_reason"] is None and message["stop_sequence"] is None
    usage = message["usage"]
    assert min(usage["input_tokens"], usage["cache_read_input_tokens"]) >= 0 and usage["output_tokens"] == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] >= 1  # the prompt, cached or not
    if raw:
        assert events[1]["type"] == "ping"
    open_index, signed, partial, ended = None, False, "", False
    for e in events[1:]:
        kind = e["type"]
        assert not ended or kind == "message_stop", f"{kind} after message_delta"
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert open_index is None, "a block started before the last one stopped"
            assert e["index"] == len(message["content"]), "block indices run from 0 without gaps"
            block = e["content_block"]
            assert block["type"] in ("text", "thinking", "tool_use")
            assert block.get("text", "") == "" and block.get("thinking", "") == "" and block.get("input", {}) == {}
            if block["type"] == "tool_use":
                assert block["id"].startswith("toolu_") and block["name"]
            message["content"].append(dict(block))
            open_index, signed, partial = e["index"], False, ""
        elif kind == "content_block_delta":
            assert e["index"] == open_index, "a delta for a block that is not open"
            block, delta = message["content"][open_index], e["delta"]
            expected = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "thinking",
                        "input_json_delta": "tool_use"}[delta["type"]]
            assert block["type"] == expected, f"{delta['type']} in a {block['type']} block"
            assert not signed, "nothing follows a thinking block's signature but its stop"
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                assert delta["signature"]
                block["signature"], signed = delta["signature"], True
            else:
                partial += delta["partial_json"]
        elif kind == "content_block_stop":
            assert e["index"] == open_index
            block = message["content"][open_index]
            if block["type"] == "thinking":
                assert signed, "a thinking block stops only after its signature_delta"
                assert block["thinking"].strip()
            elif block["type"] == "tool_use":
                block["input"] = json.loads(partial)
                assert isinstance(block["input"], dict)
            else:
                assert block["text"].strip()
            open_index = None
        elif kind == "message_delta":
            assert open_index is None, "message_delta with a block still open"
            assert e["delta"]["stop_reason"] in STOP_REASONS
            message["stop_reason"], message["stop_sequence"] = e["delta"]["stop_reason"], e["delta"]["stop_sequence"]
            assert e["usage"]["output_tokens"] >= (1 if message["content"] else 0)
            message["usage"].update(e["usage"])
            ended = True
        elif kind == "message_stop":
            assert message["stop_reason"] is not None, "message_stop before message_delta"
            assert e is events[-1]
            return message
        else:
            raise AssertionError(f"unexpected event {kind}")
    raise AssertionError("the stream did not end with message_stop")


def sdk_stream(client: anthropic.Anthropic, **fields) -> dict:
    """The SDK has no sampling arguments any more: temperature travels in extra_body."""
    fields.setdefault("extra_body", {"temperature": fields.pop("temperature", 0)})
    with client.messages.create(stream=True, **fields) as stream:
        events = [event.to_dict() for event in stream]
    return check_stream(events)


def raw_stream(url: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, dict]:
    events = []
    with httpx.stream("POST", url + "/v1/messages?beta=true", json={**body, "stream": True}, timeout=600,
                      headers=headers or {}) as reply:
        name = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, "the event name is the data's type"
                events.append(data)
    return reply, check_stream(events, raw=True)


# ---- fixtures ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def prompt_tokens(usage) -> int:
    """The three input counts add up to the prompt."""
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def create(client, **fields):
    fields = {"model": "ember-local", "max_tokens": 24, "messages": HI, **fields}
    return client.messages.create(extra_body={"temperature": 0}, **fields)


def as_dict(message) -> dict:
    return message.to_dict() if hasattr(message, "to_dict") else message


# ---- create and stream ---------------------------------------------------------------------------

def test_create_whole_and_streamed_agree(claude, http):
    raw = claude.messages.with_raw_response.create(model="ember-local", max_tokens=24, messages=HI,
                                                   extra_body={"temperature": 0})
    assert raw.headers["request-id"] == raw.headers["x-request-id"]
    whole = raw.parse()
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == "ember-local"  # any label, echoed
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert whole.usage.output_tokens <= 24 and whole.usage.cache_creation_input_tokens == 0

    streamed = sdk_stream(claude, model="ember-local", max_tokens=24, temperature=0, messages=HI)
    assert streamed["content"] == as_dict(whole)["content"]
    assert streamed["stop_reason"] == whole.stop_reason and streamed["model"] == "ember-local"
    usage = streamed["usage"]
    assert usage["output_tokens"] == whole.usage.output_tokens
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    wait_idle(http)


def test_raw_stream_names_events_pings_and_carries_request_id(server):
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "anything",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"}
    reply, message = raw_stream(server.url, {"model": "m", "max_tokens": 8, "temperature": 0, "messages": HI},
                                headers)
    assert reply.status_code == 200 and reply.headers["request-id"]
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert message["usage"]["output_tokens"] <= 8


def test_count_tokens_equals_the_prompt_of_the_matching_create(claude):
    fields = {"system": "You answer questions about the weather.", "tools": [WEATHER],
              "messages": [{"role": "user", "content": f"Is it warm in Lisbon? {uuid.uuid4().hex}"}]}
    counted = claude.messages.count_tokens(model="claude-haiku", **fields)
    made = create(claude, max_tokens=4, **fields)
    assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens
    again = create(claude, max_tokens=4, **fields)
    assert again.usage.cache_read_input_tokens > 0
    assert counted.input_tokens == again.usage.input_tokens + again.usage.cache_read_input_tokens


def test_the_billing_header_block_does_not_break_prefix_reuse(claude):
    persona = f"You are a careful assistant for the project {uuid.uuid4().hex}. " * 4

    def system(suffix: str) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.1; cch={suffix};"},
                {"type": "text", "text": persona, "cache_control": {"type": "ephemeral"}}]

    first = create(claude, system=system("aaaa"), max_tokens=2)
    second = create(claude, system=system("bbbb"), max_tokens=2)
    total = prompt_tokens(first.usage)
    assert total == prompt_tokens(second.usage)
    assert first.usage.cache_read_input_tokens < total - 16
    assert first.usage.cache_creation_input_tokens > 0  # the persona's breakpoint wrote and pinned it
    assert second.usage.cache_read_input_tokens >= total - 16  # all but the last partial block
    without = claude.messages.count_tokens(model="m", system=[system("x")[1]], messages=HI)
    assert without.input_tokens == total


# ---- tools -----------------------------------------------------------------------------------------

def test_a_forced_tool_call_round_trip(claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # One call: a second one cut by max_tokens would make the reply stop with max_tokens.
    forced = {"type": "any", "disable_parallel_tool_use": True}
    first = create(claude, messages=ask, tools=[WEATHER], tool_choice=forced, max_tokens=48)
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.id.startswith("toolu_") and call.name == "get_weather" and isinstance(call.input, dict)

    streamed = sdk_stream(claude, model="m", max_tokens=48, temperature=0, messages=ask, tools=[WEATHER],
                          tool_choice=forced)
    assert streamed["stop_reason"] == "tool_use"
    calls = [b for b in streamed["content"] if b["type"] == "tool_use"]
    assert [c["input"] for c in calls][:1] == [call.input] and calls[0]["name"] == "get_weather"

    history = [*ask, {"role": "assistant", "content": [b.to_dict() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "Sunny, 21 degrees."}]}]}]
    answer = create(claude, messages=history, tools=[WEATHER], max_tokens=24)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens  # the call and its result reached the prompt
    failed = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                          "is_error": True, "content": "Sunny, 21 degrees."}]}]
    counted_ok = claude.messages.count_tokens(model="m", messages=history, tools=[WEATHER]).input_tokens
    counted_error = claude.messages.count_tokens(model="m", messages=failed, tools=[WEATHER]).input_tokens
    assert counted_error > counted_ok  # the error is marked in the prompt


def test_tool_choice_none_and_a_named_tool(claude):
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    named = create(claude, messages=ask, tools=[WEATHER], max_tokens=48,
                   tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert named.stop_reason == "tool_use"
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]
    plain = create(claude, messages=ask, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=16)
    assert all(b.type == "text" for b in plain.content) and plain.stop_reason != "tool_use"


# ---- prefill, stop sequences, the window ----------------------------------------------------------

def test_an_assistant_prefill_is_continued(claude, http):
    question = "What is the capital of France?"
    reply = create(claude, max_tokens=12, messages=[{"role": "user", "content": question},
                                                    {"role": "assistant", "content": "The capital of France is"}])
    # The same prompt written out by hand, through the completions endpoint: the same greedy tokens.
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\nThe capital of France is")
    plain = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
    assert reply.content[0].text == plain["choices"][0]["text"]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == plain["usage"]["prompt_tokens"]
    streamed = sdk_stream(claude, model="m", max_tokens=12, temperature=0,
                          messages=[{"role": "user", "content": question},
                                    {"role": "assistant", "content": "The capital of France is"}])
    assert streamed["content"][0]["text"] == reply.content[0].text


def test_stop_sequences_end_the_reply(claude):
    free = create(claude, max_tokens=24).content[0].text
    words = free.split()
    assert len(words) >= 3
    stop = words[2]
    cut = create(claude, max_tokens=24, stop_sequences=["NEVER-SEEN", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free[:free.index(stop)]
    streamed = sdk_stream(claude, model="m", max_tokens=24, temperature=0, messages=HI,
                          stop_sequences=["NEVER-SEEN", stop])
    assert (streamed["stop_reason"], streamed["stop_sequence"]) == ("stop_sequence", stop)


def test_a_reply_that_fills_the_window_says_so(claude, server):
    filler = "one two three four five six seven eight nine ten " * 98
    counted = claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": filler}]).input_tokens
    assert 1024 - 40 < counted < 1024, counted  # leaves a little room in the 1024-token window
    reply = create(claude, max_tokens=32000, messages=[{"role": "user", "content": filler}])
    assert reply.stop_reason == "model_context_window_exceeded", reply  # the greedy reply keeps counting
    assert counted + reply.usage.output_tokens == 1024
    small = create(claude, max_tokens=3, messages=[{"role": "user", "content": filler}])
    assert small.stop_reason == "max_tokens"

    with pytest.raises(anthropic.BadRequestError) as caught:
        create(claude, messages=[{"role": "user", "content": filler * 2}])
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("prompt is too long: ") and "tokens > 1023 maximum" in \
        error["error"]["message"]


# ---- Claude Code's request ------------------------------------------------------------------------

def claude_code_body(model: str = "claude-code-local-model") -> dict:
    tools = [{**WEATHER, "eager_input_streaming": True, "cache_control": {"type": "ephemeral"}},
             {"name": "Read", "description": "Read a file", "input_schema": {
                 "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
                 "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}]
    return {
        "model": model, "max_tokens": 32000, "stream": True,
        "system": [{"type": "text",
                    "text": f"x-anthropic-billing-header: cc_version=2.1.0; cch={uuid.uuid4().hex[:5]};"},
                   {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "\nAnswer in one short sentence.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
                         {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>\n"},
                         {"type": "text", "text": "Say hi.", "cache_control": {"type": "ephemeral"}}]},
                     {"role": "system", "content": "The user is in /tmp."}],
        "tools": tools, "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "abc", "session_id": str(uuid.uuid4())})},
        "temperature": 0, "stop_sequences": ["\n\n"],
    }


CLAUDE_CODE_BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                     "prompt-caching-scope-2026-01-05,effort-2025-11-24,fine-grained-tool-streaming-2025-05-14,"
                     "oauth-2025-04-20")


def test_a_claude_code_request_is_accepted(server):
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": CLAUDE_CODE_BETAS, "x-api-key": "x"}
    reply, message = raw_stream(server.url, claude_code_body(), headers)
    assert reply.status_code == 200
    assert message["model"] == "claude-code-local-model"
    reply, second = raw_stream(server.url, claude_code_body(), headers)  # a new billing header, the same prefix
    usage = message["usage"]
    total = usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]
    assert second["usage"]["cache_read_input_tokens"] >= total - 16


# ---- refusals ----------------------------------------------------------------------------------------

REFUSALS = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "document"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t",
                                                 "content": [{"type": "text", "text": "x"}]}]}]}, "search_result"),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "abc"}]},
                   {"role": "user", "content": "go on"}]}, "redacted_thinking"),
    ({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}}]},
                   {"role": "user", "content": "go on"}]}, "server_tool_use"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"model": ""}, "model"),
    ({"thinking": {"type": "enabled", "budget_tokens": 512}, "max_tokens": 2000}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2000}, "budget_tokens"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "omitted"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"messages": [*HI, {"role": "assistant", "content": "Trailing space "}]}, "whitespace"),
    ({"messages": []}, "messages"),
]


@pytest.mark.parametrize("fields, named", REFUSALS)
def test_refusals_are_400s_in_anthropic_shape(claude, server, fields, named):
    body = {"model": "m", "max_tokens": 8, "messages": HI, **fields}
    reply = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    assert error["request_id"] == reply.headers["request-id"] == reply.headers["x-request-id"]
    named_args = ("model", "max_tokens", "messages")
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(**{k: v for k, v in body.items() if k in named_args},
                               extra_body={k: v for k, v in body.items() if k not in named_args})


def test_other_statuses_in_anthropic_shape(server):
    for method, path, body, status, kind in [
        ("POST", "/v1/messages", b"{not json", 400, "invalid_request_error"),
        ("POST", "/v1/messages/batches", b"{}", 404, "not_found_error"),
        ("GET", "/v1/messages", None, 405, "invalid_request_error"),
        ("POST", "/v1/messages/count_tokens", b'{"messages": "Hi"}', 400, "invalid_request_error"),
    ]:
        reply = httpx.request(method, server.url + path, content=body, timeout=60,
                              headers={"content-type": "application/json"})
        assert reply.status_code == status, (path, reply.text)
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == kind
        assert reply.headers["request-id"]


# ---- a server with a key and tight limits: 401, 413, 415, 529 ------------------------------------------

@pytest.fixture(scope="module")
def tight():
    process = ServerProcess("--api-key", KEY, "--max-num-seqs", "1", "--max-pending", "0",
                            "--max-request-mb", "0.01", "--max-model-len", "1024").start()
    yield process
    process.stop()


def test_key_size_type_and_overload_refusals(tight):
    bad = anthropic.Anthropic(base_url=tight.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model="m", max_tokens=4, messages=HI)
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert caught.value.response.headers["request-id"] == caught.value.body["request_id"]
    bearer = httpx.post(tight.url + "/v1/messages/count_tokens", json={"messages": HI},
                        headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0

    good = anthropic.Anthropic(base_url=tight.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught:
        good.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x" * 20_000}])
    assert caught.value.status_code == 413 and caught.value.body["error"]["type"] == "request_too_large"
    wrong_type = httpx.post(tight.url + "/v1/messages", content=b"hi", headers={"x-api-key": KEY,
                                                                                 "content-type": "text/plain"})
    assert wrong_type.status_code == 415 and wrong_type.json()["error"]["type"] == "invalid_request_error"

    hold = {"messages": HI, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tight.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as holder:
        with holder.stream("POST", "/v1/chat/completions", json=hold) as stream:
            lines = stream.iter_lines()  # kept: dropping the iterator would close the stream
            next(line for line in lines if line.startswith("data: "))  # holds the one slot
            with pytest.raises(anthropic.APIStatusError) as caught:
                good.messages.create(model="m", max_tokens=4, messages=HI)
    assert caught.value.status_code == 529 and caught.value.body["error"]["type"] == "overloaded_error"
    assert int(caught.value.response.headers["retry-after"]) > 0


# ---- in-process: loading, and a fault after the stream began ------------------------------------------

def test_loading_is_529_overloaded():
    from tests.e2e.test_faults import config, with_app

    gate = threading.Event()

    def never_loads(config):
        gate.wait(60)
        raise RuntimeError("stopped by the test")

    async def scenario(client):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            reply = await client.post(path, json={"model": "m", "max_tokens": 4, "messages": HI})
            assert reply.status_code == 529
            assert reply.json()["error"]["type"] == "overloaded_error" and reply.headers["retry-after"]
            assert reply.json()["request_id"] == reply.headers["request-id"]
        gate.set()

    asyncio.run(with_app(scenario, config(), never_loads))


def test_a_fault_mid_stream_is_an_error_event():
    from tests.e2e.test_faults import config, wait_for, with_app

    async def scenario(client):
        await wait_for(client, "ok")
        body = {"model": "m", "max_tokens": 50, "temperature": 0, "messages": HI, "stream": True}
        reply = await client.post("/v1/messages", json=body)
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
        names = [line[7:] for line in reply.text.splitlines() if line.startswith("event: ")]
        assert names == [e["type"] for e in events]
        assert names[:2] == ["message_start", "ping"] and "content_block_delta" in names
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
        assert "injected device fault" in events[-1]["error"]["message"]
        assert events[-1]["request_id"] == reply.headers["request-id"]
        assert "message_stop" not in names

    asyncio.run(with_app(scenario, config("raise@6")))


# ---- thinking, on a reasoning template ------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinker():
    process = ServerProcess(*MAIN_FLAGS, "--max-model-len", "2048", "--chat-template",
                            str(TEMPLATES / "think_hermes.jinja"),
                            "--default-thinking-budget", str(DEFAULT_BUDGET)).start()
    yield anthropic.Anthropic(base_url=process.url, api_key="unused", max_retries=0, timeout=600)
    process.stop()


@pytest.fixture(scope="module")
def close_tokens() -> int:
    """Tokens of the text ember writes to close a think block."""
    from ember.loaders import load_model_source
    return len(load_model_source(None).tokenizer.encode("\n</think>\n\n"))


QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


def test_adaptive_thinking_is_a_signed_block_held_to_the_budget(thinker, close_tokens):
    whole = create(thinker, messages=QUESTION, max_tokens=48, thinking={"type": "adaptive"})
    kinds = [b.type for b in whole.content]
    assert kinds[0] == "thinking" and whole.content[0].thinking and whole.content[0].signature
    assert "<think>" not in whole.content[0].thinking and "</think>" not in whole.content[0].thinking
    thinking_tokens = whole.usage.output_tokens_details.thinking_tokens
    assert 0 < thinking_tokens <= DEFAULT_BUDGET + close_tokens
    assert thinking_tokens < whole.usage.output_tokens and "text" in kinds  # the answer follows the cut

    streamed = sdk_stream(thinker, model="m", max_tokens=48, temperature=0, messages=QUESTION,
                          thinking={"type": "adaptive"})
    assert streamed["content"] == as_dict(whole)["content"]  # same text, same signature
    assert streamed["usage"]["output_tokens_details"]["thinking_tokens"] == thinking_tokens

    history = [*QUESTION, {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": whole.content[0].thinking, "signature": "from-elsewhere"},
                   *[b.to_dict() for b in whole.content[1:]]]},
               {"role": "user", "content": "Say more."}]
    follow = create(thinker, messages=history, max_tokens=8, thinking={"type": "adaptive"})
    assert follow.content  # any signature is taken
    without = [history[0], {"role": "assistant", "content": [b.to_dict() for b in whole.content[1:]]}, history[2]]

    def count(messages, **extra) -> int:
        return thinker.messages.count_tokens(model="m", messages=messages, extra_body=extra).input_tokens

    # a closed turn's thinking leaves the prompt, unless preserve_thinking keeps it
    assert count(history) == count(without)
    assert count(history, preserve_thinking=True) > count(without)


def test_enabled_thinking_and_disabled_thinking(thinker):
    enabled = create(thinker, messages=QUESTION, max_tokens=2000, stop_sequences=["."],
                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert enabled.content[0].type == "thinking" and enabled.content[0].signature
    assert enabled.stop_reason == "stop_sequence"
    off = create(thinker, messages=QUESTION, max_tokens=16, thinking={"type": "disabled"})
    assert all(b.type == "text" for b in off.content)
    absent = create(thinker, messages=QUESTION, max_tokens=16)
    assert all(b.type == "text" for b in absent.content)
    effort = thinker.messages.count_tokens(model="m", messages=QUESTION, thinking={"type": "adaptive"},
                                           output_config={"effort": "high"}).input_tokens
    plain = thinker.messages.count_tokens(model="m", messages=QUESTION, thinking={"type": "adaptive"}).input_tokens
    assert effort > plain  # the template received the effort


def test_a_forced_call_after_thinking_streams_its_input(thinker):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    streamed = sdk_stream(thinker, model="m", max_tokens=96, temperature=0, messages=ask, tools=[WEATHER],
                          tool_choice={"type": "any"}, thinking={"type": "adaptive"})
    kinds = [b["type"] for b in streamed["content"]]
    assert kinds[0] == "thinking"
    # Whether the forced call follows the model's own </think> is the chat pipeline's business (see
    # test_reasoning.py); here: a call, when there is one, is a tool_use block and the stop says so.
    assert ("tool_use" in kinds) == (streamed["stop_reason"] == "tool_use")
    assert all(b["name"] == "get_weather" for b in streamed["content"] if b["type"] == "tool_use")
