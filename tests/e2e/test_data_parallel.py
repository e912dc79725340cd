"""Data parallelism under a real `ember serve --data-parallel-size 2`: a conversation keeps going
to the worker that holds its prefix (the cached tokens in usage prove it), distinct prompts
spread over both workers, both workers' seats run at once, `--seed` holds on every worker,
per-worker metrics, and a killed worker leaves the other serving."""

from __future__ import annotations

import os
import re
import signal
import time

import anthropic
import httpx
import openai
import pytest

from conftest import ServerProcess, wait_idle

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are a patient tutor. You explain one idea at a time, in plain words, with a short example, "
          "and you end every answer with a question that checks what the student understood.")


@pytest.fixture(scope="module")
def dp_server():
    process = ServerProcess("--data-parallel-size", "2", "--max-model-len", "1024", "--max-num-seqs", "2",
                            "--seed", "7").start()
    yield process
    process.stop()


def workers(server) -> list[dict]:
    return httpx.get(server.url + "/health", timeout=30).json()["workers"]


def routed(server) -> list[int]:
    return [worker["requests_routed"] for worker in workers(server)]


def chosen(before: list[int], after: list[int]) -> int:
    """The one worker a single request went to."""
    moved = [i for i, (a, b) in enumerate(zip(before, after)) if b != a]
    assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1, (before, after)
    return moved[0]


def test_two_workers_serve_with_their_own_processes(dp_server):
    body = httpx.get(dp_server.url + "/health", timeout=30).json()
    assert body["status"] == "ok" and len(body["workers"]) == 2
    pids = [worker["worker_pid"] for worker in body["workers"]]
    assert all(pids) and pids[0] != pids[1] and os.getpid() not in pids
    assert all(worker["status"] == "ok" for worker in body["workers"])


def test_a_conversation_stays_on_the_worker_that_holds_its_prefix(dp_server):
    client = openai.OpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is a prime number? Answer in two sentences."}]
    homes = []
    for turn, follow_up in enumerate(["Is 91 one of them?", "And what about 97?", "Why does that matter?"]):
        before = routed(dp_server)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        homes.append(chosen(before, routed(dp_server)))
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn > 0:  # everything up to this turn's new message was computed on the same worker
            assert cached >= reply.usage.prompt_tokens // 2, (turn, cached, reply.usage.prompt_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
    assert len(set(homes)) == 1, homes
    # the same conversation through the Anthropic dialect lands on the same worker, from its cache
    anthropic_client = anthropic.Anthropic(base_url=dp_server.url, api_key="x", max_retries=0, timeout=300)
    before = routed(dp_server)
    message = anthropic_client.messages.create(model=MODEL, system=SYSTEM, messages=messages[1:], max_tokens=16)
    assert chosen(before, routed(dp_server)) == homes[0]
    assert message.usage.cache_read_input_tokens > 0
    health = httpx.get(dp_server.url + "/health", timeout=30).json()
    assert health["workers"][homes[0]]["routed_cached_tokens"] > 0


def test_distinct_prompts_spread_over_both_workers(dp_server):
    client = openai.OpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    before = routed(dp_server)
    for topic in ["harbours", "violins", "glaciers", "printing presses"]:
        client.completions.create(model=MODEL, prompt=f"A short history of {topic}:", max_tokens=8, temperature=0)
    after = routed(dp_server)
    assert sum(after) - sum(before) == 4
    assert all(b > a for a, b in zip(before, after)), (before, after)


def test_a_session_s_distinct_prompts_stay_on_one_worker(dp_server):
    """Prompts that share no prefix, which spread over the workers without a session (above), stay
    on one worker when they name a session: by X-Session-Id, or by the body's prompt_cache_key."""
    client = openai.OpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    homes = {"header": [], "body": []}
    for topic in ["harbours", "violins", "glaciers", "printing presses"]:
        for how, extra in (("header", {"extra_headers": {"X-Session-Id": f"pin-{os.getpid()}"}}),
                           ("body", {"extra_body": {"prompt_cache_key": f"key-{os.getpid()}"}})):
            before = routed(dp_server)
            client.completions.create(model=MODEL, prompt=f"Some facts about {topic} ({how}):", max_tokens=4,
                                      temperature=0, **extra)
            homes[how].append(chosen(before, routed(dp_server)))
    assert all(len(set(workers_seen)) == 1 for workers_seen in homes.values()), homes


