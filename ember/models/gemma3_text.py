"""Gemma 3 (text): local and global attention layers interleaved, each with its own rotary base.

What differs from the Llama decoder:
- RMSNorm scales by (1 + weight), in float32, and casts afterwards; four norms per layer: before
  and after attention, before and after the MLP (the "post" norms apply before the residual sum);
- embeddings are multiplied by sqrt(hidden_size), rounded to the weights' dtype;
- q and k get a per-head RMSNorm before rotary; attention scales by query_pre_attn_scalar ** -0.5
  (folded into q: the attention backends scale by head_dim ** -0.5);
- local layers (sliding_attention in layer_types, windows in ModelConfig.layer_windows) rotate with
  rope_local_base_freq, global layers with rope_theta and the config's rope scaling;
- the MLP's activation is tanh-approximated GELU; the LM head is the embedding table (tied);
- final_logit_softcapping, when set, squashes the logits: cap * tanh(logits / cap).
A config with attn_logit_softcapping (Gemma 2) is refused: ember's attention kernels do not cap scores.
Multimodal checkpoints (model_type gemma3) are models.gemma3: this decoder with a vision tower.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelConfig
from ember.errors import ModelLoadError
from ember.models.layer_stack import GemmaLayerStack, decided_stack
from ember.models.layers import (Embedding, Linear, MergedLinear, QKVLinear, RotaryEmbedding, apply_rotary,
                                 linear, load_checkpoint, replace_rows)

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class GemmaRMSNorm(nn.Module):
    """`fused`: one call of ember's CPU kernel instead of nine torch ops (use_fused_ops)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps
        self.fused = False
        self._scale: torch.Tensor | None = None  # 1 + weight in float32, made at the first fused call

    def scale(self) -> torch.Tensor:
        """1 + weight in float32 (fused ops come once the weights are loaded: they stay as they are)."""
        if self._scale is None:
            self._scale = 1.0 + self.weight.float()
        return self._scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.ember.scaled_rms_norm(x, self.scale(), self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def rope_settings(config: ModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """layer kind -> (rotary base, scaling): from transformers' per-kind rope_parameters, or from
    config.json's rope_theta, rope_scaling and rope_local_base_freq."""
    hf = config.hf
    per_kind = hf.get("rope_parameters")
    if isinstance(per_kind, dict) and "full_attention" in per_kind:
        settings = {}
        for kind in ("full_attention", "sliding_attention"):
            params = dict(per_kind.get(kind) or per_kind["full_attention"])
            theta = float(params.pop("rope_theta", 10000.0))
            settings[kind] = (theta, None if params.get("rope_type", "default") == "default" else params)
        return settings
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return {"full_attention": (float(hf.get("rope_theta") or 1000000.0), scaling),
            "sliding_attention": (float(hf.get("rope_local_base_freq") or 10000.0), None)}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVLinear(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                  config.head_dim, config.attention_bias)
        self.o_proj = Linear(config.num_attention_heads * config.head_dim, config.hidden_size, config.attention_bias)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        scalar = float(config.hf.get("query_pre_attn_scalar") or config.head_dim)
        self.q_scale = (config.head_dim / scalar) ** 0.5  # times the backends' head_dim ** -0.5
        self.fused = False  # rotary embeddings in place by ember's CPU kernel (use_fused_ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(x)  # (T, heads, head_dim)
        q = apply_rotary(self.q_norm(q), cos, sin, self.fused)  # a fused norm's output is new: rotated in place
        k = apply_rotary(self.k_norm(k), cos, sin, self.fused)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = attn.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(out.shape[0], -1))


class GeluMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GeluMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        settings = rope_settings(config)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta,
                                                           scaling) for kind, (theta, scaling) in settings.items()})
        windows = config.layer_windows or [None] * config.num_hidden_layers
        self.layer_kinds = ["sliding_attention" if w else "full_attention" for w in windows]
        self.fused = False  # the layers may run as one kernel call (use_fused_ops, _layer_stack)
        self._stack: GemmaLayerStack | bool | None = None  # None: not decided yet

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """embeds: (rows, values) that replace those rows' scaled token embeddings (layers.replace_rows)."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        x = replace_rows(x * torch.tensor(self.embed_scale, dtype=x.dtype), embeds)
        tables = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        stack = self._layer_stack()
        stacked = stack.run(x, [tables[kind] for kind in self.layer_kinds], attn) if stack is not None else None
        if stacked is not None:
            return self.norm(stacked)
        for layer, kind in zip(self.layers, self.layer_kinds):
            x = layer(x, *tables[kind], attn)
        return self.norm(x)

    def _layer_stack(self) -> GemmaLayerStack | None:
        return decided_stack(self, GemmaLayerStack, DecoderLayer, Attention, GeluMLP)


class Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hf.get("attn_logit_softcapping"):
            raise ModelLoadError("attn_logit_softcapping is not supported: ember's attention does not cap "
                                 "scores (Gemma 3 leaves it off)")
        self.config = config
        self.model = Decoder(config)
        self.lm_head = (self.model.embed_tokens if config.tie_word_embeddings or "tie_word_embeddings" not in config.hf
                        else Linear(config.hidden_size, config.vocab_size))
        self.softcap = config.hf.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head.weights, self.lm_head.rows).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.weight",) if self.lm_head is self.model.embed_tokens else ()
        load_checkpoint(self, weights, FUSED, skip)
