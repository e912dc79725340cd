"""Building blocks shared by the model files: norms, rotary embeddings, fused linears, weight loading.

Every op here is row-wise: a token's output never depends on the other tokens in the batch.
Parameters are created empty (the loader fills them) and without autograd.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import ModelLoadError


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, rows: RowPlan = WHOLE_BATCH) -> torch.Tensor:
    """x W^T (+ b) over (T, in), its rows cut into calls by `rows`.

    `packed` is the weight prepacked by `pack_for_cpu`; it gives the same bits as `weight`.
    """
    if packed is not None:
        def matmul(part: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(part, packed, bias, "none", [], "")
    else:
        def matmul(part: torch.Tensor) -> torch.Tensor:
            return F.linear(part, weight, bias)
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
    """Give every linear layer of `model`, and an embedding serving as its LM head, this plan."""
    for module in model.modules():
        if isinstance(module, (Linear, Embedding)):
            module.rows = rows


def pack_for_cpu(model: nn.Module, head: nn.Module | None = None) -> bool:
    """Prepack bfloat16 weights into oneDNN's blocked layout, once, instead of on every call.

    Unpacked, oneDNN reorders the whole weight at each matmul, which dominates at one to a few
    rows (decode). Packed for one row, the results are bit-identical to the unpacked ones. `head` is an embedding used as the
    LM head (tied weights): it keeps its plain weight for lookups and gains a packed copy.
    Returns False (and changes nothing) where the packing ops are missing.
    """
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            module.packed = ops._reorder_linear_weight(module.weight.data, 1)
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)  # the packed copy replaces it
    if head is not None and head.weight.dtype == torch.bfloat16 and head.weight.device.type == "cpu":
        head.packed = ops._reorder_linear_weight(head.weight.data, 1)
    return True


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), with W uninitialised until load_weights fills it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.packed: torch.Tensor | None = None  # set by pack_for_cpu
        self.rows = WHOLE_BATCH  # set by set_row_plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.rows)


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
        return linear(x, self.weight, self.bias, self.packed, self.rows).split(self.out_sizes, dim=-1)


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


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, dim)
        self.packed: torch.Tensor | None = None  # a packed copy, when it also serves as the LM head
        self.rows = WHOLE_BATCH  # the row plan of its use as the LM head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Normalise in float32, cast back to the input dtype, then scale (transformers' order)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported "
                         "(supported: default, linear, llama3, yarn)")


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim). Same products and sums as transformers' rotate_half form."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---------------------------------------------------------------------------------------------
# Weight loading

def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    fused: dict[str, tuple[str, ...]], skip: tuple[str, ...] = ()) -> None:
    """Copy checkpoint tensors into `model`'s parameters, casting to each parameter's dtype.

    fused: fused module name -> the checkpoint's names of its shards, in order, e.g.
    "qkv_proj" -> ("q_proj", "k_proj", "v_proj"). skip: substrings of harmless names to ignore.
    Raises ModelLoadError for an unknown name, a shape mismatch or a tensor never loaded.
    """
    modules = dict(model.named_modules())
    expected: dict[str, torch.Tensor] = {}  # checkpoint name -> destination (a view of a param)
    for pname, param in model.named_parameters():
        owner_name, leaf = pname.rsplit(".", 1)
        owner = modules[owner_name]
        parts = fused.get(owner_name.rsplit(".", 1)[-1]) if isinstance(owner, MergedLinear) else None
        if parts is None:
            expected[pname] = param.data
            continue
        prefix = owner_name.rsplit(".", 1)[0]
        for index, part in enumerate(parts):
            expected[f"{prefix}.{part}.{leaf}"] = owner.shard(param, index)

    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if any(part in name for part in skip):
                continue
            dst = expected.pop(name, None)
            if dst is None:
                what = "twice" if name in seen else "which this model does not know"
                raise ModelLoadError(f"the checkpoint has the tensor {name} {what}")
            seen.add(name)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ModelLoadError(f"the checkpoint's tensor {name} has shape "
                                     f"{tuple(tensor.shape)}, the model expects {tuple(dst.shape)}")
            dst.copy_(tensor)
    if expected:
        missing = sorted(expected)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"the checkpoint lacks the tensor {missing[0]}{more}")
