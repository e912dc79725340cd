"""Tensor-parallel shards: which part of every weight a rank holds, and the cuts that give it.

Attention is split by KV group: a rank holds whole KV heads with their query heads, unevenly where
the counts do not divide (9 query heads and 3 KV heads over 2 ranks: 6 + 3 query heads, 2 + 1 KV
heads). With more ranks than KV heads, each KV head is replicated on the ranks that share its
query heads. The MLP's gate and up projections are split by output rows and its down projection
by input columns (row-parallel), at multiples of 32 where the size allows, so block-quantized
layers keep whole blocks. The embedding and the LM head are split by vocabulary.

A rank's model is the architecture built at its local sizes (`local_config`); the checkpoint's
tensors are cut to those sizes as they are read (`cut_for`, `cut_tensor`). Its layers where the
ranks meet (models.layers: RowParallelLinear, VocabParallelEmbedding, and the LM head's logits)
run their collectives through a `TensorParallel` they are given: models import no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from ember.config import ModelConfig
from ember.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

# Architectures whose every weight has a rule below (dense Llama-style decoders).
SHARDABLE = ("llama", "mistral", "qwen2", "qwen3")
_ALIGN = 32  # models.weights.QBLOCK: a row-parallel cut through a quantized layer falls between blocks


@dataclass(frozen=True, slots=True)
class Cut:
    """A slice [start, stop) along one dimension of a tensor."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What rank `rank` of `world` holds: query heads [q_start, q_stop), KV heads
    [kv_start, kv_stop), MLP channels [mlp_start, mlp_stop), vocabulary rows [vocab_start, vocab_stop)."""

    rank: int
    world: int
    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    mlp_start: int
    mlp_stop: int
    vocab_start: int
    vocab_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


class TensorParallel(Protocol):
    """What a rank's shard asks of its group (engine.parallel.TensorGroup gives it)."""

    plan: ShardPlan  # this rank's

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """The sum over ranks, in place."""

    def sum_over_ranks(self, sums: torch.Tensor, add_partial: Callable[[], None], in_order: bool) -> None:
        """Every rank's partial products summed into `sums` (zeros, float32) on every rank;
        `add_partial()` adds this rank's into `sums`. In order: rank after rank, each continuing
        the sums the rank before it left (ranks hold consecutive slices of the input dimension),
        so block-quantized layers give one rank's bits; else summed at once (an all-reduce)."""

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """(N, this rank's vocabulary rows) -> (N, vocab) on rank 0, None on the others."""


def split(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of each of `parts` near-equal pieces of range(total), the larger ones first;
    in units of `align` when `total` is a multiple of it."""
    unit = align if total % align == 0 and total // align >= parts else 1
    units = total // unit
    bounds, start = [], 0
    for i in range(parts):
        size = units // parts + (i < units % parts)
        bounds.append((start * unit, (start + size) * unit))
        start += size
    return bounds


def plan_shards(config: ModelConfig, world: int) -> list[ShardPlan]:
    """Every rank's shard; ModelLoadError when the model cannot be split over `world` ranks."""
    if config.model_type not in SHARDABLE:
        raise ModelLoadError(f"tensor parallelism supports the architectures {', '.join(SHARDABLE)}, "
                             f"not {config.model_type!r}", param="tensor_parallel_size")
    if config.num_labels:
        raise ModelLoadError("tensor parallelism splits an LM head by vocabulary and has no rule for a "
                             "classifier's score head: serve it on one rank", param="tensor_parallel_size")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if world > heads:
        raise ModelLoadError(f"tensor_parallel_size {world} is more than the model's {heads} attention heads",
                             param="tensor_parallel_size")
    group = heads // kv_heads  # query heads per KV head
    attention: list[tuple[int, int, int, int]] = []  # (q_start, q_stop, kv_start, kv_stop) per rank
    if world <= kv_heads:
        for kv_start, kv_stop in split(kv_heads, world):
            attention.append((kv_start * group, kv_stop * group, kv_start, kv_stop))
    else:  # replicate: KV head k on the ranks that split its query heads among them
        for kv, (first, last) in enumerate(split(world, kv_heads)):
            for q_start, q_stop in split(group, last - first):
                attention.append((kv * group + q_start, kv * group + q_stop, kv, kv + 1))
    mlp = split(config.intermediate_size, world, _ALIGN)
    vocab = split(config.vocab_size, world)
    return [ShardPlan(rank, world, *attention[rank], *mlp[rank], *vocab[rank]) for rank in range(world)]


def local_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config a rank builds its model from: its heads, MLP channels and vocabulary rows."""
    return replace(config, num_attention_heads=plan.num_heads, num_key_value_heads=plan.num_kv_heads,
                   intermediate_size=plan.mlp_stop - plan.mlp_start, vocab_size=plan.vocab_stop - plan.vocab_start)


def cut_for(name: str, config: ModelConfig, plan: ShardPlan) -> Cut | None:
    """The slice of checkpoint tensor `name` (Hugging Face naming) that the rank holds; None: all of it
    (norms, a row-parallel layer's bias, added once to the sum over ranks)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Cut(0, plan.vocab_start, plan.vocab_stop)
    d = config.head_dim
    parts = name.rsplit(".", 2)
    if len(parts) < 3:
        return None
    layer, kind = parts[1], parts[2]
    if layer == "q_proj":
        return Cut(0, plan.q_start * d, plan.q_stop * d)
    if layer in ("k_proj", "v_proj"):
        return Cut(0, plan.kv_start * d, plan.kv_stop * d)
    if layer in ("gate_proj", "up_proj"):
        return Cut(0, plan.mlp_start, plan.mlp_stop)
    if kind != "weight":
        return None
    if layer == "o_proj":
        return Cut(1, plan.q_start * d, plan.q_stop * d)
    if layer == "down_proj":
        return Cut(1, plan.mlp_start, plan.mlp_stop)
    return None


def cut_tensor(name: str, tensor, cut: Cut | None):
    """A float tensor or QuantBlocks (models.weights) cut to the rank's slice. Rows of blocks cut
    freely; their input columns only between blocks of 32 (else ModelLoadError)."""
    if cut is None:
        return tensor
    from ember.models.weights import QBLOCK, QuantBlocks

    if not isinstance(tensor, QuantBlocks):
        return tensor.narrow(cut.dim, cut.start, cut.stop - cut.start)
    if cut.dim == 0:
        return tensor.select_rows(slice(cut.start, cut.stop))
    if cut.start % QBLOCK or cut.stop % QBLOCK:
        raise ModelLoadError(f"{name} is block-quantized and its tensor-parallel slice [{cut.start}, {cut.stop}) "
                             f"cuts through a block of {QBLOCK}; serve it with --quantization none",
                             param="tensor_parallel_size")
    return tensor.narrow_blocks(cut.start // QBLOCK, cut.stop // QBLOCK)


def comm_bytes_per_token(config: ModelConfig, element_bytes: int) -> dict[str, int]:
    """Bytes per token and step, from the shapes (for the docs and the log): the sums over ranks
    of hidden_size values, two per layer (float32 partial sums) plus the embedding's lookup (in
    the model's dtype, `element_bytes`), and one vocabulary row of float32 logits gathered on
    rank 0 per sampled token."""
    hidden = config.hidden_size
    return {"sums": 2 * config.num_hidden_layers * hidden * 4 + hidden * element_bytes,
            "logits_gather": config.vocab_size * 4}
