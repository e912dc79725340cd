"""Building a model from its source: the device and dtype, the architecture's module, its weights
in the formats the CPU kernels take, and the end-of-sequence tokens the model and its files name."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

import torch

from ember import kernels
from ember.config import EngineConfig, ModelConfig
from ember.engine.host_memory import move_to_huge_pages
from ember.errors import InvalidRequest
from ember.models import get_model_class
from ember.models.layers import block_weights, prepare_linears, use_fused_ops

logger = logging.getLogger("ember.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class BuiltModel:
    model: torch.nn.Module
    model_config: ModelConfig  # the whole model's (a tensor-parallel rank's module holds its shard of it)
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: set[int]


def load_model(source, config: EngineConfig, group=None) -> BuiltModel:
    """The model a loaders.ModelSource describes, built and loaded for `config`; with a
    tensor-parallel `group` (engine.parallel), this rank's shard of it."""
    device = resolve_device(config.device)
    if group is not None:
        device = group.device(device)
    dtype = resolve_dtype(config.dtype)
    if config.num_threads and device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    model_config = ModelConfig.from_hf(source.hf_config)
    if config.rope_scaling:
        model_config = model_config.with_rope_scaling(config.rope_scaling)
    model = build_model(group.local_config(model_config) if group is not None else model_config,
                        dtype, device, config.max_model_len)
    block_kernels = device.type == "cpu" and config.cpu_kernels and kernels.available()
    model.load_weights(source.weights(blocks=block_kernels and config.quantization != "none",
                                      cut=group.cut if group is not None else None))
    if group is not None:
        group.attach(model)
    formats = prepare_linears(model, config.quantization, block_kernels)
    if block_kernels:  # every step streams them all: on huge pages it streams faster
        move_to_huge_pages(block_weights(model), "packed")
    if block_kernels and dtype in (torch.bfloat16, torch.float32):
        use_fused_ops(model)
    logger.info("linear layers: %s", ", ".join(f"{count} {name}" for name, count in formats.items()))
    eos = set(model_config.eos_token_ids) | set(source.tokenizer.eos_token_ids)
    generation_eos = source.generation_config.get("eos_token_id")
    if generation_eos is not None:
        eos |= {generation_eos} if isinstance(generation_eos, int) else set(generation_eos)
    return BuiltModel(model, model_config, device, dtype, eos)


def build_model(model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_model_len: int | None = None) -> torch.nn.Module:
    """An empty model of the config's architecture, its parameters waiting for load_weights."""
    if max_model_len and max_model_len > model_config.max_position_embeddings:
        if model_config.rope_scaling:
            raise InvalidRequest(
                f"max_model_len {max_model_len} is beyond the model's trained length "
                f"{model_config.max_position_embeddings}, which ember extends only for plain rotary "
                f"embeddings, not for {model_config.rope_scaling.get('rope_type')} scaling", param="max_model_len")
        # Plain rotary embeddings are defined at every position: widen the table.
        model_config = replace(model_config, max_position_embeddings=max_model_len)
    with _default_dtype(dtype), device:
        return get_model_class(model_config.model_type)(model_config).eval()


def resolve_device(name: str) -> torch.device:
    """`auto` is the CPU: ember's CUDA path has not yet been run on a GPU by its tests, so a GPU is
    used only when named (`--device cuda`), and its presence is pointed out."""
    if name == "auto":
        if torch.cuda.is_available():
            logger.warning("a CUDA device is present, but ember's CUDA path is not yet checked on a GPU by its "
                           "tests: serving on the CPU (--device cuda chooses the GPU)")
        return torch.device("cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    # bfloat16 by default, on the CPU too: half of float32's memory traffic, and what the CPU kernels take.
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
