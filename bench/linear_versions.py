"""This tree's linear kernel against another version of its source, in one process.

    mkdir -p /tmp/before && git archive HEAD~1 ember/kernels | tar -x -C /tmp/before
    python bench/linear_versions.py /tmp/before/ember/kernels/linear.cpp [--rows 1,2,5,9,17,128] [--rounds 30]
        [--distinct]

The other source is built beside ember's kernels under an op namespace of its own, with the headers
of its folder (that commit's; a lone .cpp takes this tree's). Both run one decode step's linear
layers of the default model (its 30 layers' four projections in 4-bit blocks and the 8-bit LM head,
random weights of those shapes, bfloat16 rows) at each row count: the rows of a batch, or one
stream's last token and its drafts being verified. The two are timed in alternation, in a new
random order each round; the table gives each one's median time for the step's layers, the median
of the per-round ratios (this tree over the other) and whether every output has the same bits.

By default the 30 layers share one weight of each shape, which then stays in L2: the kernels'
arithmetic alone. With --distinct each layer has weights of its own, on huge pages as the engine
holds them (about 96 MB), so a step streams them from memory as a decode step does and the table
shows how well the kernel hides that read behind its work.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from pathlib import Path

import torch

from ember import kernels
from ember.engine.host_memory import huge_page_tensor
from ember.models.weights import BlockWeights, QuantBlocks

LAYERS = 30
# (out_features, in_features, bits, calls a step): SmolLM2-135M's projections and its LM head
SHAPES = ((960, 576, 4, LAYERS), (576, 576, 4, LAYERS), (3072, 576, 4, LAYERS), (576, 1536, 4, LAYERS),
          (49152, 576, 8, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the other version of ember/kernels/linear.cpp")
    parser.add_argument("--rows", default="1,2,4,5,6,8,9,10,13,17,32,128")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--distinct", action="store_true", help="each layer its own weights, on huge pages")
    args = parser.parse_args()
    assert kernels.available(), kernels.status()
    ops = {"this tree": torch.ops.ember, "other": kernels.kernel_copy(args.other, "ember_linear_other")}
    generator = torch.Generator().manual_seed(0)
    # (packed weights, one per call or one for all calls, n, k, bits) for each shape
    layers = [(packed_weights(n, k, bits, calls if args.distinct else 1, generator), n, k, bits, calls)
              for n, k, bits, calls in SHAPES]
    widest = max(k for _, _, k, _, _ in layers)

    def step(op, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        inputs = [x[:, :k].contiguous() for _, _, k, _, _ in layers]
        began = time.perf_counter()
        outputs = []
        for (packed, n, _, bits, calls), rows in zip(layers, inputs):
            for call in range(calls):
                out = op.quantized_linear(rows, packed[call % len(packed)], n, bits)
            outputs.append(out)
        return time.perf_counter() - began, outputs

    weights = "each layer its own weights" if args.distinct else "one weight of each shape for every layer"
    print(f"one step's linear layers ({LAYERS} layers and the LM head), bfloat16 rows, {weights}; "
          f"median of {args.rounds} rounds")
    print("| rows | this tree | other | this tree / other | same bits |")
    print("| --- | --- | --- | --- | --- |")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, widest, generator=generator).bfloat16()
        times: dict[str, list[float]] = {name: [] for name in ops}
        outputs = {}
        for round_index in range(args.rounds):
            for name in random.Random(round_index).sample(list(ops), len(ops)):
                seconds, outputs[name] = step(ops[name], x)
                times[name].append(seconds)
        mine, theirs = times["this tree"], times["other"]
        ratio = statistics.median(a / b for a, b in zip(mine, theirs))
        same = all(map(torch.equal, outputs["this tree"], outputs["other"]))
        print(f"| {rows} | {statistics.median(mine) * 1e3:.2f} ms | {statistics.median(theirs) * 1e3:.2f} ms | "
              f"{ratio:.3f}x | {'yes' if same else 'no'} |", flush=True)


def packed_weights(n: int, k: int, bits: int, count: int, generator: torch.Generator) -> list[torch.Tensor]:
    """`count` random weights of n x k in `bits`-bit blocks, packed as the kernel takes them; with
    more than one, copied onto huge pages where the platform allows, as the engine's are."""
    packed = [BlockWeights(QuantBlocks.quantize(torch.randn(n, k, generator=generator) * 0.05, bits), None,
                           torch.bfloat16).packed for _ in range(count)]
    nbytes = [-(-p.numel() * p.element_size() // 64) * 64 for p in packed]  # each on a cache line
    region = huge_page_tensor((sum(nbytes),), torch.uint8) if count > 1 else None
    if region is None:
        return packed
    placed = []
    for p, start in zip(packed, [0, *itertools.accumulate(nbytes)]):
        view = region[start:start + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        view.copy_(p)
        placed.append(view)
    return placed


if __name__ == "__main__":
    main()
