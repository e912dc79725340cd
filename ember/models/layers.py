"""Building blocks shared by the model files: norms, rotary embeddings, fused linears, the layers
where tensor-parallel ranks meet, weight loading.

Every op here is row-wise: a token's output never depends on the other tokens in the batch.
Parameters are created empty (the loader fills them) and without autograd.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import ModelLoadError
from ember.models.sharding import TensorParallel
from ember.models.weights import (QBLOCK, BlockWeights, DenseWeights, PackedBF16Weights, QuantBlocks,
                                  StackedBlockWeights)


@dataclass(frozen=True, slots=True)
class RowPlan:
    """How a linear layer cuts its input rows into matmul calls.

    A matmul kernel may pick its reduction order from the number of rows it is handed (oneDNN's
    bfloat16 kernel rounds a lone row differently from two on AMD Zen 4, and rows past 32
    differently on Intel with AMX; MKL's float32 kernel has classes of 1, 2-3 and 4 or more
    rows). A plan keeps every call inside one such class: calls are padded with zero rows up to
    `min_rows` and cut into tiles of at most `max_rows`. Rows never mix inside a matmul, so a
    row's bits then depend on its own values alone. The engine's self-check picks the plan on
    the CPU it runs on (see engine.invariance).
    """

    min_rows: int = 1
    max_rows: int | None = None

    def describe(self) -> str:
        parts = [f"calls padded to {self.min_rows} rows"] if self.min_rows > 1 else []
        if self.max_rows is not None:
            parts.append(f"tiles of at most {self.max_rows} rows")
        return ", ".join(parts) or "whole batches"


WHOLE_BATCH = RowPlan()


def linear(x: torch.Tensor, weights: Any, rows: RowPlan = WHOLE_BATCH) -> torch.Tensor:
    """x W^T (+ b) over (T, in) in `weights`' format (models.weights), its rows cut into calls by `rows`."""
    matmul = weights.matmul
    count = x.shape[0]
    if count < rows.min_rows:
        return matmul(F.pad(x, (0, 0, 0, rows.min_rows - count)))[:count]
    if rows.max_rows is None or count <= rows.max_rows:
        return matmul(x)
    tiles = list(x.split(rows.max_rows))
    if tiles[-1].shape[0] < rows.min_rows:
        tiles[-1] = F.pad(tiles[-1], (0, 0, 0, rows.min_rows - tiles[-1].shape[0]))
    return torch.cat([matmul(part) for part in tiles])[:count]


def set_row_plan(model: nn.Module, rows: RowPlan) -> None:
    """Give every linear layer of `model` (an embedding serving as its LM head included) this plan;
    formats that are batch-invariant by construction keep whole batches."""
    for module in model.modules():
        if isinstance(module, (Linear, Embedding)):
            module.rows = WHOLE_BATCH if module.weights.invariant_by_construction else rows


def prepare_linears(model: nn.Module, quantization: str, block_kernels: bool) -> dict[str, int]:
    """Give every linear layer (and a tied LM head) its format once the checkpoint is loaded.

    Block-quantized when `block_kernels` (ember's CPU kernels run here): with quantization
    "auto", blocks the loader staged stay as they are (a GGUF keeps its own precision); with
    "int4" or "int8" every layer is quantized to that width (the LM head to 8 bits in both cases:
    it is the layer most sensitive to rounding). Otherwise staged blocks are dequantized, and bfloat16
    weights on the CPU are prepacked for oneDNN. Returns how many layers took each format.
    """
    bits = {"int4": 4, "int8": 8}.get(quantization)
    head = model.lm_head
    counts: dict[str, int] = {}
    for module in model.modules():
        if not isinstance(module, (Linear, Embedding)):
            continue
        shards, blocks = module.blocks, module.staged_blocks()
        module.blocks = None
        if isinstance(module, Embedding) and module is not head:  # a table only: float rows for lookups
            if blocks is not None:
                module.weight.data = blocks.dequantize().to(module.weight.dtype)
            continue
        weight = module.weight.data
        if module.keep_float and blocks is not None:
            module.weight.data = weight = blocks.dequantize().to(weight.dtype)
            blocks = None
        target = None if bits is None or module.keep_float else 8 if module is head else bits
        if block_kernels and target is not None and module.in_features % QBLOCK == 0:
            if blocks is None:
                blocks = QuantBlocks.quantize(weight, target)
            elif blocks.bits != target:
                blocks = QuantBlocks.quantize(blocks.dequantize(), target)
        if block_kernels and blocks is not None:
            if target is None and len(shards) > 1 and StackedBlockWeights.fits(shards):  # a file's shards as they are
                module.weights = StackedBlockWeights(shards, module.bias, weight.dtype)
            else:
                module.weights = BlockWeights(blocks, module.bias, weight.dtype)
            module.weight.data = torch.empty(0, dtype=weight.dtype)  # lookups of a tied table read the blocks
        else:
            if blocks is not None:
                module.weight.data = weight = blocks.dequantize().to(weight.dtype)
            if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and PackedBF16Weights.supported():
                module.weights = PackedBF16Weights(weight, module.bias)
                if isinstance(module, Linear):  # the packed copy replaces it; a table keeps it for lookups
                    module.weight.data = torch.empty(0, dtype=weight.dtype)
        counts[module.weights.name] = counts.get(module.weights.name, 0) + 1
    return counts


