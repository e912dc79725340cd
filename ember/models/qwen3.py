"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on q and k before rotary, no qkv bias
unless attention_bias, and an explicit head_dim that may differ from hidden_size / heads."""

from __future__ import annotations

import torch

from ember.config import ModelConfig
from ember.models import llama
from ember.models.layers import RMSNorm


class Attention(llama.Attention):
    qk_norm = True

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x)  # (T, heads, head_dim): the norm is over each head
        return self.q_norm(q), self.k_norm(k), v


class Model(llama.Model):
    attention_class = Attention
