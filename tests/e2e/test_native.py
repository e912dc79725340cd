"""SGLang's /generate and vLLM's /tokenize and /detokenize on a real `ember serve`, through httpx."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import wait_idle

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def generate(http, **body):
    reply = http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream_chunks(http, **body) -> list:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_one_prompt_whole(http):
    body = generate(http, text=PROMPT, sampling_params=GREEDY, rid="my-id")
    info = body["meta_info"]
    assert info["id"] == "my-id"
    assert info["finish_reason"] == {"type": "length", "length": 8}
    assert info["completion_tokens"] == len(body["output_ids"]) == 8
    assert info["prompt_tokens"] == http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert body["text"] == http.post("/detokenize", json={"tokens": body["output_ids"]}).json()["prompt"]
    stamps = [info[k] for k in ("request_received_ts", "forward_entry_time", "prefill_finished_time",
                                "request_finished_ts", "response_sent_to_client_ts")]
    assert stamps == sorted(stamps)
    for key in ("e2e_latency", "queue_time", "first_token_latency", "decode_throughput", "cached_tokens"):
        assert isinstance(info[key], (int, float)) and info[key] >= 0
    # the same greedy tokens as the Completions route gives
    completion = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True, "return_token_ids": True}).json()
    assert completion["choices"][0]["token_ids"] == body["output_ids"]


def test_token_ids_in_and_a_stop_string(http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    whole = generate(http, input_ids=ids, sampling_params=GREEDY)
    assert whole["output_ids"] == generate(http, text=PROMPT, sampling_params=GREEDY)["output_ids"]
    cut = whole["text"].strip().split(" ")[1]
    stopped = generate(http, input_ids=ids, sampling_params={**GREEDY, "stop": [cut]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": cut}
    assert cut not in stopped["text"] and whole["text"].startswith(stopped["text"])


def test_a_batch_runs_together_and_matches_each_prompt_alone(http):
    texts = [PROMPT, "Once upon a time", "1, 2, 3,"]
    alone = [generate(http, text=t, sampling_params=GREEDY) for t in texts]
    batch = generate(http, text=texts, sampling_params=GREEDY, rid=["a", "b", "c"])
    assert isinstance(batch, list) and [item["index"] for item in batch] == [0, 1, 2]
    assert [item["meta_info"]["id"] for item in batch] == ["a", "b", "c"]
    assert [item["output_ids"] for item in batch] == [item["output_ids"] for item in alone]
    assert [item["meta_info"]["prompt_tokens"] for item in batch] == [a["meta_info"]["prompt_tokens"] for a in alone]
    per_item = generate(http, text=texts[:2], sampling_params=[{**GREEDY, "max_new_tokens": 2}, GREEDY])
    assert [len(item["output_ids"]) for item in per_item] == [2, 8]


def test_streams_are_cumulative_and_end_like_the_whole_reply(http):
    whole = generate(http, text=PROMPT, sampling_params=GREEDY)
    chunks = stream_chunks(http, text=PROMPT, sampling_params=GREEDY)
    assert len(chunks) > 1
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_a_streamed_batch_tags_each_chunk_with_its_prompt(http):
    chunks = stream_chunks(http, text=[PROMPT, "Once upon a time"], sampling_params=GREEDY)
    last = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(last) == [0, 1]
    batch = generate(http, text=[PROMPT, "Once upon a time"], sampling_params=GREEDY)
    assert [last[i]["output_ids"] for i in (0, 1)] == [item["output_ids"] for item in batch]


def test_seeded_sampling_is_reproducible(http):
    seeded = {"temperature": 1.0, "top_p": 0.95, "seed": 1234, "max_new_tokens": 12, "ignore_eos": True}
    first = generate(http, text=PROMPT, sampling_params=seeded)
    assert generate(http, text=PROMPT, sampling_params=seeded)["output_ids"] == first["output_ids"]
    assert stream_chunks(http, text=PROMPT, sampling_params=seeded)[-1]["output_ids"] == first["output_ids"]
    other = generate(http, text=[PROMPT] * 3, sampling_params=[{**seeded, "seed": s} for s in (1, 2, 1234)])
    assert other[2]["output_ids"] == first["output_ids"]


def test_logprobs_in_sglang_shape(http):
    body = generate(http, text=PROMPT, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2,
                    return_text_in_logprobs=True, token_ids_logprob=[11, 12])
    info = body["meta_info"]
    assert info["input_token_logprobs"] == []
    assert [entry[1] for entry in info["output_token_logprobs"]] == body["output_ids"]
    for chosen, top, named in zip(info["output_token_logprobs"], info["output_top_logprobs"],
                                  info["output_token_ids_logprobs"]):
        assert chosen[0] <= 0 and chosen[1] == top[0][1] and chosen[0] == top[0][0]  # greedy: the top token
        assert len(top) == 2 and top[0][0] >= top[1][0] and isinstance(top[0][2], str)
        assert [entry[1] for entry in named] == [11, 12]


def test_a_json_schema_holds_the_reply(http):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    body = generate(http, text="Answer in JSON. " + PROMPT, sampling_params={
        "temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)})
    assert body["meta_info"]["finish_reason"]["type"] == "stop"
    assert isinstance(json.loads(body["text"])["city"], str)


def test_a_disconnect_aborts_and_frees_the_kv_blocks(http):
    wait_idle(http)
    body = {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as reply:
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    idle = wait_idle(http)
    assert idle["engine"]["kv_blocks_used"] == 0


@pytest.mark.parametrize("body, param", [
    ({"sampling_params": {}}, "text"),
    ({"text": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": PROMPT, "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
    ({"text": PROMPT, "logprob_start_len": 0, "return_logprob": True}, "logprob_start_len"),
    ({"text": [PROMPT, 5]}, "text[1]"),
    ({"input_ids": [1, 10 ** 9]}, "input_ids[1]"),
    ({"input_ids": [1] * 1100}, "input_ids"),
    ({"input_ids": [[1, 2], [1] * 1100]}, "input_ids[1]"),
    ({"text": PROMPT, "sampling_params": {"regex": "("}}, "sampling_params.regex"),
    ({"text": PROMPT, "image_data": "data:image/png;base64,AAAA"}, "image_data"),
])
def test_refusals_are_400s_naming_the_field(http, body, param):
    reply = http.post("/generate", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_tokenize_and_detokenize(http, client, model_id):
    text = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert text["count"] == len(text["tokens"]) == len(text["token_strs"]) and text["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": PROMPT}
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    usage = client.chat.completions.create(model=model_id, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][:bare["count"]] and bare["count"] < chat["count"]
    for path, body, param in (("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
                              ("/tokenize", {"prompt": PROMPT, "model": "other"}, "model")):
        reply = http.post(path, json=body)
        assert reply.status_code in (400, 404) and reply.json()["error"]["param"] == param
