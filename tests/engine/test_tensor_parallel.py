"""Tensor parallel 2 (two ranks over gloo on this host) against one rank, on the default model in
float32 with its weights dequantized: the same greedy tokens, log probabilities within a stated
tolerance, and batching, prefix caching and chunked prefill unchanged.

The group's two ranks at 9 query and 3 KV heads split unevenly (6 + 3 query heads, 2 + 1 KV
heads), so this is the split vLLM refuses. Sums over ranks round differently from one matmul, so
log probabilities are compared to LOGPROB_TOLERANCE, not bit for bit.
"""

import pytest

from ember.config import SpeculativeConfig
from ember.llm import LLM
from ember.types import SamplingParams

LOGPROB_TOLERANCE = 1e-3  # nats; measured here: about 1e-5
STEP_TOKENS = 64  # the TP 2 engine's step budget: a longer prompt is prefilled in chunks

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "A haiku about the sea:",
    "import numpy as np\nx = np.arange(",
    "The largest planet in the solar system is",
    "Translate to French: good morning",
    "List three fruits: apple,",
]
LONG_PROMPT = " ".join(f"Item {i} is a small red box with a label." for i in range(20)) + " The last item is"


@pytest.fixture(scope="module")
def tp2():
    # n-gram speculation on, for the one test that asks for drafts: the others set draft=False
    # (one process holds one group, so a second engine cannot be built beside this one)
    llm = LLM(dtype="float32", quantization="none", max_model_len=2048, kv_cache_tokens=16 * 1024,
              max_num_batched_tokens=STEP_TOKENS, tensor_parallel_size=2, speculative=SpeculativeConfig(mode="ngram"))
    yield llm
    llm.close()


@pytest.fixture(autouse=True)
def _tp2_leak_free(request):
    yield
    if "tp2" in request.fixturenames:
        engine = request.getfixturevalue("tp2").engine
        assert not engine.has_unfinished()
        engine.check_invariants()


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, draft=False)


def logprob_gap(a, b) -> float:
    """The largest difference between two runs' log probabilities (each chosen token and every
    alternative both runs list)."""
    gap = 0.0
    for x, y in zip(a.logprobs, b.logprobs):
        gap = max(gap, abs(x.logprob - y.logprob))
        theirs = dict(y.top)
        gap = max([gap] + [abs(lp - theirs[t]) for t, lp in x.top if t in theirs])
    return gap


def test_same_greedy_tokens_and_close_logprobs_as_one_rank(tp2, llm_fp32):
    one = llm_fp32.generate(PROMPTS, GREEDY)  # batched on both sides
    two = tp2.generate(PROMPTS, GREEDY)
    for a, b in zip(one, two):
        assert b.token_ids == a.token_ids, (a.text, b.text)
        assert len(b.token_ids) == GREEDY.max_tokens
    gap = max(logprob_gap(a, b) for a, b in zip(one, two))
    assert gap < LOGPROB_TOLERANCE, gap


def test_a_request_alone_and_in_a_batch_agree(tp2):
    batched = tp2.generate(PROMPTS[:4], GREEDY)
    for prompt, together in zip(PROMPTS[:4], batched):
        alone = tp2.generate(prompt, GREEDY)[0]
        assert alone.token_ids == together.token_ids


def test_chunked_prefill_and_prefix_cache(tp2, llm_fp32):
    assert len(tp2.encode_prompt(LONG_PROMPT)) > 3 * STEP_TOKENS  # its prefill runs in several steps
    reference = llm_fp32.generate(LONG_PROMPT, GREEDY)[0]
    first = tp2.generate(LONG_PROMPT, GREEDY)[0]
    again = tp2.generate(LONG_PROMPT, GREEDY)[0]
    assert first.token_ids == reference.token_ids
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= 3 * STEP_TOKENS  # whole blocks from the cache, on both ranks
    assert again.token_ids == first.token_ids
    assert logprob_gap(first, reference) < LOGPROB_TOLERANCE



def test_speculative_rounds_reach_every_rank(tp2):
    """N-gram drafts verified under tensor parallelism: the plan each rank runs carries the drafted
    tokens, so the group verifies them together, and the reply is the undrafted one."""
    repetitive = "Copy the list exactly: red, green, blue, red, green, blue, red, green, blue, red, green,"
    before = tp2.engine.counters.spec_accepted_tokens
    plain = tp2.generate(repetitive, SamplingParams(max_tokens=24, temperature=0.0, draft=False))[0]
    drafted = tp2.generate(repetitive, SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert drafted.token_ids == plain.token_ids
    assert tp2.engine.counters.spec_accepted_tokens > before
