"""Each newer architecture at a tiny random config, through the whole paged engine: greedy tokens and
log probabilities equal transformers' in float32 with prompts batched together, cut into chunks
and served partly from the prefix cache, on ember's attention kernel and on the torch paths."""

from __future__ import annotations

import pytest
import torch
import transformers

from ember import SamplingParams
from ember.config import EngineConfig, ModelConfig
from ember.engine.core import EngineCore
from ember.engine.loading import build_model

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, head_dim=16)

# name -> (transformers config class, causal LM class, config overrides)
ARCHITECTURES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1])),
    # LongRoPE past its original context (every sequence here is longer than 4), partial rotary
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=None, pad_token_id=0, original_max_position_embeddings=4, partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5],
                      "long_factor": [1.0, 3.0, 5.0, 7.0]})),
    # every layer local, a window of 8: prompts and decodes run far past it
    "mistral_sliding_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # local layers (window 8) around a global one, soft-capped logits, scaled queries
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=32, final_logit_softcapping=5.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # windows of 12 on layers 1 and 2 only, layer 0 global
    "qwen2_sliding_layers": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=12, max_window_layers=1)),
}

# How rows attend: ember's attention kernel (blocks of 16 slots) or the torch paths (blocks of 4).
ATTENTION = {"attention-kernel": dict(cpu_kernels=True, block_size=16),
             "torch-attention": dict(cpu_kernels=False, block_size=4)}


def reference_model(case: str) -> torch.nn.Module:
    config_cls, model_cls, overrides = ARCHITECTURES[case]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) activations, so every weight moves the logits
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if "norm" in name else noise * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.2))
    return model


def paged_engine(reference: torch.nn.Module, **overrides) -> EngineCore:
    model_config = ModelConfig.from_hf(reference.config.to_dict())
    model_config.eos_token_ids = []
    model = build_model(model_config, torch.float32, torch.device("cpu"))
    model.load_weights(reference.state_dict().items())
    settings = dict(max_num_batched_tokens=8, max_num_seqs=8, kv_cache_tokens=1024, dtype="float32")
    settings.update(overrides)
    return EngineCore(model, model_config, EngineConfig(**settings), set(), torch.device("cpu"), torch.float32)


def run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list, int]]:
    """(tokens, logprobs, cached prompt tokens) per prompt, all scheduled together."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    results = {str(i): ([], [], 0) for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs, _ = results[out.request_id]
            results[out.request_id] = (tokens + out.new_token_ids, logprobs + (out.logprobs or []),
                                       out.num_cached_tokens)
    engine.check_invariants()
    return [results[str(i)] for i in range(len(prompts))]


def assert_matches_reference(reference, prompt: list[int], tokens: list[int], logprobs: list) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    for step, (token, lp) in enumerate(zip(tokens, logprobs)):
        expected = ref[len(prompt) - 1 + step]
        assert token == int(expected.argmax()), f"step {step}"
        assert lp.logprob == pytest.approx(float(expected[token]), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_batched_chunked_and_prefix_cached_requests_match_transformers(case, attention):
    reference = reference_model(case)
    engine = paged_engine(reference, **ATTENTION[attention])
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (37, 6, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    for prompt, (tokens, logprobs, cached) in zip(prompts, run(engine, prompts, params)):
        assert cached == 0
        assert_matches_reference(reference, prompt, tokens, logprobs)
    # the first prompt's full blocks come from the prefix cache now, beside a fresh prompt
    sharing = prompts[0][:33] + torch.randint(0, 256, (5,), generator=gen).tolist()
    fresh = torch.randint(0, 256, (12,), generator=gen).tolist()
    (tokens, logprobs, cached), (fresh_tokens, fresh_logprobs, _) = run(engine, [sharing, fresh], params)
    assert cached >= 32
    assert_matches_reference(reference, sharing, tokens, logprobs)
    assert_matches_reference(reference, fresh, fresh_tokens, fresh_logprobs)


def test_a_local_only_model_holds_a_bounded_number_of_blocks_and_still_matches_transformers():
    """Mistral with a window of 8 (every layer local), blocks of 4: a 60-token prompt and 30 decoded
    tokens never hold more than the window's blocks plus the step's own, and the prompt sent again
    is served from released blocks still in the prefix cache, with the same results."""
    reference = reference_model("mistral_sliding_window")
    engine = paged_engine(reference, **ATTENTION["torch-attention"])
    assert engine.scheduler.config.release_window == 8
    prompt = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1)
    engine.add_request("long", prompt, params)
    tokens, logprobs, most_used = [], [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
        most_used = max(most_used, engine.kv_manager.num_used_blocks)
    engine.check_invariants()
    # the window's 8 keys span at most 3 blocks of 4, a step adds at most 8 tokens: 2 blocks more
    assert most_used <= 5
    assert_matches_reference(reference, prompt, tokens, logprobs)
    [(again, again_logprobs, cached)] = run(engine, [prompt], params)
    assert cached >= 32 and again == tokens
    assert [lp.logprob for lp in again_logprobs] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-5)
