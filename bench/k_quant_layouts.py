"""GGUF quantized weights in two of the kernel's layouts, in one process: Q4_K with a scale and
minimum in every block of 32 (format 20, 5.5 bits a weight) against once per super-block of 256
(format 52, 4.625 bits); Q5_0 with 8-bit codes (format 8, 8.5 bits) against 6-bit ones (format
72, 6.5 bits); Q6_K and Q5_K with 6-bit codes and a scale (and minimum) in every block (formats 88
and 92: 7 and 7.5 bits) against those once per super-block (format 120, 6.5625 bits, Q6_K's own)
and Q5_K's codes in 5 bits (format 60, 5.625 bits).

    python bench/k_quant_layouts.py [--type q4_k|q6_k|q5_k|q5_0] [--rows 1,4,16,128] [--rounds 20]

One decode step's linear layers of a Qwen3-0.6B-shaped model (28 layers: q/k/v, o, gate/up and
down, all of the one type), random codes and steps, bfloat16 rows. The layouts are timed in
alternation, in a new random order each round; the table gives each one's median time for the
step's layers, the median of the per-round ratios and whether every output has the same bits (it
must: the layout changes no arithmetic). Each layout's weights lie side by side on huge pages, as
the engine places a model's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ember import kernels
from ember.engine.host_memory import move_to_huge_pages
from ember.models.weights import BlockWeights, QuantBlocks, pack_blocks

LAYERS = 28
SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))  # (out_features, in_features)
LAYOUTS = {"q4_k": (20, 52), "q6_k": (88, 120), "q5_k": (92, 60), "q5_0": (8, 72)}  # (wider, compact)


def q4_k_blocks(out: int, width: int, generator: torch.Generator) -> QuantBlocks:
    """Q4_K-like blocks: codes 0..15, 6-bit steps, a scale and minimum per row and super-block."""
    blocks, supers = width // 32, width // 256
    per_super = lambda t: t.repeat_interleave(8, dim=1)
    scales = per_super((torch.rand(out, supers, generator=generator) * 1e-3 + 1e-4).to(torch.float16))
    mins = per_super((-torch.rand(out, supers, generator=generator) * 1e-3).to(torch.float16))
    return QuantBlocks(4, torch.randint(0, 16, (out, width), generator=generator, dtype=torch.uint8), scales, mins,
                       torch.randint(1, 64, (out, blocks), generator=generator, dtype=torch.uint8),
                       torch.randint(0, 64, (out, blocks), generator=generator, dtype=torch.uint8))


def q6_k_blocks(out: int, width: int, generator: torch.Generator) -> QuantBlocks:
    """Q6_K-like blocks: 6-bit codes held as 96..159, a signed step for each half of 16, a scale
    per row and super-block."""
    scales = (torch.rand(out, width // 256, generator=generator) * 1e-4 + 1e-5).to(torch.float16)
    scales = scales.repeat_interleave(8, dim=1)
    return QuantBlocks(8, torch.randint(96, 160, (out, width), generator=generator, dtype=torch.uint8), scales,
                       None, torch.randint(-128, 128, (out, width // 16), generator=generator, dtype=torch.int8))


def q5_k_blocks(out: int, width: int, generator: torch.Generator) -> QuantBlocks:
    """Q5_K-like blocks: codes 0..31, 6-bit steps, a scale and minimum per row and super-block."""
    blocks, supers = width // 32, width // 256
    per_super = lambda t: t.repeat_interleave(8, dim=1)
    scales = per_super((torch.rand(out, supers, generator=generator) * 1e-4 + 1e-5).to(torch.float16))
    mins = per_super((-torch.rand(out, supers, generator=generator) * 1e-3).to(torch.float16))
    return QuantBlocks(8, torch.randint(0, 32, (out, width), generator=generator, dtype=torch.uint8), scales, mins,
                       torch.randint(1, 64, (out, blocks), generator=generator, dtype=torch.uint8),
                       torch.randint(0, 64, (out, blocks), generator=generator, dtype=torch.uint8))


def q5_0_blocks(out: int, width: int, generator: torch.Generator) -> QuantBlocks:
    """Q5_0-like blocks: codes q + 112 (q in 0..31), a scale."""
    scales = (torch.rand(out, width // 32, generator=generator) * 1e-3 + 1e-4).to(torch.float16)
    return QuantBlocks(8, torch.randint(112, 144, (out, width), generator=generator, dtype=torch.uint8), scales)


MAKERS = {"q4_k": q4_k_blocks, "q6_k": q6_k_blocks, "q5_k": q5_k_blocks, "q5_0": q5_0_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", choices=sorted(LAYOUTS), default="q4_k")
    parser.add_argument("--rows", default="1,4,16,128")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    assert kernels.available(), kernels.status()
    generator = torch.Generator().manual_seed(0)
    make = MAKERS[args.type]
    before, compact = LAYOUTS[args.type]
    held: dict[int, list[BlockWeights]] = {before: [], compact: []}
    for _ in range(LAYERS):
        for n, k in SHAPES:
            blocks = make(n, k, generator)
            for format, layers in held.items():
                layer = BlockWeights(blocks, None, torch.bfloat16)
                assert layer.format == compact
                layer.format, layer.packed = format, pack_blocks(blocks, format)
                layers.append(layer)
    for layers in held.values():
        move_to_huge_pages(layers, "packed")
    layouts = {format: [(layer.packed, layer.out_features, layer.in_features) for layer in layers]
               for format, layers in held.items()}
    size = {format: sum(p.numel() for p, _, _ in layers) for format, layers in layouts.items()}
    weights = sum(n * k for n, k in SHAPES) * LAYERS
    print(f"{args.type}: {LAYERS} layers, {weights / 1e6:.0f} M weights: "
          + ", ".join(f"format {f} {size[f] / 1e6:.1f} MB ({size[f] * 8 / weights:.3f} bits a weight)" for f in size))
    widest = max(k for _, k in SHAPES)

    def step(format: int, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        inputs = {k: x[:, :k].contiguous() for _, k in SHAPES}
        began = time.perf_counter()
        outputs = [torch.ops.ember.quantized_linear(inputs[k], packed, n, format) for packed, n, k in layouts[format]]
        return time.perf_counter() - began, outputs

    print(f"one step's linear layers, bfloat16 rows; median of {args.rounds} rounds")
    print(f"| rows | format {before} (ms) | format {compact} (ms) | {compact} / {before} | same bits |")
    print("| --- | --- | --- | --- | --- |")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, widest, generator=generator).to(torch.bfloat16)
        times: dict[int, list[float]] = {before: [], compact: []}
        same = True
        for format in layouts:  # warm up
            step(format, x)
        for _ in range(args.rounds):
            order = list(layouts)
            random.shuffle(order)
            results = {format: step(format, x) for format in order}
            for format, (seconds, _) in results.items():
                times[format].append(seconds)
            same &= all(torch.equal(a, b) for a, b in zip(results[before][1], results[compact][1]))
        ratio = statistics.median(b / a for a, b in zip(times[before], times[compact]))
        print(f"| {rows} | {statistics.median(times[before]) * 1e3:.2f} | {statistics.median(times[compact]) * 1e3:.2f} "
              f"| {ratio:.3f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
