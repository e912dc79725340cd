"""The measurements behind bench.limits.MachineLimits, on ember's kernels (bench.limits says what
each figure is)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from ember.bench.limits import MachineLimits

_K = 4096  # the probe weights' input width
_ROWS_PER_TILE = 1024  # output rows of the small weight the big one is tiled from
_COMPUTE_ROWS, _COMPUTE_OUT = 512, 4096  # the compute-bound shape: rows x (out x _K)


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
