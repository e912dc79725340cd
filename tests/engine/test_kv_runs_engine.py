"""keep_runs on the default model: a request that takes the blocks after a cached prompt's first
moves that prompt's cached data to other blocks, and the prompt asked again reads it there and
gives its cold answer, bit for bit."""

import pytest

from ember import SamplingParams
from ember.llm import LLM

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and [(t.token_id, t.logprob, t.top) for t in a.logprobs] == \
        [(t.token_id, t.logprob, t.top) for t in b.logprobs]


@pytest.fixture(scope="module")
def llm_without_tiers():
    llm = LLM(max_model_len=1024, kv_cache_tokens=4096, cache_ram_mb=0)
    yield llm
    llm.close()


@pytest.mark.parametrize("tiers", [True, False], ids=["the host tier's moves", "the core's copies"])
def test_a_prompt_whose_cached_blocks_moved_gives_its_cold_answer(tiers, request):
    llm = request.getfixturevalue("llm" if tiers else "llm_without_tiers")
    assert (llm.engine.tiers is not None) == tiers
    kv = llm.engine.kv_manager
    kept = kv.keep_runs
    kv.keep_runs = True  # the CPU default where ember's attention kernel reads the pool; any layout can
    try:
        assert kv.reset_prefix_cache()  # every free block plain: the prompt takes a run of them
        prompt = [(7 * i) % 5000 + 100 for i in range(100)]
        cold = llm.generate([prompt], GREEDY)[0]
        moved = kv.blocks_relocated
        # the same first block, then other tokens: blocks 2.. of the prompt's run are taken
        other = llm.generate([prompt[:16] + [(11 * i) % 5000 + 100 for i in range(80)]], GREEDY)[0]
        assert other.num_cached_tokens == 16 and kv.blocks_relocated - moved >= 4
        again = llm.generate([prompt], GREEDY)[0]
        assert again.num_cached_tokens == 96
        assert _same(again, cold)
        llm.engine.check_invariants()
    finally:
        kv.keep_runs = kept
