"""Speculative decoding through a real server: every dialect's drafted reply equals its
`"draft": false` reply, and usage, timings, meta_info, the request log, /metrics and /health
count what was drafted and kept."""

from __future__ import annotations

import re
import uuid

import anthropic
import httpx
import openai
import pytest

from ember.config import SpeculativeConfig
from ember.server.flags import build_config
from tests.e2e.conftest import ServerProcess, wait_idle
from tests.e2e.test_cli import parse

# auto with a draft model that cannot load: the server says so and drafts by n-gram lookup. The
# draft length is fixed: a tuned one follows the clock, and these tests count drafts, not speed.
FLAGS = ["--max-model-len", "1024", "--speculate", "auto", "--draft", "/no/such/draft.gguf", "--draft-tokens", "4"]
CODE = "def area(width, height):\n    result = width * height\n    return result\n"
COPY = f"Repeat this code exactly:\n{CODE}"
# Raw text, no chat template: a cycle cut off midway, which the model goes on copying whatever the
# processor's rounding (with COPY alone, an AVX2 processor's rounding led the model to write new
# code, and n-gram lookup found nothing to propose).
CYCLE = "1, 2, 3, 4, " * 5 + "1, 2,"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def spec_server():
    process = ServerProcess(*FLAGS).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(spec_server):
    with httpx.Client(base_url=spec_server.url, timeout=120) as session:
        yield session


@pytest.fixture(scope="module")
def oai(spec_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(oai, draft: bool, **extra):
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": COPY}], temperature=0,
                                       max_tokens=60, extra_body={"draft": draft, **extra})


def _sha(reply) -> str:
    return reply.choices[0].model_extra["token_sha"]


def test_auto_gives_way_to_ngram_lookup_when_the_draft_model_does_not_load(spec_server):
    log = "\n".join(spec_server.lines)
    assert "/no/such/draft.gguf did not load" in log and "n-gram" in log


def test_a_drafted_chat_reply_equals_its_serial_reply_and_counts_its_drafts(oai):
    drafted, serial = _chat(oai, True), _chat(oai, False)
    assert drafted.choices[0].message.content == serial.choices[0].message.content
    assert _sha(drafted) == _sha(serial)
    spec = drafted.usage.model_extra["speculative"]
    assert 0 < spec["accepted"] <= spec["proposed"]
    assert "speculative" not in serial.usage.model_extra
    timings = drafted.model_extra["timings"]
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (spec["proposed"], spec["accepted"])
    assert "draft_n" not in serial.model_extra["timings"]


def test_a_drafted_stream_writes_the_same_text(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": COPY}], temperature=0,
                                         max_tokens=60, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _chat(oai, False).choices[0].message.content
    assert chunks[-1].usage.model_extra["speculative"]["accepted"] > 0


def test_a_stop_string_ends_a_drafted_reply_where_the_serial_one_ends(oai):
    serial = _chat(oai, False).choices[0].message.content
    stop = "* height"
    assert stop in serial
    replies = [_chat(oai, draft, stop=[stop]) for draft in (True, False)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content == serial[:serial.index(stop)]
    assert replies[0].usage.completion_tokens == replies[1].usage.completion_tokens
    assert _sha(replies[0]) == _sha(replies[1])


def test_messages_and_responses_count_their_drafts_too(spec_server, oai):
    claude = anthropic.Anthropic(base_url=spec_server.url, api_key="x", max_retries=0, timeout=120)
    messages = [claude.messages.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": COPY}],
                                       extra_body={"draft": draft, "temperature": 0})
                for draft in (True, False)]
    assert messages[0].content[0].text == messages[1].content[0].text
    assert messages[0].usage.model_extra["speculative"]["accepted"] > 0
    assert "speculative" not in (messages[1].usage.model_extra or {})
    responses = [oai.responses.create(model=MODEL, input=COPY, max_output_tokens=60, temperature=0,
                                      extra_body={"draft": draft}) for draft in (True, False)]
    assert responses[0].output_text == responses[1].output_text
    assert responses[0].usage.model_extra["speculative"]["accepted"] > 0


def test_the_native_route_reports_sglang_speculative_counters(http):
    body = {"text": CYCLE, "sampling_params": {"temperature": 0, "max_new_tokens": 60}}
    drafted = http.post("/generate", json=body).json()
    serial = http.post("/generate", json={**body, "sampling_params": {**body["sampling_params"], "draft": False}}).json()
    assert drafted["text"] == serial["text"]
    meta = drafted["meta_info"]
    assert 0 < meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
    assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
    assert meta["spec_accept_length"] == pytest.approx(1 + meta["spec_num_correct_drafts"] / meta["spec_verify_ct"])
    assert "spec_verify_ct" not in serial["meta_info"]


def test_draft_must_be_a_boolean(http):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi"})):
        reply = http.post(path, json={**body, "draft": "no"})
        assert reply.status_code == 400, path
        error = reply.json()["error"]
        assert error["param"] == "draft" if "param" in error else "draft" in error["message"]


def test_the_request_log_metrics_and_health_count_drafted_tokens(oai, http):
    request_id = f"drafted-{uuid.uuid4().hex[:8]}"
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": COPY}], temperature=0,
                                max_tokens=60, extra_headers={"x-request-id": request_id})
    entry = next(e for e in http.get("/debug/requests").json()["data"] if e["request_id"] == request_id)
    spec = entry["speculative"]
    assert spec["rounds"] == sum(spec["accepted_per_round"]) and 0 < spec["accepted"] <= spec["proposed"]
    health = wait_idle(http)
    assert 0 < health["draft_tokens_accepted_total"] <= health["draft_tokens_total"]
    metrics = http.get("/metrics").text
    drafted = float(re.search(r"^ember:spec_decode_draft_tokens_total (\S+)$", metrics, re.M).group(1))
    accepted = float(re.search(r"^ember:spec_decode_accepted_tokens_total (\S+)$", metrics, re.M).group(1))
    assert 0 < accepted <= drafted


@pytest.mark.parametrize("argv", [["--draft-tokens", "9"], ["--draft-tokens", "0"], ["--ngram", "4:2"],
                                  ["--ngram", "three"], ["--speculate", "draft"],
                                  ["--speculate", "ngram", "--draft", "small.gguf"]])
def test_bad_speculation_settings_are_refused_at_start(argv):
    with pytest.raises(ValueError, match="draft|ngram"):
        build_config(parse(*argv), environ={})


def test_the_speculation_flags_default_to_the_engine_config_defaults():
    assert build_config(parse(), environ={}).engine.speculative == SpeculativeConfig()
    given = build_config(parse("--speculate", "ngram", "--ngram", "2:5"), environ={}).engine.speculative
    assert (given.mode, given.ngram_min, given.ngram_max) == ("ngram", 2, 5)