def block_weights(model: nn.Module) -> list[BlockWeights]:
    """The block-quantized weights of the model's layers (a tied head's once, a stacked layer's
    parts one by one), in module order."""
    found = {}
    for module in model.modules():
        weights = getattr(module, "weights", None)
        for part in weights.parts if isinstance(weights, StackedBlockWeights) else [weights]:
            if isinstance(part, BlockWeights):
                found[id(part)] = part
    return list(found.values())


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). W is uninitialised until load_weights fills it (or stages quantized blocks
    for it), then held in a format of models.weights, dense until prepare_linears chooses."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.weights: Any = DenseWeights(self.weight, self.bias)
        self.blocks: list[QuantBlocks | None] | None = None  # quantized shards the loader staged
        self.rows = WHOLE_BATCH  # set by set_row_plan
        self.keep_float = False  # never block-quantized (a MoE router: rounding would change the experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weights, self.rows)

    def stage_blocks(self, index: int, blocks: QuantBlocks) -> None:
        """Keep the quantized blocks of shard `index` (its float rows stay unloaded)."""
        if self.blocks is None:
            self.blocks = [None] * len(getattr(self, "out_sizes", [self.out_features]))
        self.blocks[index] = blocks

    def staged_blocks(self) -> QuantBlocks | None:
        """Every shard's blocks stacked; None unless all of them were staged."""
        if self.blocks is None or any(b is None for b in self.blocks):
            return None
        return self.blocks[0] if len(self.blocks) == 1 else QuantBlocks.cat(self.blocks)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim, run as one matmul.

    The checkpoint stores them apart; `shard(param, index)` is the slice one of them loads into.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        return param.data.narrow(0, self.offsets[index], self.out_sizes[index])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(x, self.weights, self.rows).split(self.out_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul; returns (T, heads, head_dim) views."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False) -> None:
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], bias)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().forward(x)  # (T, heads * head_dim) column slices of one output
        t = x.shape[0]
        return (q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim),
                v.view(t, -1, self.head_dim))


class RowParallelLinear(Linear):
    """A linear layer whose input dimension tensor parallelism splits (attention's o_proj, the
    MLP's down_proj): each rank holds a slice of W's columns and gets the matching slice of x, and
    the output is the sum of every rank's partial product, plus the bias once. The sum is float32
    and rounds once to x's dtype, as one rank's matmul rounds. With no group: a plain Linear."""

    parallel: TensorParallel | None = None  # set by use_tensor_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            return linear(x, self.weights, self.rows)
        weights = self.weights
        sums = torch.zeros(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        self.parallel.sum_over_ranks(sums, lambda: weights.accumulate(x, sums), in_order=weights.continues_sums)
        out = sums.to(x.dtype)
        return out if self.bias is None else out + self.bias


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul; under tensor
    parallelism, gate and up hold a rank's channels and down sums over ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.fused = False  # silu(gate) * up in one kernel call (use_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate_up = linear(x, self.gate_up_proj.weights, self.gate_up_proj.rows)
            return self.down_proj(torch.ops.ember.silu_mul(gate_up))
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Embedding(nn.Module):
    """A lookup table; `weights` is its format when it also serves as the LM head (tied). A table
    whose head is block-quantized is looked up from the blocks, with no float copy kept."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.in_features, self.out_features = dim, num_embeddings
        self.weight = _param(num_embeddings, dim)
        self.bias = None
        self.weights: Any = DenseWeights(self.weight, None)
        self.blocks: list[QuantBlocks | None] | None = None
        self.rows = WHOLE_BATCH  # the row plan of its use as the LM head
        self.keep_float = False

    stage_blocks = Linear.stage_blocks
    staged_blocks = Linear.staged_blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.numel() == 0:
            return self.weights.rows(ids)
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """An embedding table that tensor parallelism splits by vocabulary rows: each rank holds rows
    [plan.vocab_start, plan.vocab_start + out_features), looks up the ids among them and zeros for
    the others, and the ranks' lookups are summed (each id's row comes from one rank: exact).
    As a tied LM head, a rank's logits cover its rows. With no group: a plain Embedding."""

    parallel: TensorParallel | None = None  # set by use_tensor_parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            return super().forward(ids)
        local = ids - self.parallel.plan.vocab_start
        outside = (local < 0) | (local >= self.out_features)
        rows = super().forward(local.masked_fill(outside, 0))  # (T, hidden)
        rows.masked_fill_(outside[:, None], 0)
        self.parallel.all_reduce(rows)
        return rows


