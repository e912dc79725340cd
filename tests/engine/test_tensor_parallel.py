"""Tensor parallel 2 (two ranks over gloo on this host) against one rank, on the default model.

As it comes (4-bit blocks, bfloat16): the same bits as one rank, every log probability equal, not
close: each row-parallel layer's sum runs rank after rank in the order one rank's kernel sums
(models.layers.RowParallelLinear), and nothing else a rank computes depends on the split.
Batching, prefix caching, chunked prefill and speculative rounds keep those bits. Dense float32
weights (--quantization none): the ranks' partial sums are added at once, so log probabilities
are within DENSE_TOLERANCE of one rank's. A rank killed while the group serves gives rank 0 a
clear GroupDown.

The two ranks at 9 query and 3 KV heads split unevenly (6 + 3 query heads, 2 + 1 KV heads), the
split vLLM refuses. One process holds one group at a time: each class builds its own and closes it.
"""

import os
import signal
import socket
import subprocess
import sys

import pytest

from ember.config import SpeculativeConfig
from ember.llm import LLM
from ember.types import SamplingParams

DENSE_TOLERANCE = 1e-3  # nats; measured: 4.1e-5
STEP_TOKENS = 64  # the groups' step budget: a longer prompt is prefilled in chunks

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
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, logprobs=5, draft=False)


def group_of_two(**settings) -> LLM:
    return LLM(max_model_len=2048, kv_cache_tokens=16 * 1024, max_num_batched_tokens=STEP_TOKENS,
               tensor_parallel_size=2, **settings)


def leak_free(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()


def logprobs(output) -> list:
    """Every position's chosen token, its log probability and the alternatives'."""
    return [(x.token_id, x.logprob, x.top) for x in output.logprobs]


def logprob_gap(a, b) -> float:
    """The largest difference between two runs' log probabilities (each chosen token and every
    alternative both runs list)."""
    gap = 0.0
    for x, y in zip(a.logprobs, b.logprobs):
        gap = max(gap, abs(x.logprob - y.logprob))
        theirs = dict(y.top)
        gap = max([gap] + [abs(lp - theirs[t]) for t, lp in x.top if t in theirs])
    return gap


class TestDefaultModel:
    @pytest.fixture(scope="class")
    def tp2(self):
        # n-gram speculation on, for the one test that asks for drafts: the others set draft=False
        llm = group_of_two(speculative=SpeculativeConfig(mode="ngram"))
        yield llm
        llm.close()

    @pytest.fixture(autouse=True)
    def _leak_free(self, tp2):
        yield
        leak_free(tp2)

    def test_the_same_bits_as_one_rank(self, tp2, llm):
        one = llm.generate(PROMPTS, GREEDY)  # batched on both sides
        two = tp2.generate(PROMPTS, GREEDY)
        for a, b in zip(one, two):
            assert len(b.token_ids) == GREEDY.max_tokens
            assert b.token_ids == a.token_ids, (a.text, b.text)
            assert logprobs(b) == logprobs(a)
        assert tp2.engine.runner.model.model._layer_stack() is None  # a split layer keeps the Python loop

    def test_a_request_alone_and_in_a_batch_agree(self, tp2):
        batched = tp2.generate(PROMPTS[:4], GREEDY)
        for prompt, together in zip(PROMPTS[:4], batched):
            alone = tp2.generate(prompt, GREEDY)[0]
            assert logprobs(alone) == logprobs(together)

    def test_chunked_prefill_and_prefix_cache(self, tp2, llm):
        assert len(tp2.encode_prompt(LONG_PROMPT)) > 3 * STEP_TOKENS  # its prefill runs in several steps
        reference = llm.generate(LONG_PROMPT, GREEDY)[0]
        first = tp2.generate(LONG_PROMPT, GREEDY)[0]
        again = tp2.generate(LONG_PROMPT, GREEDY)[0]
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens >= 3 * STEP_TOKENS  # whole blocks from the cache, on both ranks
        assert logprobs(first) == logprobs(reference)
        assert logprobs(again) == logprobs(first)

    def test_speculative_rounds_reach_every_rank(self, tp2):
        """N-gram drafts verified under tensor parallelism: the items each rank runs carry the
        drafted tokens, so the group verifies them together, and the reply is the undrafted one."""
        repetitive = "Copy the list exactly: red, green, blue, red, green, blue, red, green, blue, red, green,"
        before = tp2.engine.counters.spec_accepted_tokens
        plain = tp2.generate(repetitive, SamplingParams(max_tokens=24, temperature=0.0, draft=False))[0]
        drafted = tp2.generate(repetitive, SamplingParams(max_tokens=24, temperature=0.0))[0]
        assert drafted.token_ids == plain.token_ids
        assert tp2.engine.counters.spec_accepted_tokens > before


class TestDenseFloat32:
    @pytest.fixture(scope="class")
    def tp2(self):
        llm = group_of_two(dtype="float32", quantization="none")
        yield llm
        leak_free(llm)
        llm.close()

    def test_close_to_one_rank(self, tp2, llm_fp32):
        one = llm_fp32.generate(PROMPTS + [LONG_PROMPT], GREEDY)
        two = tp2.generate(PROMPTS + [LONG_PROMPT], GREEDY)
        for a, b in zip(one, two):
            assert b.token_ids == a.token_ids, (a.text, b.text)
        assert max(logprob_gap(a, b) for a, b in zip(one, two)) < DENSE_TOLERANCE


RANK_0 = """
import sys
from ember.engine.parallel import GroupDown
from ember.llm import LLM
from ember.types import SamplingParams

llm = LLM(tensor_parallel_size=2, nnodes=2, dist_init_addr=sys.argv[1], max_model_len=256, kv_cache_tokens=4096)
params = SamplingParams(max_tokens=4, temperature=0.0)
print("served", llm.generate("Hello", params)[0].token_ids, flush=True)
sys.stdin.readline()  # rank 1 is killed meanwhile
try:
    llm.generate("Hello", params)
except GroupDown as exc:
    print("GroupDown:", exc.message, flush=True)
llm.close()
"""


def free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_killed_rank_is_a_clear_error():
    """Rank 1 runs in a process of its own (as on another node), so rank 0 learns of its death from
    the group alone: the next step, or the idle heartbeat before it, raises GroupDown."""
    address = free_address()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    rank_1 = subprocess.Popen([sys.executable, "-m", "ember.engine.ranks", "1", "2", address, "0"], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rank_0 = subprocess.Popen([sys.executable, "-c", RANK_0, address], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert rank_0.stdout.readline().startswith("served")
        os.kill(rank_1.pid, signal.SIGKILL)
        rank_1.wait()
        rank_0.stdin.write("\n")
        rank_0.stdin.flush()
        report = rank_0.stdout.readline()
        assert report.startswith("GroupDown: the tensor-parallel group is down: a rank exited or did not answer "
                                 "within 60 s ("), report
        assert rank_0.wait(timeout=60) == 0
    finally:
        for process in (rank_0, rank_1):
            if process.poll() is None:
                process.kill()
                process.wait()
