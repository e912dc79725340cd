"""The KV cache tiers over HTTP, on two `ember serve` runs sharing one --cache-dir: a pool of 8 MiB
(352 tokens: one long prompt at a time) with host memory and disk behind it.

A prompt pushed out of the pool by others comes back from host memory, and after a restart from
disk, with the same tokens and log-probabilities as when it was computed; /health, /metrics,
/generate's meta_info and /debug/requests say which tier served it, and no KV block stays in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ServerProcess, wait_idle

MODEL = "tiered"
HOST_MIB, DISK_MIB = 64, 256
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
# about 270 tokens each: the 352-token pool holds one of them (and its reply) at a time
LONG_PROMPT = " ".join(f"Step {i}: the river carries {i} stones down to the sea." for i in range(18))
CHAT_PROMPT = " ".join(f"Rule {i}: every lantern on pier {i} is lit at dusk." for i in range(16))
OTHER_PROMPTS = [" ".join(f"Note {k}-{i}: a fox jumps over {i} fences at dawn." for i in range(18)) for k in range(3)]


def serve(cache_dir) -> ServerProcess:
    return ServerProcess("--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "4",
                         "--kv-cache-mib", "8", "--cache-ram", str(HOST_MIB), "--cache-dir", str(cache_dir),
                         "--cache-disk-mib", str(DISK_MIB)).start()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-cache")


@pytest.fixture(scope="module")
def first_server(cache_dir):
    process = serve(cache_dir)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(first_server):
    with httpx.Client(base_url=first_server.url, timeout=300) as session:
        yield session


def generate(http: httpx.Client, text: str) -> dict:
    reply = http.post("/generate", json={"text": text, "sampling_params": GREEDY, "return_logprob": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat(url: str, request_id: str):
    client = openai.OpenAI(base_url=url + "/v1", api_key="not-checked", max_retries=0, timeout=300)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPT}], temperature=0, max_tokens=8,
        logprobs=True, extra_headers={"x-request-id": request_id})


def chat_logprobs(reply) -> list[tuple[str, float]]:
    return [(entry.token, entry.logprob) for entry in reply.choices[0].logprobs.content]


def logged(http: httpx.Client, request_id: str) -> dict:
    return next(entry for entry in http.get("/debug/requests").json()["data"] if entry["request_id"] == request_id)


@dataclass
class HostRound:
    """The long prompt and the chat computed cold, pushed out of the pool, then asked again."""

    cold: dict
    warm: dict
    cold_chat: object
    warm_chat: object
    warm_chat_logged: dict


@pytest.fixture(scope="module")
def host_round(first_server, http) -> HostRound:
    cold = generate(http, LONG_PROMPT)
    cold_chat = chat(first_server.url, "chat-cold")
    for text in OTHER_PROMPTS:
        generate(http, text)
    warm = generate(http, LONG_PROMPT)
    warm_chat = chat(first_server.url, "chat-warm")
    return HostRound(cold, warm, cold_chat, warm_chat, logged(http, "chat-warm"))


def test_a_prompt_pushed_out_of_the_pool_comes_back_from_host_memory_unchanged(host_round):
    cold, warm = host_round.cold["meta_info"], host_round.warm["meta_info"]
    assert cold["cached_tokens"] == 0 and cold["cached_tokens_details"] == {"device": 0, "host": 0, "disk": 0}
    details = warm["cached_tokens_details"]
    assert set(details) == {"device", "host", "disk"} and details["host"] > 0
    assert sum(details.values()) == warm["cached_tokens"] and warm["cached_tokens"] < warm["prompt_tokens"]
    assert host_round.warm["output_ids"] == host_round.cold["output_ids"]
    assert warm["output_token_logprobs"] == cold["output_token_logprobs"]


def test_a_chat_served_from_host_memory_reports_its_total_and_replies_the_same(host_round):
    cold_chat, warm_chat, entry = host_round.cold_chat, host_round.warm_chat, host_round.warm_chat_logged
    cached = warm_chat.usage.prompt_tokens_details.cached_tokens
    assert entry["cached_tokens"] == cached and sum(entry["cached_tokens_details"].values()) == cached
    assert entry["cached_tokens_details"]["host"] > 0 and "host" in entry["prefix_reuse_path"].split("+")
    assert warm_chat.choices[0].message.content == cold_chat.choices[0].message.content
    assert chat_logprobs(warm_chat) == chat_logprobs(cold_chat)


def metric_samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_health_and_metrics_report_the_tiers_and_no_block_stays_in_use(host_round, http):
    health = wait_idle(http)
    assert health["engine"]["kv_blocks_used"] == 0
    assert health["kv_cache_tokens"] == 352 and health["max_model_len"] == 1024 and health["context_length"] == 352
    tiers = health["cache_tiers"]
    assert set(tiers) == {"host", "disk"}
    assert health["cache_bytes"] == health["host_cache_bytes"] == tiers["host"]["bytes"] > 0
    assert health["host_cache_cap_bytes"] == tiers["host"]["capacity_bytes"] == HOST_MIB * 2**20
    assert health["host_cache_evictions"] == tiers["host"]["evictions"]
    assert tiers["host"]["hits"] > 0 and tiers["host"]["blocks"] > 0
    assert health["disk_cache_enabled"] is True and tiers["disk"]["corrupt"] == 0
    assert health["disk_cache_bytes"] == tiers["disk"]["bytes"] > 0
    assert health["disk_cache_cap_bytes"] == tiers["disk"]["capacity_bytes"] == DISK_MIB * 2**20
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 1024 and card["kv_cache_tokens"] == 352 and card["cache_ram_mib"] == HOST_MIB

    samples = metric_samples(http.get("/metrics").text)  # the same engine snapshot: nothing ran since
    for tier in ("host", "disk"):
        label = (("tier", tier),)
        assert samples[("ember:kv_cache_tier_bytes", label)] == tiers[tier]["bytes"]
        assert samples[("ember:kv_cache_tier_blocks", label)] == tiers[tier]["blocks"]
        assert samples[("ember:kv_cache_tier_capacity_bytes", label)] == tiers[tier]["capacity_bytes"]
        for key in ("hits", "misses", "evictions"):
            assert samples[(f"ember:kv_cache_tier_{key}_total", label)] == tiers[tier][key]
        assert samples[("ember:kv_cache_tier_read_seconds_total", label)] >= 0
        assert samples[("ember:kv_cache_tier_write_seconds_total", label)] > 0
    assert samples[("ember:kv_cache_tier_enabled", (("tier", "disk"),))] == 1


def test_a_restarted_server_reads_the_prompt_back_from_disk_unchanged(host_round, first_server, cache_dir):
    assert first_server.interrupt() == 0  # a graceful stop writes out what the disk tier still has queued
    second = serve(cache_dir)
    try:
        with httpx.Client(base_url=second.url, timeout=300) as session:
            again = generate(session, LONG_PROMPT)
            details = again["meta_info"]["cached_tokens_details"]
            assert details["disk"] > 0 and details["host"] == 0
            assert sum(details.values()) == again["meta_info"]["cached_tokens"]
            assert again["output_ids"] == host_round.cold["output_ids"]
            assert again["meta_info"]["output_token_logprobs"] == host_round.cold["meta_info"]["output_token_logprobs"]
            health = wait_idle(session)
            assert health["engine"]["kv_blocks_used"] == 0
            assert health["cache_tiers"]["disk"]["hits"] > 0 and health["disk_cache_enabled"] is True
    finally:
        second.stop()
