"""What the loaded weights take: their bytes in memory, their count as the checkpoint counts them,
the formats the linear layers run in, and a mixture-of-experts model's routing. For /health and
the model card (bits per weight = bytes * 8 / count)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ember.config import ModelConfig
from ember.models.layers import Embedding, Linear


@dataclass(slots=True)
class WeightFootprint:
    num_bytes: int = 0  # each storage once (a tied table and head share theirs)
    num_weights: int = 0  # every matrix entry and vector element, whatever format holds it
    formats: dict[str, int] = field(default_factory=dict)  # linear layers per weight format


def weight_footprint(model: torch.nn.Module) -> WeightFootprint:
    """This process's share of the weights (a tensor-parallel rank holds its shard)."""
    footprint = WeightFootprint()
    storages: dict[Any, int] = {}
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        if isinstance(module, (Linear, Embedding)):
            footprint.num_weights += module.in_features * module.out_features
            footprint.num_weights += module.bias.numel() if module.bias is not None else 0
            name = module.weights.name
            footprint.formats[name] = footprint.formats.get(name, 0) + 1
            tensors += _tensors_of(module.weights)
        else:
            footprint.num_weights += sum(t.numel() for t in tensors)
        for tensor in tensors:
            if tensor.numel():
                storages[_storage_key(tensor)] = tensor.numel() * tensor.element_size()
    footprint.num_bytes = sum(storages.values())
    return footprint


def routed_experts(config: ModelConfig) -> dict[str, int] | None:
    """A mixture-of-experts model's experts and how many each token runs through; None when dense."""
    hf = config.hf
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not experts or not hf.get("num_experts_per_tok"):
        return None
    return {"num_experts": int(experts), "experts_per_token": int(hf["num_experts_per_tok"])}


def _tensors_of(weights: Any) -> list[torch.Tensor]:
    """A weights object's tensors, those of its parts (a stacked layer's) included."""
    found = []
    for value in _attributes(weights):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list):
            found += [tensor for part in value for tensor in _tensors_of(part)]
    return found


def _attributes(obj: Any) -> list[Any]:
    names = getattr(obj, "__dict__", None) or {name: getattr(obj, name, None) for name in getattr(obj, "__slots__", ())}
    return list(names.values())


def _storage_key(tensor: torch.Tensor) -> Any:
    try:
        return tensor.untyped_storage().data_ptr(), tensor.storage_offset()
    except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN's packed weights) have no storage
        return id(tensor)
