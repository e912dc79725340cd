"""Tiny random transformers models and their ember twins, loaded with the same weights."""

from __future__ import annotations

import torch
import transformers

from ember import kernels
from ember.config import ModelConfig
from ember.models import get_model_class
from ember.models.layers import use_fused_ops

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)

# name -> (transformers config class, causal LM class, config overrides)
CASES = {
    "llama_llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=10000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 64})),
    "llama_tied_bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, attention_bias=True, rope_theta=500000.0)),
    "mistral_head_dim": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32, sliding_window=None)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3_qk_norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=24, rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                   "original_max_position_embeddings": 128})),
    "phi3_fused": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # LongRoPE past its original context (8: every test sequence is longer), where transformers picks
    # the long factors, as ember does at every length for a model built past that context
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=8,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                      "long_factor": [1.0 + i for i in range(8)], "factor": 2.0})),
    # Phi-4-mini's shape: rotary embeddings on the first 3/4 of each head
    "phi3_partial_rotary": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.75,
        tie_word_embeddings=True)),
    # local layers (window 16, the prompts run past it) around one global layer, their own rotary
    # bases, query_pre_attn_scalar unlike head_dim, logits soft-capped
    "gemma3_local_global": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # 8 experts, 2 per token, renormalised; layer 1 dense
    "qwen3_moe_top2": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1])),
    # 4 of 6 experts, weights as the softmax gives them; every second layer sparse
    "qwen3_moe_unnormalized": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=4,
        norm_topk_prob=False, decoder_sparse_step=2)),
}

LARGEST_ERRORS: dict[str, float] = {}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights with O(1) activations (transformers' init leaves logits near zero), random norm
    scales and biases, so every loaded tensor matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)


def build_pair(case: str, dtype: torch.dtype = torch.float32, fused: bool = False):
    """(transformers model in float32, ember model in `dtype`, ember config), same weights.
    fused: norms, rotary embeddings and the MLP activation through ember's CPU kernels."""
    config_cls, model_cls, overrides = CASES[case]
    hf_config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_cls)(hf_config).float().eval()
    randomize_(hf_model)
    config = ModelConfig.from_hf(hf_config.to_dict())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the engine builds it: the default dtype, then the weights
    try:
        model = get_model_class(config.model_type)(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(hf_model.state_dict().items())
    if fused:
        assert kernels.available(), kernels.status()
        use_fused_ops(model)
    return hf_model, model, config


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, label: str, tol: float = 1e-4) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    scale = ref.abs().max().item()
    error = (ours - ref).abs().max().item() / scale
    LARGEST_ERRORS[label] = max(error, LARGEST_ERRORS.get(label, 0.0))
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol * scale)
