"""One decode row's paged attention: this tree's kernel against another commit's, in one process.

    python bench/attention_decode.py [--ref HEAD~1] [--contexts 128,512,2048] [--threads 2]

The other commit's ember/kernels/attention.cpp is built a second time under its own op namespace
(ember.kernels.kernel_copy), and both run on the same cache and block tables, round after round
in turn, the default model's shape (9 query heads over 3 KV heads of 64 dims, bfloat16). Two
settings: `warm`, one layer's cache called again and again (in the caches: the kernel's
arithmetic); `cold`, thirty layers' caches called layer after layer after a 64 MB write (a decode
step's case: the weights stream through the caches between one layer's attention and the next),
each sequence's blocks consecutive (as the KV manager hands them out while it can); `scattered`,
the same with blocks taken at random from the pool (a pool after much coming and going). Each
figure is the best of the rounds' median microseconds a call (Python's call included, the same
for both).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ember import kernels

ROOT = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS, POOL_BLOCKS = 30, 1200


def other_kernel(ref: str):
    source = subprocess.run(["git", "show", f"{ref}:ember/kernels/attention.cpp"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="ember-attention-ref-"))
    (folder / "attention.cpp").write_text(source)
    return kernels.kernel_copy(folder / "attention.cpp", "ember_attention_ref").paged_attention


def time_calls(attention, caches, tables, context: int, cold: bool, rounds: int) -> float:
    q = torch.randn(1, HEADS, HEAD_DIM).bfloat16()
    row_begin, first_pos = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([context - 1], dtype=torch.int32)
    flush = torch.ones(16 << 20)  # 64 MB
    seconds = []
    for _ in range(rounds):
        if cold:
            flush.add_(1.0)
        began = time.perf_counter()
        for (k, v), table in zip(caches, tables):
            attention(q, k, v, table, row_begin, first_pos, HEAD_DIM ** -0.5, 0)
        seconds.append((time.perf_counter() - began) / len(caches))
    return statistics.median(seconds) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ref", default="HEAD~1", help="the commit whose kernel is the baseline")
    parser.add_argument("--contexts", default="128,256,512,1024,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit(f"ember's CPU kernels: {kernels.status()}")
    torch.set_num_threads(args.threads)
    ours, theirs = torch.ops.ember.paged_attention, other_kernel(args.ref)
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(LAYERS, 2, KV_HEADS, POOL_BLOCKS, BLOCK * HEAD_DIM, generator=generator).bfloat16()
    layers = [(pool[layer, 0], pool[layer, 1]) for layer in range(LAYERS)]
    print(f"one decode row, {HEADS} heads over {KV_HEADS} KV heads of {HEAD_DIM}, bfloat16 cache, "
          f"{args.threads} threads; us a call (median), {args.ref} against this tree")
    settings = ("warm", "cold", "scattered")
    print(f"{'context':>8}" + "".join(f" {name + ' ref':>14} {name:>10} {'ratio':>6}" for name in settings))
    for context in map(int, args.contexts.split(",")):
        blocks = -(-context // BLOCK)
        in_order = torch.arange(blocks, dtype=torch.int32).reshape(1, -1)
        runs = [in_order] * LAYERS
        scattered = [torch.randperm(POOL_BLOCKS, generator=generator)[:blocks].to(torch.int32).reshape(1, -1)
                     for _ in range(LAYERS)]
        figures = {(setting, which): [] for setting in settings for which in ("ref", "ours")}
        for _ in range(args.rounds):  # in turn, so the machine's drift falls on both alike
            for which, attention in (("ref", theirs), ("ours", ours)):
                figures["warm", which].append(time_calls(attention, layers[:1] * 200, [in_order] * 200, context, False, 20))
                figures["cold", which].append(time_calls(attention, layers, runs, context, True, 40))
                figures["scattered", which].append(time_calls(attention, layers, scattered, context, True, 40))
        best = {key: min(values) for key, values in figures.items()}
        print(f"{context:>8}" + "".join(
            f" {best[setting, 'ref']:>14.2f} {best[setting, 'ours']:>10.2f} {best[setting, 'ref'] / best[setting, 'ours']:>5.2f}x"
            for setting in settings))

if __name__ == "__main__":
    main()
