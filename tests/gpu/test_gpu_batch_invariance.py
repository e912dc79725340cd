"""Batch invariance on CUDA, on the real default model in bfloat16: a request's tokens and log
probabilities are the same bits alone and beside partners of other lengths, as
tests/engine/test_batch_invariance.py holds on the CPU."""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams

TARGET = [{"role": "user", "content": "Why is the sky blue?"}]
PARTNERS = [[{"role": "user", "content": "Hi"}],
            [{"role": "user", "content": "Tell me a long story about a dragon who guards gold. " * 6}]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=4242, max_tokens=16, logprobs=3, ignore_eos=True)
PARTNER = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def cuda_llm():
    llm = LLM(device="cuda", dtype="bfloat16", max_model_len=1024, kv_cache_tokens=16 * 1024)
    yield llm
    llm.close()


def _bits(output):
    return output.token_ids, [(lp.logprob, lp.top) for lp in output.logprobs]


def test_the_engine_reports_its_device_and_its_invariance_check(cuda_llm):
    assert cuda_llm.engine.device.type == "cuda"
    assert cuda_llm.engine.invariance.as_dict()  # what the startup check found, whatever it was


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_keeps_its_bits_beside_partners_on_cuda(cuda_llm, params):
    cuda_llm.engine.kv_manager.reset_prefix_cache()
    alone = _bits(cuda_llm.generate([TARGET], params)[0])
    cuda_llm.engine.kv_manager.reset_prefix_cache()
    together = cuda_llm.generate([TARGET, *PARTNERS], [params] + [PARTNER] * len(PARTNERS))
    assert _bits(together[0]) == alone
