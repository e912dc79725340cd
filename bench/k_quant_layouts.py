"""GGUF quantized weights in two of the kernel's layouts, in one process: Q4_K with a scale and
minimum in every block of 32 (format 20, 5.5 bits a weight) against once per super-block of 256
(format 52, 4.625 bits); Q5_0 with 8-bit codes (format 8, 8.5 bits) against 6-bit ones (format
72, 6.5 bits); Q6_K and Q5_K with 6-bit codes and a scale (and minimum) in every block (formats 88
and 92: 7 and 7.5 bits) against those once per super-block (format 120, 6.5625 bits, Q6_K's own)
and Q5_K's codes in 5 bits (format 60, 5.625 bits); and a Q4_K_M file's mix (`q4_k_m`: Q4_K
beside Q6_K values and down projections in half the layers, as llama.cpp picks them), its fused
q/k/v of both types joined in one layout (format 104, 7.75 bits) against each part in its own
(52 and 120, StackedBlockWeights).

    python bench/k_quant_layouts.py [--type q4_k|q6_k|q5_k|q5_0|q4_k_m] [--rows 1,4,16,128] [--rounds 20]

One decode step's linear layers of a Qwen3-0.6B-shaped model (28 layers: q/k/v, o, gate/up and
down, all of the one type but in `q4_k_m`), random codes and steps, bfloat16 rows. The layouts are timed in
alternation, in a new random order each round; the table gives each one's median time for the
step's layers, the median of the per-round ratios and whether every output has the same bits (it
must where only the layout changes; joining a Q4_K_M file's q/k/v changes its arithmetic's order,
not its weights, so there the largest difference is given). Each layout's weights lie side by side on huge pages, as
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
from ember.models.weights import BlockWeights, QuantBlocks, StackedBlockWeights, pack_blocks

LAYERS = 28
SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))  # (out_features, in_features)
QKV = (2048, 1024, 1024)  # the first shape's parts
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


def more_bits(layer: int) -> bool:
    """Whether a Q4_K_M file holds this layer's values and down projection in Q6_K (llama.cpp's
    choice: the first and last eighth of the layers and every third between)."""
    eighth = LAYERS // 8
    return layer < eighth or layer >= LAYERS - eighth or (layer - eighth) % 3 == 2


def single_type_layers(kind: str, generator: torch.Generator) -> tuple[str, str, dict[str, list]]:
    """Every layer of one type in its wider layout and in its compact one."""
    before, compact = LAYOUTS[kind]
    held: dict[str, list] = {f"format {before}": [], f"format {compact}": []}
    for _ in range(LAYERS):
        for n, k in SHAPES:
            blocks = MAKERS[kind](n, k, generator)
            for format, layers in zip((before, compact), held.values()):
                layer = BlockWeights(blocks, None, torch.bfloat16)
                assert layer.format == compact
                layer.format, layer.packed = format, pack_blocks(blocks, format)
                layers.append(layer)
    return *held, held


def q4_k_m_layers(generator: torch.Generator) -> tuple[str, str, dict[str, list]]:
    """A Q4_K_M file's layers, the fused q/k/v joined in one layout and in parts."""
    held: dict[str, list] = {"joined": [], "parts": []}
    for index in range(LAYERS):
        values = q6_k_blocks if more_bits(index) else q4_k_blocks
        qkv = [q4_k_blocks(QKV[0], 1024, generator), q4_k_blocks(QKV[1], 1024, generator),
               values(QKV[2], 1024, generator)]
        rest = [q4_k_blocks(*SHAPES[1], generator), q4_k_blocks(*SHAPES[2], generator),
                values(*SHAPES[3], generator)]
        for name, layers in held.items():
            if name == "parts" and StackedBlockWeights.fits(qkv):
                layers.append(StackedBlockWeights(qkv, None, torch.bfloat16))
            else:
                layers.append(BlockWeights(QuantBlocks.cat(qkv), None, torch.bfloat16))
            layers += [BlockWeights(blocks, None, torch.bfloat16) for blocks in rest]
    return "joined", "parts", held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", choices=[*sorted(LAYOUTS), "q4_k_m"], default="q4_k")
    parser.add_argument("--rows", default="1,4,16,128")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    assert kernels.available(), kernels.status()
    generator = torch.Generator().manual_seed(0)
    before, compact, held = (q4_k_m_layers(generator) if args.type == "q4_k_m"
                             else single_type_layers(args.type, generator))
    parts = {name: [part for layer in layers for part in getattr(layer, "parts", [layer])]
             for name, layers in held.items()}
    for layers in parts.values():
        move_to_huge_pages(layers, "packed")
    size = {name: sum(part.packed.numel() for part in layers) for name, layers in parts.items()}
    weights = sum(n * k for n, k in SHAPES) * LAYERS
    print(f"{args.type}: {LAYERS} layers, {weights / 1e6:.0f} M weights: "
          + ", ".join(f"{name} {size[name] / 1e6:.1f} MB ({size[name] * 8 / weights:.3f} bits a weight)"
                      for name in size))
    widest = max(k for _, k in SHAPES)

    def step(name: str, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        inputs = {k: x[:, :k].contiguous() for _, k in SHAPES}
        began = time.perf_counter()
        outputs = [layer.matmul(inputs[layer.in_features]) for layer in held[name]]
        return time.perf_counter() - began, outputs

    print(f"one step's linear layers, bfloat16 rows; median of {args.rounds} rounds")
    print(f"| rows | {before} (ms) | {compact} (ms) | {compact} / {before} | same bits |")
    print("| --- | --- | --- | --- | --- |")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, widest, generator=generator).to(torch.bfloat16)
        times: dict[str, list[float]] = {before: [], compact: []}
        difference = 0.0  # the largest, relative to the output's largest magnitude
        for name in held:  # warm up
            step(name, x)
        for _ in range(args.rounds):
            order = list(held)
            random.shuffle(order)
            results = {name: step(name, x) for name in order}
            for name, (seconds, _) in results.items():
                times[name].append(seconds)
            for a, b in zip(results[before][1], results[compact][1]):
                difference = max(difference, float((a.float() - b.float()).abs().max() / b.float().abs().max()))
        ratio = statistics.median(b / a for a, b in zip(times[before], times[compact]))
        print(f"| {rows} | {statistics.median(times[before]) * 1e3:.2f} | {statistics.median(times[compact]) * 1e3:.2f} "
              f"| {ratio:.3f} | {'yes' if difference == 0 else f'no, {difference:.1e}'} |")


if __name__ == "__main__":
    main()
