"""Chat Completions and Completions through the openai client library (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"  # the default model's own name, the served id by default
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
               "predicted_per_second", "queue_ms"}


def sse_events(response: httpx.Response) -> list:
    """The data of each SSE event ([DONE] kept as the string), and the comment lines seen."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def check_timings(timings: dict, usage: dict) -> None:
    assert set(timings) >= TIMING_KEYS
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in timings.values())
    assert timings["cache_n"] + timings["prompt_n"] == usage["prompt_tokens"]
    assert timings["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["predicted_n"] == usage["completion_tokens"]


# ---- health, models, documents ----------------------------------------------------------------

def test_health_and_models(http, model_id, server):
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/v1/health").status_code == 200
    root = http.get("/")  # without --ui, / answers as health
    assert root.headers["content-type"] == "application/json" and root.json()["status"] == "ok"
    # While loading, the fixture saw only "loading" answers before the first "ok".
    assert all(code == 503 and body == {"status": "loading"} for code, body in server.health_seen[:-1])
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == model_id == MODEL
    assert card["object"] == "model" and card["max_model_len"] == 1024
    assert card["capabilities"] == {"reasoning": False, "tool_calls": True}  # SmolLM2's template writes no <think>
    assert http.get(f"/v1/models/{model_id}").json()["id"] == model_id
    missing = http.get("/v1/models/gpt-4o")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_head_answers_health_status_without_body(http):
    for path in ("/health", "/v1/models", "/anything"):
        reply = http.head(path)
        assert reply.status_code == 200 and reply.content == b""
        assert reply.headers["x-request-id"]


def test_openapi_and_metrics(http, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    document = http.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(document["paths"])
    assert "ChatCompletionRequest" in document["components"]["schemas"]
    metrics = http.get("/metrics").text
    assert "ember:http_requests_total" in metrics and "ember:kv_cache_blocks_total" in metrics


def test_unknown_route_is_a_json_404(http):
    reply = http.get("/v1/nothing-here")
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "invalid_request_error"
    assert http.get("/v1/chat/completions").status_code == 405


# ---- chat --------------------------------------------------------------------------------------

def test_chat_completion(client, model_id):
    reply = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == model_id and reply.system_fingerprint and isinstance(reply.created, int)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    body = reply.model_dump()
    check_timings(reply.model_extra["timings"], body["usage"])


def test_model_may_be_omitted_and_other_ids_are_404(http, client):
    reply = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert reply.status_code == 200
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


def test_chat_stream_equals_non_streamed(client):
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Name three colours of the rainbow."}]
    whole = client.chat.completions.create(messages=messages, model=MODEL, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(messages=messages, model=MODEL, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_stream_framing(http):
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        assert reply.headers["x-request-id"]
        events = sse_events(reply)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and "timings" in usage_chunk
    check_timings(usage_chunk["timings"], usage_chunk["usage"])
    assert all("timings" not in e for e in events[:-2])
    assert len({e["id"] for e in events[:-1]}) == 1
    # Without include_usage the finish chunk carries the timings.
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}) as reply:
        events = sse_events(reply)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] and "timings" in events[-2]


def test_cached_tokens_are_reported(client):
    messages = [{"role": "user", "content": "Tell me a fact about the number " + "seven " * 40}]
    client.chat.completions.create(messages=messages, model=MODEL, max_tokens=2, temperature=0)
    again = client.chat.completions.create(messages=messages, model=MODEL, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens
    assert again.model_extra["timings"]["cache_n"] == cached


def test_n_choices_share_the_prompt(client):
    reply = client.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) == 1
    assert reply.usage.completion_tokens % 3 == 0 and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=8, temperature=0, n=2, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and texts[0] == texts[1] == reply.choices[0].message.content


def test_chat_logprobs(client):
    reply = client.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob >= max(t.logprob for t in entry.top_logprobs) - 1e-4


def test_stop_string_and_return_token_ids(client, http):
    whole = client.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    word = text.split()[2]
    cut = client.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=16, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(word)]
    body = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                   "return_token_ids": True}).json()
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]


def test_text_parts_developer_role_and_template_kwargs(client):
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CHAT[0]["content"]}]
    a = client.chat.completions.create(messages=parts, model=MODEL, max_tokens=8, temperature=0)
    b = client.chat.completions.create(messages=joined, model=MODEL, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    c = client.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=4, temperature=0,
                                       extra_body={"chat_template_kwargs": {"unused_flag": True}})
    assert c.choices[0].message.content


# ---- completions -------------------------------------------------------------------------------

def test_completion_prompt_forms(client, http):
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert text.id.startswith("cmpl-") and text.object == "text_completion"
    listed = client.completions.create(model=MODEL, prompt=["The capital of France is"], max_tokens=8, temperature=0)
    assert listed.choices[0].text == text.choices[0].text
    ids = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1,
                                             "return_token_ids": True}).json()["prompt_token_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    check_timings(text.model_extra["timings"], text.model_dump()["usage"])


def test_completion_stream_equals_non_streamed(client):
    prompt = "Once upon a time, in a small village,"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_echo_logprobs_and_ignore_eos(client):
    echoed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Hello there")
    scored = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5 == scored.usage.completion_tokens
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == scored.choices[0].text


# ---- the context window -------------------------------------------------------------------------

def test_prompt_beyond_the_window_is_refused(client):
    long_text = "word " * 1500
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=4)
    error = caught.value
    assert error.code == "context_length_exceeded" and error.param == "messages"
    assert "This model's maximum context length is 1024 tokens; your request has" in error.message
    assert "prompt tokens" in error.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=long_text, max_tokens=4)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"


def test_max_tokens_beyond_the_window_is_capped(client):
    prompt = [1000 + i % 97 for i in range(1010)]  # token ids: 14 tokens of room in the 1024 window
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32000, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == 1010 and reply.usage.completion_tokens == 14


# ---- async client ------------------------------------------------------------------------------

def test_async_client_stream_and_whole(server):
    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as aclient:
            whole = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
            stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                           stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == whole.choices[0].message.content
            completion = await aclient.completions.create(model=MODEL, prompt="The capital of France is",
                                                          max_tokens=4, temperature=0)
            assert completion.choices[0].text

    asyncio.run(run())


# ---- request ids and the request log -----------------------------------------------------------

def test_every_response_carries_a_request_id(http):
    answers = [http.get("/health"), http.get("/v1/models"), http.get("/nope"),
               http.post("/v1/chat/completions", json={"messages": []}),
               http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})]
    ids = [a.headers.get("x-request-id") for a in answers]
    assert all(ids) and len(set(ids)) == len(ids)
    mine = http.get("/v1/models", headers={"x-request-id": "client-chosen-id-42"})
    assert mine.headers["x-request-id"] == "client-chosen-id-42"


def test_one_log_line_per_request_without_text(http, server):
    mark = len(server.lines)
    secret = "Zanzibarquux"
    reply = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": f"Repeat the word {secret}."}], "max_tokens": 8,
        "temperature": 0}, headers={"x-request-id": "log-check-1"})
    assert reply.status_code == 200
    deadline = time.monotonic() + 30  # the line is written just after the response is sent
    while time.monotonic() < deadline and not any("log-check-1" in line for line in server.log_since(mark)):
        time.sleep(0.05)
    lines = [line for line in server.log_since(mark) if "log-check-1" in line]
    assert len(lines) == 1
    assert "prompt=" in lines[0] and "completion=" in lines[0] and "finish=" in lines[0]
    assert all(secret not in line for line in server.log_since(mark))
