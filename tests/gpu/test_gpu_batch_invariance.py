"""Batch invariance on CUDA, on the real default model in bfloat16: a request's tokens and log
probabilities are the same bits alone and beside partners of other lengths, as
tests/engine/test_batch_invariance.py holds on the CPU. The engine does not promise it on CUDA
yet (its startup report says so): there a difference is recorded as an expected failure with
the report's reason, and equal bits pass, so a GPU run shows which of the two holds today."""

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


def test_the_engine_runs_on_cuda_and_says_whether_it_promises_invariance(cuda_llm):
    assert cuda_llm.engine.device.type == "cuda"
    report = cuda_llm.engine.invariance
    assert report.holds or "cuda" in report.reason


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_keeps_its_bits_beside_partners_on_cuda(cuda_llm, params):
    cuda_llm.engine.kv_manager.reset_prefix_cache()
    alone = _bits(cuda_llm.generate([TARGET], params)[0])
    cuda_llm.engine.kv_manager.reset_prefix_cache()
    together = cuda_llm.generate([TARGET, *PARTNERS], [params] + [PARTNER] * len(PARTNERS))
    report = cuda_llm.engine.invariance
    if _bits(together[0]) != alone and not report.holds:
        pytest.xfail(f"bits differ beside partners; the engine says: {report.reason}")
    assert _bits(together[0]) == alone
