"""Observability on one dedicated server (API key, request log, small prefill chunks, a short stats
interval): /metrics and /health counters, the request log, /debug/requests, prompt progress and
per-token timings, and the key kept out of every log and metric."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ServerProcess, serve_command, wait_idle

KEY = "observed-secret-key-5678"
WRONG_KEY = "wrong-secret-key-9012"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET_PROMPT = "Zanzibar-quokka-7731 asks about the tides."  # must never reach a log
LONG_PROMPT = " ".join(f"Line {i}: the lighthouse keeper counts {i} gulls over the grey harbour." for i in range(20))
TERMINAL_EVENTS = ("request_done", "request_error")


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("observability") / "requests.jsonl"
    process = ServerProcess(
        f"--api-key={KEY}", "--request-log", str(log_path), "--log-stats-interval", "0.5",
        "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "64").start()
    process.log_path = log_path
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(observed):
    with httpx.Client(base_url=observed.url, timeout=120, headers=AUTH) as session:
        yield session


@pytest.fixture(scope="module")
def client(observed) -> openai.OpenAI:
    return openai.OpenAI(base_url=observed.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metric_samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label pairs): value} of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(http: httpx.Client) -> dict[tuple, float]:
    reply = http.get("/metrics")
    assert reply.status_code == 200
    return metric_samples(reply.text)


def log_events(observed) -> list[dict]:
    return [json.loads(line) for line in observed.log_path.read_text().splitlines()]


def wait_for(predicate, timeout: float = 60):
    """Poll until predicate() is truthy (a liveness wait; the deadline only stops a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def sse_data(reply: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def chat(content: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


# ---- metrics and /health ----------------------------------------------------------------------

def test_metrics_and_health_counters_follow_a_known_sequence(observed, http, client):
    wait_idle(http)
    before, health_before = scrape(http), http.get("/health").json()
    first = client.chat.completions.create(model="", **chat(SECRET_PROMPT, max_tokens=6, extra_body={"ignore_eos": True}))
    again = client.chat.completions.create(model="", **chat(SECRET_PROMPT, max_tokens=6, extra_body={"ignore_eos": True}))
    streamed = list(client.completions.create(model="", prompt="Once upon a time", max_tokens=5, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    usages = [first.usage, again.usage, streamed[-1].usage]
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the repeated prompt hit the prefix cache
    wait_idle(http)
    wait_for(lambda: http.get("/health").json()["requests_finished"] >= health_before["requests_finished"] + 3)
    after, health = scrape(http), http.get("/health").json()

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    assert completion == 6 + 6 + 5
    assert delta("ember:requests_finished_total", route="chat", finished_reason="length") == 2
    assert delta("ember:requests_finished_total", route="completions", finished_reason="length") == 1
    assert delta("ember:http_requests_total", route="chat", status="200") == 2
    assert delta("ember:prompt_tokens_total") == prompt
    assert delta("ember:prompt_tokens_cached_total") == cached
    assert delta("ember:prompt_tokens_computed_total") == prompt - cached
    assert delta("ember:generation_tokens_total") == completion
    assert delta("ember:prefix_cache_hits_total") == cached
    assert delta("ember:time_to_first_token_seconds_count", route="chat") == 2
    assert delta("ember:e2e_request_latency_seconds_count", route="completions") == 1
    assert delta("ember:time_per_output_token_seconds_count", route="chat") == 2
    assert delta("ember:prefill_seconds_total") > 0 and delta("ember:decode_seconds_total") > 0
    assert after[("ember:kv_cache_blocks_used", ())] == 0 and after[("ember:kv_cache_usage_ratio", ())] == 0
    assert after[("ember:num_requests_running", ())] == 0 and after[("ember:kv_cache_blocks_total", ())] > 0
    info = next(dict(labels) for (name, labels) in after if name == "ember:model_info")
    assert info["model"] == first.model and info["max_model_len"] == "1024"
    assert info["max_num_batched_tokens"] == "64"
    assert info["batch_invariant"] == "True"  # the self-check's verdict

    assert health["max_model_len"] == 1024
    # the startup self-check kept the promise on this processor, and says how
    assert health["batch_invariant"] is True and health["batch_invariant_reason"].startswith("checked on this processor")
    assert health["requests_finished"] - health_before["requests_finished"] == 3
    assert health["prompt_tokens_total"] - health_before["prompt_tokens_total"] == prompt
    assert health["cached_tokens_total"] - health_before["cached_tokens_total"] == cached
    assert health["completion_tokens_total"] - health_before["completion_tokens_total"] == completion
    assert health["prefill_seconds_total"] > health_before["prefill_seconds_total"]
    assert health["decode_seconds_total"] > health_before["decode_seconds_total"]
    # No label names a request: neither the response id nor anything of the prompt.
    text = http.get("/metrics").text
    assert first.id not in text and first.id.split("-", 1)[1] not in text and "Zanzibar" not in text


# ---- prompt progress and per-token timings ------------------------------------------------------

def test_prompt_progress_runs_forward_and_ends_before_the_first_content(http):
    body = chat(LONG_PROMPT, max_tokens=4, stream=True, return_progress=True, timings_per_token=True,
                stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        chunks = sse_data(reply)
    usage = chunks[-1]["usage"]
    first_content = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    progress = [(i, c["prompt_progress"]) for i, c in enumerate(chunks) if "prompt_progress" in c]
    assert len(progress) >= 3  # a prompt of several 64-token chunks
    assert all(i < first_content for i, _ in progress)
    processed = [p["processed"] for _, p in progress]
    assert processed == sorted(processed)
    assert processed[0] == progress[0][1]["cache"] and processed[-1] == usage["prompt_tokens"]
    assert all(p["total"] == usage["prompt_tokens"] and p["cache"] == usage["prompt_tokens_details"]["cached_tokens"]
               for _, p in progress)
    assert all(p["time_ms"] >= 0 for _, p in progress)
    deltas = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    predicted = [c["timings"]["predicted_n"] for c in deltas]
    assert predicted and predicted == sorted(predicted) and predicted[0] >= 1
    assert all(c["timings"]["prompt_n"] + c["timings"]["cache_n"] == usage["prompt_tokens"] for c in deltas)


def test_without_the_options_a_stream_has_no_progress_or_running_timings(http):
    with http.stream("POST", "/v1/chat/completions", json=chat(LONG_PROMPT, max_tokens=3, stream=True)) as reply:
        chunks = sse_data(reply)
    assert not any("prompt_progress" in c for c in chunks)
    assert not any("timings" in c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))


# ---- the request log ----------------------------------------------------------------------------

def test_the_request_log_has_one_terminal_event_per_started_request_and_no_text(observed, http, client):
    assert http.post("/v1/chat/completions", json=chat(SECRET_PROMPT, temperature="hot")).status_code == 400
    with http.stream("POST", "/v1/chat/completions",
                     json=chat(SECRET_PROMPT, max_tokens=400, ignore_eos=True, stream=True)) as reply:
        next(line for line in reply.iter_lines() if line.startswith("data: "))  # then leave mid-stream
    client.chat.completions.create(model="", **chat(SECRET_PROMPT, max_tokens=3, n=2, seed=7, temperature=0.8))
    wait_idle(http)

    def settled():
        events = log_events(observed)
        starts = [e["request_id"] for e in events if e["event"] == "request_start"]
        ends = [e["request_id"] for e in events if e["event"] in TERMINAL_EVENTS]
        return events if sorted(starts) == sorted(ends) else None

    events = wait_for(settled)
    assert events, "a started request has no terminal event"
    starts = [e for e in events if e["event"] == "request_start"]
    ends = [e for e in events if e["event"] in TERMINAL_EVENTS]
    assert len({e["request_id"] for e in starts}) == len(starts) == len(ends) >= 6
    assert [e["event"] for e in events].count("server_start") == 1
    server_start = events[0]
    assert server_start["event"] == "server_start"
    assert server_start["model"]["max_model_len"] == 1024 and server_start["memory"]["kv_cache_blocks"] > 0
    assert server_start["engine"]["max_num_batched_tokens"] == 64
    assert "--api-key=<redacted>" in server_start["argv"]
    invariance = server_start["batch_invariance"]
    assert invariance["holds"] is True and invariance["check_seconds"] > 0 and invariance["row_plan"]

    rejected = [e for e in events if e["event"] == "request_rejected"]
    assert any(e["status"] == 400 and e["param"] == "temperature" and e["type"] == "invalid_request_error"
               for e in rejected)
    gone = [e for e in ends if e["event"] == "request_error" and e.get("code") == "client_gone"]
    assert gone and gone[-1]["completion_tokens"] < 400
    done = [e for e in ends if e["event"] == "request_done"]
    seeded = next(e for e in starts if e["shape"]["n"] == 2)
    assert seeded["sampling"]["seed"] == 7 and seeded["sampling"]["temperature"] == 0.8
    assert seeded["protocol"] == "chat" and seeded["limits"]["max_tokens"] == 3
    finished = next(e for e in done if e["request_id"] == seeded["request_id"])
    assert finished["n"] == 2 and finished["completion_tokens"] == 6 and len(finished["finish_reasons"]) == 2
    assert set(finished["seconds"]) >= {"queue", "prefill", "decode", "ttft", "total"}
    assert "Zanzibar" not in observed.log_path.read_text()


def test_debug_requests_needs_the_key_and_holds_numbers_only(observed, http):
    assert httpx.get(observed.url + "/debug/requests").status_code == 401
    reply = http.get("/debug/requests")
    assert reply.status_code == 200
    entries = reply.json()["data"]
    assert 0 < len(entries) <= 100
    assert {"request_id", "protocol", "status", "outcome", "prompt_tokens"} <= set(entries[-1])
    assert "Zanzibar" not in reply.text and "lighthouse" not in reply.text


def test_the_throughput_line_appears_while_busy(observed, http, client):
    client.completions.create(model="", prompt="The sea", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert wait_for(lambda: any("throughput: prompt" in line for line in observed.lines), timeout=30)
    assert wait_for(lambda: any(e["event"] == "throughput" for e in log_events(observed)), timeout=30)


def test_the_key_never_reaches_a_log_or_a_metric(observed, http):
    assert httpx.get(observed.url + "/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
    surfaces = {"stderr": "\n".join(observed.lines), "request log": observed.log_path.read_text(),
                "metrics": http.get("/metrics").text, "debug": http.get("/debug/requests").text,
                "health": http.get("/health").text}
    for where, text in surfaces.items():
        assert KEY not in text and WRONG_KEY not in text, where


def test_a_request_log_that_cannot_be_opened_stops_the_start(tmp_path):
    missing = tmp_path / "no-such-dir" / "requests.jsonl"
    done = subprocess.run([*serve_command(), "--port", "0", "--request-log", str(missing)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "cannot open the request log" in done.stderr and str(missing) in done.stderr


def test_the_request_log_records_defaults_sessions_parse_outcomes_and_rejections(observed, http, client):
    long = [{"role": "user", "content": "ok"}] * 257
    assert http.post("/v1/chat/completions", json={"messages": long}).status_code == 400
    assert http.post("/v1/chat/completions", json=chat(LONG_PROMPT * 6)).status_code == 400  # past the window
    client.chat.completions.create(model="", **chat("Hi", max_tokens=3), prompt_cache_key="conv-9")
    wait_idle(http)

    def settled():
        events = log_events(observed)
        done = [e for e in events if e["event"] == "request_done" and e.get("session") == "conv-9"]
        return events if done else None

    events = wait_for(settled)
    assert events, "the session's request has no request_done"
    server_start = events[0]
    assert set(server_start["sampling_defaults"]) == {"default", "thinking", "non_thinking",
                                                      "override_generation_config", "flags"}
    assert server_start["thinking_defaults"]["default_thinking_budget"] is None
    start = next(e for e in events if e["event"] == "request_start" and e.get("session") == "conv-9")
    assert start["shape"]["requested_reasoning_effort"] is None
    done = next(e for e in events if e["event"] == "request_done" and e.get("session") == "conv-9")
    assert done["tool_call_parse"] is None and done["thinking_budget"] is None  # no tools, no think block
    timing = done["engine_timing"]
    assert timing["total_seconds"] == pytest.approx(timing["queue_wait_seconds"] + timing["prefill_seconds"]
                                                    + timing["decode_seconds"])
    rejected = next(e for e in events if e["event"] == "request_rejected" and e.get("code") == "too_many_messages")
    assert rejected["phase"] == "parse" and "256" in rejected["message"] and rejected["shape"] is None
    too_long = next(e for e in events if e["event"] == "request_rejected" and e.get("code") == "context_length_exceeded")
    assert too_long["phase"] == "prepare" and too_long["shape"]["num_messages"] == 1 and too_long["message"]
