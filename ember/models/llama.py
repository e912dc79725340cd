"""Llama 2/3 and SmolLM2: the decoder the other architectures build on.

The model sees flattened tokens of many sequences (T,) and one attention call per layer;
the `attn` object owns the KV cache, the causal structure and GQA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ember.config import ModelConfig
from ember.models.layers import (GatedMLP, Linear, QKVLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                 VocabParallelEmbedding, apply_rotary, linear, load_checkpoint, replace_rows)
from ember.models.sharding import TensorParallel
from ember.models.layer_stack import LayerStack, decided_stack

# fused module -> the checkpoint's separate projections, in the fused order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# names that old checkpoints carry and that the model recomputes
HARMLESS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class Attention(nn.Module):
    qk_norm = False  # architectures that normalise q and k before rotary set this

    def __init__(self, config: ModelConfig, layer_idx: int, qkv_bias: bool | None = None,
                 o_bias: bool | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = config.attention_bias
        self.qkv_proj = QKVLinear(config.hidden_size, config.num_attention_heads,
                                  config.num_key_value_heads, config.head_dim,
                                  bias if qkv_bias is None else qkv_bias)
        # under tensor parallelism a rank holds whole KV groups (their heads' q, k and v rows) and
        # o_proj's columns for its heads: o_proj sums over ranks
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                        bias if o_bias is None else o_bias)
        self.fused = False  # rotary embeddings in place by ember's CPU kernel (use_fused_ops)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, hidden) -> q (T, heads, head_dim), k and v (T, kv_heads, head_dim), before rotary."""
        return self.qkv_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        if self.fused and not self.qk_norm and hasattr(attn, "rotate_and_store"):
            qkv = linear(x, self.qkv_proj.weights, self.qkv_proj.rows)  # (T, (heads + 2 kv_heads) head_dim)
            q = attn.rotate_and_store(self.layer_idx, qkv, cos, sin, self.num_heads, self.num_kv_heads)
            out = attn.attend(self.layer_idx, q)
        else:
            q, k, v = self.project(x)
            q, k = apply_rotary(q, cos, sin, self.fused), apply_rotary(k, cos, sin, self.fused)
            out = attn.attend(self.layer_idx, q, k, v)  # (T, heads, head_dim)
        return self.o_proj(out.reshape(out.shape[0], -1))


def dense_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last layer's output, still to be added to the residual stream (T, hidden);
        returns this layer's output and the stream so far (the sum happens in the next norm)."""
        residual, h = self.input_layernorm.add_and_norm(x, residual)
        residual, h = self.post_attention_layernorm.add_and_norm(self.self_attn(h, cos, sin, attn), residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    """Checkpoint prefix "model.": embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, attention_class: type[Attention],
                 mlp_builder: Callable[[ModelConfig, int], nn.Module] = dense_mlp,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention_class(config, i), mlp_builder(config, i))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(rotary_dim or config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.fused = False  # the layers may run as one kernel call (use_fused_ops, _layer_stack)
        self._stack: LayerStack | bool | None = None  # None: not decided yet

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """embeds: (rows, values) that replace those rows' token embeddings (layers.replace_rows)."""
        x = replace_rows(self.embed_tokens(input_ids), embeds)  # (T, hidden)
        cos, sin = self.rotary(positions, x.dtype)  # shared by every layer
        stack = self._layer_stack()
        stacked = stack.run(x, cos, sin, attn) if stack is not None else None
        if stacked is not None:
            x, residual = stacked
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, cos, sin, attn)
        return self.norm.add_and_norm(x, residual)[1]

    def _layer_stack(self) -> LayerStack | None:
        return decided_stack(self, LayerStack, DecoderLayer, Attention, GatedMLP)


class Model(nn.Module):
    """The engine's contract: forward -> final hidden states, compute_logits, load_weights."""

    attention_class: type[Attention] = Attention
    mlp_builder = staticmethod(dense_mlp)  # (config, layer index) -> that layer's MLP
    parallel: TensorParallel | None = None  # a tensor-parallel rank's group (use_tensor_parallel)

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        """How many dims of each head rotate (the first ones)."""
        return config.head_dim

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config, self.attention_class, self.mlp_builder, self.rotary_dim(config))
        if config.num_labels:  # a classifier: its score head (checkpoint "score.") is the model's head
            self.lm_head = Linear(config.hidden_size, config.num_labels)
            self.lm_head.keep_float = True  # a handful of rows, and rounding them would move every score
        else:
            self.lm_head = (self.model.embed_tokens if config.tie_word_embeddings
                            else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        """input_ids, positions: (T,) flattened over sequences -> (T, hidden) after the final norm."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) float32, (N, num_labels) for a classifier; the matmul runs in the
        weights' dtype. Under tensor
        parallelism each rank computes its vocabulary rows' logits, gathered on rank 0 (None on
        the others)."""
        logits = linear(hidden, self.lm_head.weights, self.lm_head.rows).float()
        return logits if self.parallel is None else self.parallel.gather_logits(logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names; a tied head ignores any lm_head.weight the checkpoint also has, and a
        classifier's score.weight loads into its head."""
        if self.config.num_labels:
            weights = (("lm_head.weight" if name == "score.weight" else name, tensor) for name, tensor in weights)
        tied = self.config.tie_word_embeddings and not self.config.num_labels
        load_checkpoint(self, weights, FUSED, HARMLESS + (("lm_head.weight",) if tied else ()))
