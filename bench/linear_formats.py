"""The candidates for a CPU linear layer, measured side by side on the default model's shapes.

    python bench/linear_formats.py [--rows 1,32,512] [--repeat 50]

For each candidate, each layer shape of SmolLM2-135M (the fused q/k/v, the output projection, the
fused gate/up, the down projection, the LM head) and each batch size: the median time of one
call, the error against float32 on the same (dequantized) weights, and whether a row's bits are
the same computed alone and inside the batch (batch invariance needs that, or a row plan):

- torch bfloat16 through F.linear, and prepacked for oneDNN (ember's bfloat16 format);
- torch's int8 weight-only matmul (`_weight_int8pack_mm`: per-channel scales, bfloat16 activations);
- torch's int4 weight-only matmul (`_weight_int4pack_mm_for_cpu`: groups of 32);
- ember's 8- and 4-bit block kernels (ember.kernels: groups of 32, activations quantized to 8 bits).

Each candidate's weights are quantized from the same random float weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ember import kernels
from ember.models.weights import BlockWeights, PackedBF16Weights, QuantBlocks

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
GROUP = 32
LAYERS = 30


def bf16_dense(weight: torch.Tensor):
    w = weight.to(torch.bfloat16)
    return lambda x: F.linear(x, w), w.float()


def bf16_packed(weight: torch.Tensor):
    layer = PackedBF16Weights(weight.to(torch.bfloat16), None)
    return layer.matmul, weight.to(torch.bfloat16).float()


def torch_int8(weight: torch.Tensor):
    scales = (weight.abs().amax(1) / 127).clamp_min(1e-8)
    codes = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    scales = scales.to(torch.bfloat16)
    return (lambda x: torch._weight_int8pack_mm(x, codes, scales)), codes.float() * scales.float()[:, None]


def torch_int4(weight: torch.Tensor):
    out, width = weight.shape
    blocks = weight.view(out, width // GROUP, GROUP)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-8)
    codes = torch.round((blocks - low[..., None]) / scales[..., None]).clamp(0, 15)
    # torch's convention: w = (code - 8) * scale + zero, so zero = low + 8 * scale
    scales_bf, zeros_bf = scales.to(torch.bfloat16), (low + 8 * scales).to(torch.bfloat16)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.view(out, width).to(torch.int32), 1)
    scales_and_zeros = torch.stack([scales_bf, zeros_bf], dim=-1).transpose(0, 1).contiguous()  # (groups, out, 2)
    dequantized = ((codes - 8) * scales_bf.float()[..., None] + zeros_bf.float()[..., None]).view(out, width)
    return (lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)), dequantized


def ember_blocks(bits: int):
    def build(weight: torch.Tensor):
        blocks = QuantBlocks.quantize(weight, bits)
        return BlockWeights(blocks, None, torch.bfloat16).matmul, blocks.dequantize()
    return build


CANDIDATES = {
    "bfloat16, F.linear": bf16_dense,
    "bfloat16, oneDNN prepacked (ember)": bf16_packed,
    "torch int8 weight-only": torch_int8,
    "torch int4 weight-only": torch_int4,
    "ember int8 blocks": ember_blocks(8),
    "ember int4 blocks": ember_blocks(4),
}


def median_seconds(fn, x: torch.Tensor, repeat: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,32,512")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"ember's kernels are not available: {kernels.status()}")
    rows = [int(r) for r in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; times are medians of {args.repeat} calls, ms")
    header = ["candidate", "shape"] + [f"{r} rows ms" for r in rows] + ["rel. error", "row-invariant"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    step = {name: [0.0] * len(rows) for name in CANDIDATES}  # a decode step's linear layers, seconds
    for name, build in CANDIDATES.items():
        for shape_name, (out, width) in SHAPES.items():
            weight = torch.randn(out, width, generator=generator) * 0.05
            fn, reference_weight = build(weight)
            cells, invariant = [], True
            for index, count in enumerate(rows):
                x = torch.randn(count, width, generator=generator).to(torch.bfloat16)
                seconds = median_seconds(fn, x, args.repeat if count < 512 else max(5, args.repeat // 5))
                step[name][index] += seconds * (1 if shape_name == "lm_head" else LAYERS)
                cells.append(f"{seconds * 1e3:.3f}")
                batch = fn(x)
                if count > 1:
                    alone = torch.cat([fn(x[i:i + 1]) for i in range(min(count, 8))])
                    invariant &= torch.equal(alone, batch[:alone.shape[0]])
            expected = x.float() @ reference_weight.T
            error = ((batch.float() - expected).norm() / expected.norm()).item()
            print(f"| {name} | {shape_name} {out}x{width} | " + " | ".join(cells) + f" | {error:.4f} | "
                  f"{'yes' if invariant else 'no'} |")
    print(f"\nOne step's linear layers ({LAYERS} layers of qkv, o, gate_up and down, and the LM head), ms:")
    print("| candidate | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|" + " --- |" * (len(rows) + 1))
    for name, seconds in step.items():
        print(f"| {name} | " + " | ".join(f"{s * 1e3:.1f}" for s in seconds) + " |")


if __name__ == "__main__":
    main()
