"""Phi-3 (and Phi-3.5, Phi-4-mini): the Llama decoder with q, k and v stored as one fused qkv_proj and
gate and up as one fused gate_up_proj in the checkpoint, LongRoPE scaling ("longrope", first
called "su") in its long-context variants, and rotary embeddings on part of each head where
partial_rotary_factor says so (Phi-4-mini).

ember runs those projections fused already, so the checkpoint's tensors load as they are. LongRoPE
picks its long or short factors once, from the length the model is built for (models.layers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ember.config import ModelConfig
from ember.models import llama
from ember.models.layers import apply_rotary, load_checkpoint


def rotary_dim(config: ModelConfig) -> int:
    factor = config.hf.get("partial_rotary_factor")
    if factor is None:
        factor = (config.hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return int(config.head_dim * float(factor))


class Attention(llama.Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.rotary_dim = rotary_dim(config)
        self.qk_norm = self.rotary_dim != config.head_dim  # keeps the fused full-head rotary kernel off

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        if self.rotary_dim == self.qkv_proj.head_dim:
            return super().forward(x, cos, sin, attn)
        q, k, v = self.project(x)  # (T, heads, head_dim): the first rotary_dim dims of a head rotate
        d = self.rotary_dim
        q = torch.cat((apply_rotary(q[..., :d], cos, sin), q[..., d:]), dim=-1)
        k = torch.cat((apply_rotary(k[..., :d], cos, sin), k[..., d:]), dim=-1)
        out = attn.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(out.shape[0], -1))


class Model(llama.Model):
    attention_class = Attention
    rotary_dim = staticmethod(rotary_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's qkv_proj and gate_up_proj are ember's fused layers as they are."""
        skip = llama.HARMLESS + (("lm_head.weight",) if self.config.tie_word_embeddings else ())
        load_checkpoint(self, weights, {}, skip)
