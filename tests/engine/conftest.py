"""Engines on the real default model, shared by the engine tests; every test ends leak-free."""

import pytest
import torch

from ember.llm import LLM


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The default model in bfloat16, the CPU default (batch-invariant)."""
    return LLM(max_model_len=2048, max_num_batched_tokens=1024, kv_cache_tokens=64 * 1024)


@pytest.fixture(scope="session")
def llm_fp32() -> LLM:
    """The default model in float32 with its weights dequantized: the reference transformers also
    computes, for parity."""
    return LLM(dtype="float32", quantization="none", max_model_len=2048, kv_cache_tokens=16 * 1024)


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    for name in ("llm", "llm_fp32"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name).engine
            assert not engine.has_unfinished(), "a test left requests running"
            engine.check_invariants()


@pytest.fixture(autouse=True, scope="module")
def _threads_kept():
    """A module leaves torch's CPU threads as it found them: the shared engines chose their row
    plans for the threads they started with (a tensor-parallel group shares the cores while it
    lives and gives them back when it closes)."""
    threads = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == threads, "a test module changed torch's CPU threads"
