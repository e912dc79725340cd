"""Qwen2 / Qwen2.5: the Llama decoder with a bias on q, k and v (never on o), as transformers has it.

A sliding window (use_sliding_window, on the layers from max_window_layers on) is read into
ModelConfig.layer_windows; released Qwen2 checkpoints leave it off.
"""

from __future__ import annotations

from ember.config import ModelConfig
from ember.models import llama


class Attention(llama.Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, qkv_bias=True, o_bias=False)


class Model(llama.Model):
    attention_class = Attention