def test_every_worker_s_seats_run_at_once(dp_server):
    """Two workers of two seats each: four streams run together, none waits for a seat."""
    client = openai.OpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    streams = [client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Tell me a long story about {topic}."}],
        max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
        for topic in ("harbours", "violins", "glaciers", "lanterns")]
    try:
        for stream in streams:
            next(iter(stream))  # each has been admitted and is producing
        body = httpx.get(dp_server.url + "/health", timeout=30).json()
        assert body["requests_running"] == 4 and body["requests_waiting"] == 0, body
        assert body["streams"]["max"] == 4 and body["data_parallel_size"] == 2 and body["tensor_parallel_size"] == 1
        assert [worker["requests_running"] for worker in body["workers"]] == [2, 2]
    finally:
        for stream in streams:
            stream.close()
    wait_idle(httpx.Client(base_url=dp_server.url, timeout=30))


def test_the_seed_flag_is_the_seed_of_every_request_without_one(dp_server):
    """`--seed 7`: sampled requests that bring no seed run with 7, on whichever worker, and say so."""
    client = openai.OpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    story = [{"role": "user", "content": "Write one sentence about a fox."}]
    replies, ids = [], []
    for turn in range(3):
        request_id = f"seed-flag-{turn}-{os.getpid()}"
        ids.append(request_id)
        reply = client.chat.completions.create(model=MODEL, messages=story, max_tokens=24, temperature=1.0,
                                               extra_headers={"x-request-id": request_id})
        replies.append(reply.choices[0].message.content)
    assert replies[0] == replies[1] == replies[2]
    seeded = client.chat.completions.create(model=MODEL, messages=story, max_tokens=24, temperature=1.0, seed=7)
    assert seeded.choices[0].message.content == replies[0]
    logged = {entry["request_id"]: entry["sampling"]["seed"]
              for entry in httpx.get(dp_server.url + "/debug/requests", timeout=30).json()["data"]}
    assert [logged[request_id] for request_id in ids] == [7, 7, 7]


def test_metrics_are_labelled_by_worker(dp_server):
    text = httpx.get(dp_server.url + "/metrics", timeout=30).text
    for worker in ("0", "1"):
        assert re.search(rf'^ember:engine_worker_up\{{worker="{worker}"\}} 1\.0$', text, re.M)
        assert re.search(rf'^ember:router_requests_total\{{worker="{worker}"\}} [1-9]', text, re.M)
        assert re.search(rf'^ember:generation_tokens_total\{{worker="{worker}"\}} [1-9]', text, re.M)
    assert not re.search(r"^ember:generation_tokens_total [0-9]", text, re.M)  # no unlabelled double count


def test_a_killed_worker_leaves_the_other_serving(dp_server):
    """The last test: it kills worker 0 and waits for its restart."""
    client = openai.OpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    victim = workers(dp_server)[0]
    os.kill(victim["worker_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while workers(dp_server)[0]["status"] == "ok" and time.monotonic() < deadline:
        time.sleep(0.05)
    before = routed(dp_server)
    for topic in ["lanterns", "kites"]:  # sent while worker 0 restarts: worker 1 takes them
        reply = client.completions.create(model=MODEL, prompt=f"Some facts about {topic}:", max_tokens=8,
                                          temperature=0)
        assert reply.choices[0].text
    after = routed(dp_server)
    assert httpx.get(dp_server.url + "/health", timeout=30).status_code == 200
    if workers(dp_server)[0]["status"] != "ok":  # still restarting while those ran: all went to worker 1
        assert after[0] == before[0]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        state = workers(dp_server)[0]
        if state["status"] == "ok":
            break
        time.sleep(0.2)
    assert state["status"] == "ok" and state["worker_restarts"] == 1 and state["worker_pid"] != victim["worker_pid"]
    body = wait_idle(httpx.Client(base_url=dp_server.url, timeout=30))
    assert body["worker_restarts"] == 1 and body["engine"]["kv_blocks_used"] == 0
