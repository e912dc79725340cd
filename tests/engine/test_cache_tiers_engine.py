"""The tiers behind the KV pool on the default model: a prompt served from host memory or from
disk (after the engine is built again on the same folder) gives the tokens and log probabilities
of a cold run, bit for bit; another KV dtype never reads the blocks; nothing leaks."""

import pytest

from ember import SamplingParams
from ember.llm import LLM

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
PROMPT = "You keep a ship's log. " * 40 + "Write today's entry."
FILLERS = [f"Unrelated text number {i}. " * 120 for i in range(3)]  # together, more than the pool holds


def _tiered(tmp_path, **overrides) -> LLM:
    settings = dict(max_model_len=2048, kv_cache_tokens=1024, cache_ram_mb=64, cache_disk_dir=str(tmp_path))
    return LLM(**(settings | overrides))


def _answer(llm: LLM):
    return llm.generate([PROMPT], GREEDY)[0]


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and [(t.token_id, t.logprob, t.top) for t in a.logprobs] == \
        [(t.token_id, t.logprob, t.top) for t in b.logprobs]


def _no_leaks(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.engine.kv_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def cold_and_host(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv")
    llm = _tiered(folder)
    cold = _answer(llm)
    llm.generate(FILLERS, GREEDY)  # the prompt's blocks leave the pool for host memory
    from_host = _answer(llm)
    _no_leaks(llm)
    stats = llm.engine.stats().cache_tiers
    llm.close()  # what the disk writer has queued is written
    return folder, cold, from_host, stats


def test_a_prompt_evicted_from_the_pool_comes_back_from_host_memory_exactly(cold_and_host):
    _, cold, from_host, stats = cold_and_host
    assert cold.cached_tokens_by_tier == {"device": 0}
    assert from_host.cached_tokens_by_tier.get("host", 0) > 0
    assert from_host.num_cached_tokens == sum(from_host.cached_tokens_by_tier.values())
    assert _same(from_host, cold)
    assert stats["host"]["hits"] > 0 and stats["host"]["bytes"] > 0


def test_after_a_restart_the_prompt_is_read_from_disk_exactly(cold_and_host):
    folder, cold, _, _ = cold_and_host
    llm = _tiered(folder)
    from_disk = _answer(llm)
    assert from_disk.cached_tokens_by_tier.get("disk", 0) >= len(cold.prompt_token_ids) - 16
    assert _same(from_disk, cold)
    _no_leaks(llm)
    llm.close()


def test_another_kv_dtype_sharing_the_folder_reads_none_of_its_blocks(cold_and_host):
    folder = cold_and_host[0]
    llm = _tiered(folder, dtype="float32", quantization="none", cache_ram_mb=0)
    answer = _answer(llm)
    assert answer.num_cached_tokens == 0 and answer.cached_tokens_by_tier == {"device": 0}
    assert llm.engine.stats().cache_tiers["disk"]["corrupt"] == 0  # not even opened: another folder
    assert len([p for p in folder.iterdir() if p.is_dir()]) == 2  # one namespace each
    _no_leaks(llm)
    llm.close()
