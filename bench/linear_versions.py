"""This tree's linear kernel against another version of its source, in one process.

    mkdir -p /tmp/before && git archive HEAD~1 ember/kernels | tar -x -C /tmp/before
    python bench/linear_versions.py /tmp/before/ember/kernels/linear.cpp [--rows 1,2,5,9,17,128] [--rounds 30]

The other source is built beside ember's kernels under an op namespace of its own, with the headers
of its folder (that commit's; a lone .cpp takes this tree's). Both run one decode step's linear
layers of the default model (its 30 layers' four projections in 4-bit blocks and the 8-bit LM head,
random weights of those shapes, bfloat16 rows) at each row count: the rows of a batch, or one
stream's last token and its drafts being verified. The two are timed in alternation, in a new
random order each round; the table gives each one's median time for the step's layers, the median
of the per-round ratios (this tree over the other) and whether every output has the same bits.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from ember import kernels
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
    args = parser.parse_args()
    assert kernels.available(), kernels.status()
    ops = {"this tree": torch.ops.ember, "other": kernels.kernel_copy(args.other, "ember_linear_other")}
    generator = torch.Generator().manual_seed(0)
    layers = [(BlockWeights(QuantBlocks.quantize(torch.randn(n, k, generator=generator) * 0.05, bits), None,
                            torch.bfloat16), n, k, bits, calls) for n, k, bits, calls in SHAPES]
    widest = max(k for _, _, k, _, _ in layers)

    def step(op, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        inputs = [x[:, :k].contiguous() for _, _, k, _, _ in layers]
        began = time.perf_counter()
        outputs = []
        for (layer, n, _, bits, calls), rows in zip(layers, inputs):
            for _ in range(calls):
                out = op.quantized_linear(rows, layer.packed, n, bits)
            outputs.append(out)
        return time.perf_counter() - began, outputs

    print(f"one step's linear layers ({LAYERS} layers and the LM head), bfloat16 rows; median of {args.rounds} rounds")
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


if __name__ == "__main__":
    main()
