"""The paged engine on a tiny random llama: parity with transformers through chunked prefill and
decode, and exact results under preemption and mixed batches."""

import pytest
import torch
import transformers

from ember import SamplingParams
from ember.config import EngineConfig, ModelConfig
from ember.engine import runner
from ember.engine.core import EngineCore
from ember.engine.loading import build_model


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


def _engine(reference, dtype, **overrides) -> EngineCore:
    model_config = ModelConfig.from_hf(reference.config.to_dict())
    model_config.eos_token_ids = []
    model = build_model(model_config, dtype, torch.device("cpu"))
    model.load_weights(reference.state_dict().items())
    settings = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=8, kv_cache_tokens=512, dtype="float32")
    settings.update(overrides)
    return EngineCore(model, model_config, EngineConfig(**settings), set(), torch.device("cpu"), dtype)


def _run(engine: EngineCore, prompts, params):
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    tokens = {str(i): [] for i in range(len(prompts))}
    logprobs = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
    engine.check_invariants()
    return [tokens[str(i)] for i in range(len(prompts))], [logprobs[str(i)] for i in range(len(prompts))]


# How rows attend: ember's attention kernel (ember.kernels, its blocks of 16 slots), or the torch
# paths (blocks of 4 slots; one padded batch, and sequences past 8 keys in chunks of 8).
DECODE_PATHS = {"attention-kernel": (True, None), "torch-batched-decode": (False, None),
                "torch-long-decodes-in-chunks-of-8": (False, 8)}


def _attention(kernel: bool) -> dict:
    return dict(cpu_kernels=kernel, block_size=16 if kernel else 4)


@pytest.mark.parametrize("decode_path", list(DECODE_PATHS))
def test_logprobs_match_transformers_through_paged_cache(decode_path, monkeypatch):
    kernel, long_decode_chunk = DECODE_PATHS[decode_path]
    long_decodes = _count_long_decodes(monkeypatch, long_decode_chunk)
    reference = _tiny_llama()
    engine = _engine(reference, torch.float32, **_attention(kernel))
    assert engine.runner.cache.kernel_layout == kernel
    torch.manual_seed(1)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (19, 5, 11)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)] * 3
    tokens, logprobs = _run(engine, prompts, params)
    for prompt, out, lps in zip(prompts, tokens, logprobs):
        full = torch.tensor([prompt + out])
        with torch.no_grad():
            ref = torch.log_softmax(reference(full).logits[0].float(), dim=-1)
        for step, (token, lp) in enumerate(zip(out, lps)):
            expected = ref[len(prompt) - 1 + step]
            assert token == int(expected.argmax())
            assert lp.logprob == pytest.approx(float(expected[token]), rel=1e-4, abs=1e-4)
    assert (long_decodes[0] > 0) == bool(long_decode_chunk)


def _count_long_decodes(monkeypatch, chunk: int | None) -> list[int]:
    """With a chunk, sequences decode past `chunk` keys on the chunked path; the count says how often."""
    calls = [0]
    real = runner.long_decode

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "long_decode", counted)
    if chunk:
        monkeypatch.setattr(runner, "LONG_DECODE_CHUNK", chunk)
    return calls


