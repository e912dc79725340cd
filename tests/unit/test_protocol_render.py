"""Rendering neutral outputs as OpenAI JSON and SSE chunks, and the timings block: pure logic."""

from __future__ import annotations

import hashlib
import json
import math

from ember.protocols.errors import GenerationFailed
from ember.protocols.neutral import ModelInfo, ResponseMeta, RunResult, token_sha
from ember.protocols.openai_chat import CHAT, parse_chat
from ember.protocols.openai_completions import COMPLETIONS, parse_completion
from ember.protocols.sse import ServerEvent, encode
from ember.types import FinishReason, GenerationOutput, RequestTimings, TokenLogprob

MODEL = ModelInfo(name="served", max_model_len=512, vocab_size=1000)
META = ResponseMeta("chatcmpl-1", 1700000000, "served", "fp_test", lambda ids: "".join(f"<{i}>" for i in ids))
PROMPT = [1, 2, 3, 4]


def outputs(deltas: list[tuple[int, str]], finish=FinishReason.STOP, cached=2, logprobs=False):
    """GenerationOutputs as the engine yields them: one token per step, text on the last only."""
    timings = RequestTimings(arrival=100.0, scheduled=100.5, first_token=101.0, finished=103.0)
    ids: list[int] = []
    all_logprobs: list[TokenLogprob] | None = [] if logprobs else None
    result = []
    for step, (token, text) in enumerate(deltas):
        ids.append(token)
        last = step == len(deltas) - 1
        new = [TokenLogprob(token, -0.5, [(token, -0.5), (9, -2.0)])] if logprobs else None
        if new:
            all_logprobs.extend(new)
        result.append(GenerationOutput(
            request_id="r", prompt_token_ids=PROMPT, token_ids=ids, text="".join(t for _, t in deltas) if last else "",
            new_token_ids=[token], text_delta=text, logprobs=all_logprobs, new_logprobs=new,
            finish_reason=finish if last else None, num_cached_tokens=cached, timings=timings))
    return result


def frames(events: list[ServerEvent]) -> list:
    decoded = []
    for event in events:
        data = encode(event).decode()
        assert data.startswith("data: ") and data.endswith("\n\n")
        body = data[len("data: "):-2]
        decoded.append(body if body == "[DONE]" else json.loads(body))
    return decoded


def test_chat_stream_sequence_with_usage():
    request = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                          "stream_options": {"include_usage": True}}, MODEL)
    result = RunResult(1, PROMPT, received=99.0)
    renderer = CHAT.renderer(request, result, META)
    events = renderer.stream_start()
    for out in outputs([(7, "Hel"), (8, "lo")]):
        events += renderer.stream_output(result.add(0, out), out)
    events += renderer.stream_end()
    chunks = frames(events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hel", "lo"]
    assert chunks[3]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                       "matched_stop": 8,  # the reply's last token ended it (an end token)
                                       "token_sha": hashlib.sha256(b"7,8").hexdigest()}
    assert "timings" not in chunks[3]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2},
        "reasoning_tokens": 0}
    assert chunks[4]["timings"]["queue_ms"] == 1500.0
    assert chunks[5] == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks[:5])


def test_chat_stream_without_usage_puts_timings_on_the_finish_chunk():
    request = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2}, MODEL)
    result = RunResult(2, PROMPT)
    renderer = CHAT.renderer(request, result, META)
    assert len(renderer.stream_start()) == 2
    first, second = outputs([(7, "a")]), outputs([(8, "b")])
    early = frames(renderer.stream_output(result.add(0, first[0]), first[0]))
    late = frames(renderer.stream_output(result.add(1, second[0]), second[0]))
    assert "timings" not in early[-1] and "timings" in late[-1]
    assert frames(renderer.stream_end()) == ["[DONE]"]


def test_chat_whole_response():
    request = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1,
                          "return_token_ids": True}, MODEL)
    result = RunResult(1, PROMPT)
    for out in outputs([(7, "Hi"), (8, "!")], finish=FinishReason.LENGTH, logprobs=True):
        result.add(0, out)
    body = CHAT.renderer(request, result, META).response()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["system_fingerprint"] == "fp_test"
    assert choice["message"] == {"role": "assistant", "content": "Hi!", "refusal": None}
    assert choice["finish_reason"] == "length" and choice["token_ids"] == [7, 8]
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["<7>", "<8>"]
    assert choice["logprobs"]["content"][0]["top_logprobs"][1] == {"token": "<9>", "logprob": -2.0,
                                                                   "bytes": list(b"<9>")}
    assert body["prompt_token_ids"] == PROMPT


def test_completion_response_echo_and_logprob_offsets():
    request = parse_completion({"prompt": "Say", "echo": True}, MODEL)
    result = RunResult(1, PROMPT)
    for out in outputs([(7, " hi"), (8, " there")]):
        result.add(0, out)
    body = COMPLETIONS.renderer(request, result, META).response()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Say hi there"
    request = parse_completion({"prompt": "Say", "logprobs": 1, "stream": True}, MODEL)
    result = RunResult(1, PROMPT)
    renderer = COMPLETIONS.renderer(request, result, META)
    chunks = []
    for out in outputs([(7, " hi"), (8, " there")], logprobs=True):
        chunks += frames(renderer.stream_output(result.add(0, out), out))
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:2]] == [[0], [3]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_error_is_an_event_then_done():
    request = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True}, MODEL)
    renderer = CHAT.renderer(request, RunResult(1, PROMPT), META)
    chunks = frames(renderer.stream_error(GenerationFailed("boom")))
    assert chunks[0]["error"]["type"] == "server_error" and "boom" in chunks[0]["error"]["message"]
    assert chunks[1] == "[DONE]"


def test_timings_are_finite_without_tokens_or_times():
    result = RunResult(1, PROMPT)
    timings = result.timings()
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in timings.values())
    assert timings["prompt_n"] == 4 and timings["predicted_n"] == 0
    # One token: no decode interval yet, so decode speed is 0, not a division by zero.
    result.add(0, outputs([(7, "x")])[0])
    assert result.timings()["predicted_per_second"] == 0.0
    assert math.isfinite(result.timings()["prompt_per_second"])


def test_timings_arithmetic():
    result = RunResult(1, PROMPT, received=100.0)
    for out in outputs([(7, "a"), (8, "b"), (9, "c")], cached=1):
        result.add(0, out)
    t = result.timings()
    assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (1, 3, 3)
    assert t["prompt_ms"] == 500.0 and t["predicted_ms"] == 2000.0
    assert t["prompt_per_second"] == 6.0 and t["predicted_per_second"] == 1.0  # 2 tokens after the first in 2 s
    assert t["queue_ms"] == 500.0


def test_token_sha_is_the_sha256_of_the_ids_in_decimal_joined_by_commas():
    assert token_sha([533, 451, 2443]) == hashlib.sha256(b"533,451,2443").hexdigest()
    assert token_sha([]) == hashlib.sha256(b"").hexdigest()
    assert token_sha([1, 23]) != token_sha([12, 3])
