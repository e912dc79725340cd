"""Qwen3-MoE: the Qwen3 decoder (q/k norms) whose MLPs are mixtures of experts.

A sparse layer routes each token to its top-k experts (softmax over the router's logits in float32,
renormalised over the chosen k when norm_topk_prob), runs every expert once over all the tokens it
was given (tokens sorted by expert: one matmul per expert that has any, never a loop over tokens),
and sums the k outputs weighted by the router. Layers in mlp_only_layers, or off the
decoder_sparse_step, are dense. A config with shared_expert_intermediate_size adds an expert every
token runs, scaled by a sigmoid gate (Qwen2-MoE's shape).

Each expert is a GatedMLP of its own, so it takes the engine's weight formats and row plans like
any linear layer; the router stays in float (bfloat16 on the CPU), never block-quantized, so
quantization never changes which experts a token runs. Checkpoints store experts one by one (`experts.E.gate_proj.weight`) or stacked
into 3-D tensors (`experts.gate_up_proj`, `experts.down_proj`, transformers' in-memory names; or
`experts.gate_proj` and `experts.up_proj` apart, as GGUF files store them): stacked ones are
split here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ember.config import ModelConfig
from ember.errors import ModelLoadError
from ember.models import llama, qwen3
from ember.models.layers import GatedMLP, Linear


@dataclass(frozen=True, slots=True)
class MoeSettings:
    num_experts: int
    experts_per_token: int
    expert_size: int  # each expert's intermediate size
    normalize_top_k: bool
    sparse_step: int
    dense_layers: frozenset[int]
    shared_expert_size: int  # 0: no shared expert

    @classmethod
    def from_config(cls, config: ModelConfig) -> "MoeSettings":
        hf = config.hf
        try:
            settings = cls(
                num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
                experts_per_token=int(hf["num_experts_per_tok"]),
                expert_size=int(hf["moe_intermediate_size"]),
                normalize_top_k=bool(hf.get("norm_topk_prob", False)),
                sparse_step=int(hf.get("decoder_sparse_step") or 1),
                dense_layers=frozenset(hf.get("mlp_only_layers") or ()),
                shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0))
        except KeyError as missing:
            raise ModelLoadError(f"the model's config lacks the field {missing}") from None
        if not 0 < settings.experts_per_token <= max(settings.num_experts, 1):
            raise ModelLoadError(f"num_experts_per_tok ({settings.experts_per_token}) must be between 1 "
                                 f"and num_experts ({settings.num_experts})")
        return settings

    def is_sparse(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.dense_layers
                and (layer_idx + 1) % self.sparse_step == 0)


class SparseMoe(nn.Module):
    """Checkpoint names: gate (the router), experts.E, and shared_expert, shared_expert_gate."""

    def __init__(self, hidden_size: int, settings: MoeSettings) -> None:
        super().__init__()
        self.top_k, self.normalize = settings.experts_per_token, settings.normalize_top_k
        self.gate = Linear(hidden_size, settings.num_experts)
        self.gate.keep_float = True
        self.experts = nn.ModuleList(GatedMLP(hidden_size, settings.expert_size)
                                     for _ in range(settings.num_experts))
        if settings.shared_expert_size:
            self.shared_expert = GatedMLP(hidden_size, settings.shared_expert_size)
            self.shared_expert_gate = Linear(hidden_size, 1)
        else:
            self.shared_expert = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden) -> each token's expert ids (T, k) and their weights (T, k) in x's dtype."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, top_k = x.shape[0], self.top_k
        expert_ids, weights = self.route(x)
        # (T * k,) token-expert pairs, sorted by expert so each expert's rows are one slice
        order = expert_ids.flatten().argsort(stable=True)
        counts = torch.bincount(expert_ids.flatten(), minlength=len(self.experts)).tolist()
        rows = x[order // top_k]  # (T * k, hidden)
        outputs = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs[start:start + count] = expert(rows[start:start + count])
                start += count
        per_choice = torch.empty_like(outputs)
        per_choice[order] = outputs  # back to (token, choice) order
        # a token's k outputs are summed in its own choice order: the batch never changes the sum
        out = (per_choice.view(tokens, top_k, -1) * weights[..., None]).sum(dim=1)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def moe_or_dense_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    settings = MoeSettings.from_config(config)
    if settings.is_sparse(layer_idx):
        return SparseMoe(config.hidden_size, settings)
    return llama.dense_mlp(config, layer_idx)


def split_stacked_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """3-D expert tensors (experts, out, in) -> one (out, in) tensor per expert, under its own name."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".experts.")
        leaf = leaf.removesuffix(".weight")  # GGUF's stacked names end in .weight, transformers' do not
        if not prefix or leaf not in ("gate_up_proj", "gate_proj", "up_proj", "down_proj"):
            yield name, tensor
            continue
        if tensor.dim() != 3:
            raise ModelLoadError(f"the checkpoint's stacked expert tensor {name} has shape "
                                 f"{tuple(tensor.shape)}, not (experts, out, in)")
        for expert, matrix in enumerate(tensor.unbind(0)):
            base = f"{prefix}.experts.{expert}"
            if leaf == "gate_up_proj":  # gate rows first, then up, as transformers stacks them
                gate, up = matrix.chunk(2, dim=0)
                yield f"{base}.gate_proj.weight", gate
                yield f"{base}.up_proj.weight", up
            else:
                yield f"{base}.{leaf}.weight", matrix


class Model(qwen3.Model):
    mlp_builder = staticmethod(moe_or_dense_mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_stacked_experts(weights))

