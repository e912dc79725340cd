"""The linear kernel's vector path (AVX-512 VNNI or AVX2, whichever this processor has) against its
plain C++ build, on the default model's layer shapes, in one process.

    python bench/kernel_paths.py [--rounds 7]

The plain copy is the same source built for the compiler's baseline target
(ember.kernels.plain_linear_copy); both copies give the same bits (tests/models/test_kernel_paths.py).
For each shape and row count the two are timed in alternation, and the table gives each one's
median time and the median of the per-round ratios, plain over vector.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember import kernels
from ember.models.weights import BlockWeights, QuantBlocks

# (name, out_features, in_features, bits): SmolLM2-135M's layers in its GGUF's formats
SHAPES = (("qkv", 960, 576, 4), ("attention out", 576, 576, 4), ("gate and up", 3072, 576, 4),
          ("down", 576, 1536, 4), ("LM head", 49152, 576, 8))
ROWS = (1, 8, 64)


def timed(op, x, layer, reps: int) -> float:
    began = time.perf_counter()
    for _ in range(reps):
        op.quantized_linear(x, layer.packed, layer.out_features, layer.bits)
    return (time.perf_counter() - began) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    assert kernels.available(), kernels.status()
    if torch.ops.ember.vector_bits() == 0:
        raise SystemExit("this processor has no vector path: nothing to compare")
    plain = kernels.plain_linear_copy()
    print(f"kernels: {kernels.status()}")
    print("| layer | rows | vector, ms | plain C++, ms | plain / vector |")
    print("| --- | --- | --- | --- | --- |")
    generator = torch.Generator().manual_seed(0)
    for name, out_features, in_features, bits in SHAPES:
        weight = torch.randn(out_features, in_features, generator=generator) * 0.05
        layer = BlockWeights(QuantBlocks.quantize(weight, bits), None, torch.bfloat16)
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
            reps = max(2, int(2e8 // (rows * out_features * in_features)))
            vector, slow, ratios = [], [], []
            for _ in range(args.rounds):
                vector.append(timed(torch.ops.ember, x, layer, reps))
                slow.append(timed(plain, x, layer, max(1, reps // 20)))
                ratios.append(slow[-1] / vector[-1])
            print(f"| {name} | {rows} | {statistics.median(vector) * 1e3:.3f} | {statistics.median(slow) * 1e3:.3f} "
                  f"| {statistics.median(ratios):.1f}x |", flush=True)


if __name__ == "__main__":
    main()