@pytest.mark.parametrize("decode_path", list(DECODE_PATHS))
def test_preemption_and_mixed_batches_give_identical_tokens(decode_path, monkeypatch):
    kernel, long_decode_chunk = DECODE_PATHS[decode_path]
    long_decodes = _count_long_decodes(monkeypatch, long_decode_chunk)  # with 8: blocks scattered by preemption
    reference = _tiny_llama()
    torch.manual_seed(2)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (30, 7, 22, 13, 40, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=20) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=20) for i in range(len(prompts))]
    roomy = _engine(reference, torch.bfloat16, max_num_batched_tokens=512, **_attention(kernel))
    alone = [_run(roomy, [p], [sp])[0][0] for p, sp in zip(prompts, params)]
    # 96 tokens of cache cannot hold six sequences of up to 60 tokens: preemption must happen. The
    # pool alone (no host tier): on the torch path a prompt cut into other chunks gets other bits in
    # its second layer's keys (a known gap of that path), and a tier's copy of the first cut would
    # make the recomputed run differ from the one this compares with.
    tight = _engine(reference, torch.bfloat16, kv_cache_tokens=96, max_num_batched_tokens=16, cache_ram_mb=0,
                    **_attention(kernel))
    together, _ = _run(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    assert together == alone
    assert (long_decodes[0] > 0) == bool(long_decode_chunk)


def test_prefill_progress_outputs_are_opt_in():
    engine = _engine(_tiny_llama(), torch.float32)  # 8 tokens per step: a 29-token prompt takes four
    prompt = list(range(1, 30))
    params = SamplingParams(temperature=0.0, max_tokens=3)
    engine.add_request("watched", prompt, params, report_progress=True)
    engine.add_request("plain", list(range(100, 105)), params)
    seen = {"watched": [], "plain": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    engine.check_invariants()
    first_token = next(i for i, out in enumerate(seen["watched"]) if out.new_token_ids)
    progress = [out.num_computed_prompt_tokens for out in seen["watched"][:first_token]]
    assert len(progress) >= 2 and progress == sorted(set(progress)) and progress[-1] < len(prompt)
    assert all(out.num_computed_prompt_tokens is None for out in seen["watched"][first_token:])
    assert all(out.new_token_ids and out.num_computed_prompt_tokens is None for out in seen["plain"])


def test_progress_and_abort_outputs_split_the_cached_tokens_as_the_others_do():
    engine = _engine(_tiny_llama(), torch.float32)  # 8 tokens per step, blocks of 4
    prompt = list(range(1, 30))
    params = SamplingParams(temperature=0.0, max_tokens=3)
    _run(engine, [prompt], [params])  # its 7 full blocks stay in the prefix cache
    engine.add_request("again", prompt + list(range(60, 80)), params, report_progress=True)
    progress = engine.step()  # 28 cached tokens, 8 of the other 20 computed: no token yet
    aborted = engine.abort(["again"])
    engine.check_invariants()
    assert [out.new_token_ids for out in progress] == [[]] and len(aborted) == 1
    for out in progress + aborted:
        assert out.num_cached_tokens == 28 and out.cached_tokens_by_tier == {"device": 28}


def test_counters_add_up_and_reset():
    engine = _engine(_tiny_llama(), torch.float32)
    prompt = list(range(1, 30))
    params = SamplingParams(temperature=0.0, max_tokens=3)
    _run(engine, [prompt, list(range(100, 105))], [params, params])
    stats = engine.stats()
    assert (stats.admitted_prompt_tokens, stats.cached_prompt_tokens) == (34, 0)
    assert stats.prompt_tokens == 34 and stats.generation_tokens == 6
    assert stats.num_steps > 0 and stats.prefill_seconds > 0 and stats.decode_seconds > 0
    _run(engine, [prompt], [params])  # the same prompt again: its full blocks come from the prefix cache
    again = engine.stats()
    assert again.admitted_prompt_tokens == 34 + 29
    assert again.cached_prompt_tokens == again.prefix_cache_hits - stats.prefix_cache_hits == 28
    assert again.prompt_tokens == 34 + 1
    engine.reset_counters()
    reset = engine.stats()
    assert (reset.num_steps, reset.generation_tokens, reset.prefix_cache_queries, reset.prefill_seconds) == (0, 0, 0, 0)


def test_the_engine_seed_is_the_seed_of_sampled_requests_that_bring_none():
    """EngineConfig.seed (`--seed`) seeds every sampled request without a seed of its own; without
    it each such request draws a fresh seed, kept on the request; greedy requests get none."""
    reference = _tiny_llama()
    sampled = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    fixed = _engine(reference, torch.float32, seed=5)
    first, _ = _run(fixed, [[1, 2, 3], [1, 2, 3]], [sampled, sampled])
    own, _ = _run(fixed, [[1, 2, 3]], [SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, seed=5)])
    assert first[0] == first[1] == own[0]

    fresh = _engine(reference, torch.float32)
    fresh.add_request("a", [1, 2, 3], sampled)
    fresh.add_request("b", [1, 2, 3], sampled)
    fresh.add_request("greedy", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0))
    seeds = {request_id: fresh.scheduler.requests[request_id].sampling_params.seed for request_id in ("a", "b", "greedy")}
    assert isinstance(seeds["a"], int) and isinstance(seeds["b"], int) and seeds["a"] != seeds["b"]
    assert seeds["greedy"] is None
    fresh.abort(["a", "b", "greedy"])
    fresh.check_invariants()