def replace_rows(x: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """x (T, hidden) with its rows embeds[0] (R,) replaced by embeds[1] (R, hidden): how image
    embeddings take the place of their placeholder tokens before the first layer. None: x as it is."""
    if embeds is None:
        return x
    rows, values = embeds
    return x.index_copy(0, rows.to(x.device), values.to(device=x.device, dtype=x.dtype))


class RMSNorm(nn.Module):
    """Normalise in float32, cast back to the input dtype, then scale (transformers' order).
    `fused`: one call of ember's CPU kernel per step instead of six torch ops (use_fused_ops)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.ember.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm); before the first layer (no residual yet), (x, its norm)."""
        if residual is None:
            return x, self(x)
        if self.fused:
            return torch.ops.ember.add_rms_norm(residual, x, self.weight, self.eps)
        total = residual + x
        return total, self(total)


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings

def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _llama3_inv_freq(dim: int, base: float, scaling: dict[str, Any],
                     max_positions: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(dim, base)
    factor = scaling["factor"]
    low_factor = scaling["low_freq_factor"]
    high_factor = scaling["high_freq_factor"]
    old_len = scaling.get("original_max_position_embeddings") or max_positions
    low_freq_wavelen = old_len / low_factor
    high_freq_wavelen = old_len / high_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the middle band blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any],
                   max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and the attention factor ("mscale") that scales cos and sin."""
    old_len = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength makes `num_rotations` turns over the original context
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(dim: int, base: float, scaling: dict[str, Any],
                       max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: every frequency divided by its own factor, short_factor within the original
    context and long_factor past it. The choice is made once, from the length the model is built
    for (as llama.cpp makes it from its context size), never per batch: a token's rotation then
    never depends on its neighbours or on how long its sequence grows."""
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    if len(factors) != dim // 2:
        raise ModelLoadError(f"rope_scaling has {len(factors)} factors for {dim // 2} rotary frequencies")
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32)
                      * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


