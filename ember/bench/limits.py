"""The machine's own limits, measured with ember's kernels, and speed figures as fractions of them.

Three figures, each the best of a few calls on the thread count the engine uses:

- read bandwidth: a matrix-vector product of ember's 8-bit block kernel over a weight far larger
  than the last-level cache (1 GiB by default), which is how a decode step reads its weights; the
  weight's bytes over the call's time. Without ember's kernels, a torch sum over a float32 buffer
  of the same size.
- int8 peak: the same kernel on a compute-bound shape (512 rows times a 4096 x 4096 weight),
  2 x rows x out x in operations over the call's time.
- bfloat16 peak: the engine's bfloat16 linear format (oneDNN prepacked where the processor has
  it, else F.linear) on the same shape.

The bounds they give: one stream decodes at most read bandwidth / weight bytes per token tokens a
second; many streams and prefill do at most int8 peak / (2 x weights) tokens a second (every weight
is one multiply and one add per token; a tied table counts once, as the LM head).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

_K = 4096  # the probe weights' input width
_ROWS_PER_TILE = 1024  # output rows of the small weight the big one is tiled from
_COMPUTE_ROWS, _COMPUTE_OUT = 512, 4096  # the compute-bound shape: rows x (out x _K)


@dataclass(frozen=True, slots=True)
class MachineLimits:
    threads: int
    read_gb_per_s: float
    read_method: str  # what read the buffer: ember's int8 kernel, or a torch sum without it
    int8_gops: float  # ember's int8 block kernel, 2 operations per multiply-add
    bf16_gflops: float  # the engine's bfloat16 linear format
    seconds: float  # how long the probe took

    def describe(self) -> str:
        return (f"machine limits ({self.threads} threads): read {self.read_gb_per_s:.1f} GB/s ({self.read_method}), "
                f"int8 {self.int8_gops:.0f} GOP/s, bfloat16 {self.bf16_gflops:.0f} GFLOP/s")

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Bounds:
    """A loaded model's speed limits on this machine."""

    limits: MachineLimits
    weight_bytes: int  # what one decode step reads (engine.weight_footprint)
    num_weights: int

    @property
    def decode_tokens_per_s(self) -> float:
        """One stream's ceiling: every step reads every weight once."""
        return self.limits.read_gb_per_s * 1e9 / self.weight_bytes

    @property
    def compute_tokens_per_s(self) -> float:
        """Many streams' and prefill's ceiling: every token multiplies and adds every weight once."""
        return self.limits.int8_gops * 1e9 / (2 * self.num_weights)

    def of_read(self, tokens_per_s: float) -> float:
        return tokens_per_s / self.decode_tokens_per_s

    def of_int8(self, tokens_per_s: float) -> float:
        return tokens_per_s / self.compute_tokens_per_s

    def describe(self) -> str:
        return (f"{self.limits.describe()}; weights {self.weight_bytes / 1e9:.3f} GB, "
                f"{self.num_weights / 1e6:.0f} M: one stream at most {self.decode_tokens_per_s:.0f} tok/s, "
                f"many streams and prefill at most {self.compute_tokens_per_s:.0f} tok/s")

    def to_json(self) -> dict:
        return {"limits": self.limits.to_json(), "weight_bytes": self.weight_bytes, "num_weights": self.num_weights,
                "decode_tokens_per_s": self.decode_tokens_per_s, "compute_tokens_per_s": self.compute_tokens_per_s}


def probe(threads: int | None = None, read_mib: int = 1024, repeat: int = 3,
          compute_scale: float = 1.0) -> MachineLimits:
    """Measure on `threads` threads (default: torch's current count, which the engine sets), then
    restore the count. `read_mib`: the streamed buffer's size; `compute_scale` shrinks the
    compute-bound shape's rows (tests use a small probe; a figure from one is not a limit)."""
    from ember import kernels

    previous = torch.get_num_threads()
    threads = threads or previous
    began = time.perf_counter()
    torch.set_num_threads(threads)
    try:
        rows = max(16, int(_COMPUTE_ROWS * compute_scale))
        if kernels.available():
            read, method = _kernel_read_gb_per_s(read_mib, repeat), "ember's int8 kernel"
            int8 = _kernel_int8_gops(rows, repeat)
        else:
            read, method = _torch_read_gb_per_s(read_mib, repeat), "torch sum, without ember's kernels"
            int8 = 0.0
        bf16 = _bf16_gflops(rows, repeat)
    finally:
        torch.set_num_threads(previous)
    return MachineLimits(threads, read, method, int8, bf16, time.perf_counter() - began)


def _best_seconds(call: Callable[[], object], repeat: int) -> float:
    call()  # warm: first-touch page faults, caches of packed layouts
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - began)
    return best


def _int8_weight(out_features: int):
    from ember.models.weights import BlockWeights, QuantBlocks

    weight = torch.randn(out_features, _K, generator=torch.Generator().manual_seed(0)) * 0.05
    return BlockWeights(QuantBlocks.quantize(weight, 8), None, torch.bfloat16)


def _kernel_read_gb_per_s(read_mib: int, repeat: int) -> float:
    # A small weight's packed column blocks tiled to the buffer's size: packing 1 GiB of float
    # weights would take four times that in float32 first.
    layer = _int8_weight(_ROWS_PER_TILE)
    tiles = max(1, read_mib * 2**20 // layer.packed.numel())
    packed = layer.packed.repeat(tiles, 1, 1)  # (column blocks, k blocks, bytes)
    out_features = _ROWS_PER_TILE * tiles
    x = torch.randn(1, _K).to(torch.bfloat16)
    seconds = _best_seconds(lambda: torch.ops.ember.quantized_linear(x, packed, out_features, 8), repeat)
    return packed.numel() / seconds / 1e9


def _torch_read_gb_per_s(read_mib: int, repeat: int) -> float:
    buffer = torch.ones(read_mib * 2**20 // 4)
    seconds = _best_seconds(lambda: buffer.sum(), repeat)
    return buffer.numel() * 4 / seconds / 1e9


def _kernel_int8_gops(rows: int, repeat: int) -> float:
    layer = _int8_weight(_COMPUTE_OUT)
    x = torch.randn(rows, _K).to(torch.bfloat16)
    seconds = _best_seconds(lambda: layer.matmul(x), repeat)
    return 2 * rows * _COMPUTE_OUT * _K / seconds / 1e9


def _bf16_gflops(rows: int, repeat: int) -> float:
    from ember.models.weights import DenseWeights, PackedBF16Weights

    weight = (torch.randn(_COMPUTE_OUT, _K, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    layer = PackedBF16Weights(weight, None) if PackedBF16Weights.supported() else DenseWeights(weight, None)
    x = torch.randn(rows, _K).to(torch.bfloat16)
    seconds = _best_seconds(lambda: layer.matmul(x), repeat)
    return 2 * rows * _COMPUTE_OUT * _K / seconds / 1e9


def decode_share(bounds: Bounds, streams: int | None, tokens_per_s: float) -> float:
    """Decode speed as a fraction of its bound: one stream's against the read bound, many
    streams' (all of them together; None: an open loop) against the int8 peak."""
    return bounds.of_read(tokens_per_s) if streams == 1 else bounds.of_int8(tokens_per_s)
