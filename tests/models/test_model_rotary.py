"""The precomputed rotary table against transformers' rotary embedding, every position."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ember.config import ModelConfig
from ember.errors import ModelLoadError
from ember.models.layers import RotaryEmbedding, apply_rotary

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "llama3_no_original": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 2048, "truncate": False},
}


def hf_config(scaling, head_dim=128, theta=1000000.0, max_positions=4096) -> LlamaConfig:
    return LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                       max_position_embeddings=max_positions, rope_theta=theta,
                       rope_scaling=dict(scaling) if scaling else None)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rotary_table_matches_transformers(name):
    hf = hf_config(SCALINGS[name])
    config = ModelConfig.from_hf(hf.to_dict())
    ours = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                           config.rope_scaling)
    positions = torch.arange(config.max_position_embeddings)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = ours(positions, torch.float32)  # (P, 1, D/2)
    half = config.head_dim // 2
    assert torch.equal(cos[:, 0], ref_cos[0, :, :half]) and torch.equal(cos[:, 0], ref_cos[0, :, half:])
    assert torch.equal(sin[:, 0], ref_sin[0, :, :half]) and torch.equal(sin[:, 0], ref_sin[0, :, half:])

    q, k = torch.randn(2, 1, 3, 5, config.head_dim).unbind(0)  # (1, heads, T, D) as transformers
    idx = torch.tensor([0, 3, 700, 2047, 4095])
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos[:, idx], ref_sin[:, idx])
    ours_q = apply_rotary(q[0].transpose(0, 1), cos[idx], sin[idx]).transpose(0, 1)
    ours_k = apply_rotary(k[0].transpose(0, 1), cos[idx], sin[idx]).transpose(0, 1)
    assert torch.equal(ours_q, ref_q[0]) and torch.equal(ours_k, ref_k[0])


def test_yarn_attention_factor_scales_cos_and_sin():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rotary = RotaryEmbedding(16, 256, 10000.0, scaling)
    cos, sin = rotary(torch.arange(256), torch.float32)
    radius = (cos ** 2 + sin ** 2).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, 0.1 * torch.tensor(4.0).log().item() + 1))


def test_yarn_table_covers_the_extended_context():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert RotaryEmbedding(16, 1024, 10000.0, scaling).max_positions == 4096
    assert RotaryEmbedding(16, 1024, 10000.0, None).max_positions == 1024


def test_unsupported_rope_type_is_a_load_error():
    with pytest.raises(ModelLoadError, match="longrope"):
        RotaryEmbedding(16, 256, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("max_positions", [4096, 16384])
def test_longrope_takes_short_factors_within_the_original_context_and_long_ones_past_it(max_positions):
    """Phi-3's table against transformers' LongRoPE at a length of the same side of the original 4096."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + i / 32 for i in range(32)],
               "long_factor": [1.0 + i / 4 for i in range(32)]}
    hf = Phi3Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=max_positions,
                    original_max_position_embeddings=4096, rope_scaling=scaling, pad_token_id=0)
    config = ModelConfig.from_hf(hf.to_dict())
    ours = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                           config.rope_scaling)
    positions = torch.arange(max_positions)
    # transformers picks by the forward's length: the whole table's length is on the same side
    ref_cos, ref_sin = Phi3RotaryEmbedding(hf)(torch.zeros(1), positions[None])
    cos, sin = ours(positions, torch.float32)
    torch.testing.assert_close(cos[:, 0], ref_cos[0, :, :32], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], ref_sin[0, :, :32], rtol=0, atol=1e-6)


def test_table_stays_float32_under_a_bfloat16_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        rotary = RotaryEmbedding(16, 64, 10000.0)
    finally:
        torch.set_default_dtype(previous)
    assert rotary.cos_sin.dtype == torch.float32
    cos, _ = rotary(torch.arange(3), torch.bfloat16)
    assert cos.dtype == torch.bfloat16


def test_rope_scaling_missing_a_field_is_a_load_error():
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        RotaryEmbedding(16, 256, 10000.0, {"rope_type": "llama3", "factor": 8.0})