def rope_inv_freq(dim: int, base: float, scaling: dict[str, Any] | None,
                  max_positions: int) -> tuple[torch.Tensor, float, int]:
    """(inv_freq (dim/2,), attention factor, number of positions the table must cover)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return _default_inv_freq(dim, base), 1.0, max_positions
    if kind == "linear":
        return _default_inv_freq(dim, base) / scaling["factor"], 1.0, max_positions
    if kind == "llama3":
        return _llama3_inv_freq(dim, base, scaling, max_positions), 1.0, max_positions
    if kind == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(dim, base, scaling, max_positions)
        old_len = scaling.get("original_max_position_embeddings") or max_positions
        extended = int(old_len * (scaling.get("factor") or 1.0))
        return inv_freq, attention_factor, max(max_positions, extended)
    if kind in ("longrope", "su"):  # "su" is the name of the first Phi-3 configs
        inv_freq, attention_factor = _longrope_inv_freq(dim, base, scaling, max_positions)
        return inv_freq, attention_factor, max_positions
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported "
                         "(supported: default, linear, llama3, yarn, longrope)")


class RotaryEmbedding(nn.Module):
    """Precomputed float32 [cos | sin] table (positions, head_dim), indexed by absolute position.

    Rotate-half convention; yarn's attention factor is folded into cos and sin, as transformers does.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        try:
            inv_freq, attention_factor, self.max_positions = rope_inv_freq(
                head_dim, base, scaling, max_positions)
        except KeyError as missing:
            raise ModelLoadError(f"rope_scaling {scaling} lacks the field {missing}") from None
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos_sin = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions` (T,), each (T, 1, head_dim / 2) in `dtype`."""
        cos, sin = self.cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x: (T, heads, head_dim). Same products and sums as transformers' rotate_half form; fused:
    in place, by ember's CPU kernel (each output in one float rounding)."""
    if fused:
        torch.ops.ember.rotary_(x, cos, sin)
        return x
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def use_fused_ops(model: nn.Module) -> None:
    """Run norms, rotary embeddings and the MLP's activation through ember's CPU kernels."""
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = True


def use_tensor_parallel(model: nn.Module, parallel: TensorParallel) -> None:
    """A rank's shard (models.sharding): its layers where the ranks meet, and the model itself
    (its logits cover the rank's vocabulary rows), run their collectives through `parallel`."""
    for module in model.modules():
        if hasattr(module, "parallel"):
            module.parallel = parallel


# ---------------------------------------------------------------------------------------------
# Weight loading

def rename_prefixes(weights: Iterable[tuple[str, Any]], prefixes: tuple[tuple[str, str], ...]
                    ) -> Iterator[tuple[str, Any]]:
    """Checkpoint names under the model's own: the first (old, new) prefix a name starts with is
    replaced; other names pass as they are."""
    for name, tensor in weights:
        for old, new in prefixes:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantBlocks]],
                    fused: dict[str, tuple[str, ...]], skip: tuple[str, ...] = ()) -> None:
    """Copy checkpoint tensors into `model`'s parameters, casting to each parameter's dtype.
    A linear layer's (or embedding's) weight may come as QuantBlocks instead: they are staged on
    the module for prepare_linears, and its float parameter is released.

    fused: fused module name -> the checkpoint's names of its shards, in order, e.g.
    "qkv_proj" -> ("q_proj", "k_proj", "v_proj"). skip: substrings of harmless names to ignore.
    Raises ModelLoadError for an unknown name, a shape mismatch or a tensor never loaded.
    """
    modules = dict(model.named_modules())
    # checkpoint name -> (destination view of a param, owner module, shard index, leaf name)
    expected: dict[str, tuple[torch.Tensor, nn.Module, int, str]] = {}
    for pname, param in model.named_parameters():
        owner_name, leaf = pname.rsplit(".", 1)
        owner = modules[owner_name]
        parts = fused.get(owner_name.rsplit(".", 1)[-1]) if isinstance(owner, MergedLinear) else None
        if parts is None:
            expected[pname] = (param.data, owner, 0, leaf)
            continue
        prefix = owner_name.rsplit(".", 1)[0]
        for index, part in enumerate(parts):
            expected[f"{prefix}.{part}.{leaf}"] = (owner.shard(param, index), owner, index, leaf)

    seen: set[str] = set()
    staged: set[nn.Module] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if any(part in name for part in skip):
                continue
            target = expected.pop(name, None)
            if target is None:
                what = "twice" if name in seen else "which this model does not know"
                raise ModelLoadError(f"the checkpoint has the tensor {name} {what}")
            seen.add(name)
            dst, owner, index, leaf = target
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ModelLoadError(f"the checkpoint's tensor {name} has shape "
                                     f"{tuple(tensor.shape)}, the model expects {tuple(dst.shape)}")
            if isinstance(tensor, QuantBlocks):
                if leaf != "weight" or not hasattr(owner, "stage_blocks"):
                    raise ModelLoadError(f"the checkpoint's tensor {name} is quantized, which ember "
                                         f"supports for linear and embedding weights only")
                owner.stage_blocks(index, tensor)
                staged.add(owner)
            else:
                dst.copy_(tensor)
    if expected:
        missing = sorted(expected)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"the checkpoint lacks the tensor {missing[0]}{more}")
    for owner in staged:
        if owner.staged_blocks() is None:
            raise ModelLoadError(f"{type(owner).__name__} got quantized blocks for some of its shards only")
        owner.weight.data = torch.empty(0, dtype=owner.weight.dtype, device=owner.weight.device)
