"""This tree's row-wise layer ops (layer_ops.cpp) against another version of their source, in one
process.

    mkdir -p /tmp/before && git archive HEAD~1 ember/kernels | tar -x -C /tmp/before
    python bench/row_ops_versions.py /tmp/before/ember/kernels/layer_ops.cpp [--rows 1,9,32,256] [--rounds 200]

The other source is built beside ember's kernels under an op namespace of its own, with the headers
of its folder (that commit's; a lone .cpp takes this tree's). Both run the default model's row ops
at each row count (a decode row, a drafted round being verified, a batch, a prompt's chunk): the
norm with the residual add (576 wide), SiLU times up (1,536), the rotary embedding (12 heads of 64,
angles on the unit circle). The two are timed in alternation, call by call; the table gives each
one's median time in microseconds per call, the ratio (this tree over the other) and whether every
output has the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ember import kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the other version of layer_ops.cpp")
    parser.add_argument("--rows", default="1,9,32,256")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    assert kernels.available(), kernels.status()
    ours, other = torch.ops.ember, kernels.kernel_copy(args.other, "ember_row_ops_other")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, generator=generator).to(torch.bfloat16)
    print("| rows | op | this tree (us) | other (us) | ratio | same bits |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in map(int, args.rows.split(",")):
        x, residual = (torch.randn(rows, 576, generator=generator).to(torch.bfloat16) for _ in range(2))
        gate_up = (torch.randn(rows, 3072, generator=generator) * 4).to(torch.bfloat16)
        angles = torch.rand(rows, 32, generator=generator) * 6.3
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        heads = torch.randn(rows, 12, 64, generator=generator).to(torch.bfloat16)

        def rotated(ops):  # on a fresh copy each call: rotating one tensor over and over drifts it
            q = heads.clone()
            ops.rotary_(q, cos, sin)
            return q

        calls = {"add + norm": lambda ops: torch.cat(ops.add_rms_norm(x, residual, weight, 1e-5)),
                 "silu * up": lambda ops: ops.silu_mul(gate_up),
                 "rotary (with a copy)": rotated}
        for name, call in calls.items():
            same = torch.equal(call(ours).view(torch.int16), call(other).view(torch.int16))
            times = {0: [], 1: []}
            for _ in range(args.rounds):
                for index, ops in enumerate((ours, other)):
                    began = time.perf_counter()
                    call(ops)
                    times[index].append(time.perf_counter() - began)
            mine, theirs = (statistics.median(times[i]) * 1e6 for i in (0, 1))
            print(f"| {rows} | {name} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} "
                  f"| {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
