"""The vision tower's bfloat16 attention: ember's kernel against torch's, in one process.

    python bench/tower_attention.py [--rounds 9] [--threads N]

One piece of 256 query rows against every patch of a tile, at Gemma 3 4B's tower shape (4096
patches, 16 heads, head_dim 72) and SmolVLM's (1024 patches, 12 heads, head_dim 64), on random
bfloat16 tensors: torch's scaled_dot_product_attention (as the tower calls it) and ember's
tower_attention over keys and values packed once (the packing, once per layer, is timed apart).
The two are timed in alternation; the table gives each one's median and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ember import kernels

ROWS = 256
SHAPES = {"Gemma 3 4B": (4096, 16, 72), "SmolVLM": (1024, 12, 64)}  # patches, heads, head_dim


def seconds(call) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads (default: as torch starts)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.available() or not hasattr(torch.ops.ember, "tower_attention"):
        raise SystemExit(f"ember's tower attention kernel is not here ({kernels.status()}; it needs AVX-512 BF16)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {ROWS} query rows, bfloat16")
    generator = torch.Generator().manual_seed(0)
    for label, (patches, heads, head_dim) in SHAPES.items():
        print(compare(label, patches, heads, head_dim, args.rounds, generator), flush=True)


def compare(label: str, patches: int, heads: int, head_dim: int, rounds: int, generator: torch.Generator) -> str:
    q = torch.randn(ROWS, heads, head_dim, generator=generator).bfloat16()
    k, v = (torch.randn(patches, heads, head_dim, generator=generator).bfloat16() for _ in range(2))
    k_packed, v_packed = torch.ops.ember.tower_pack_kv(k, v)
    k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    calls = {"torch": lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], k4, v4),
             "ember": lambda: torch.ops.ember.tower_attention(q, k_packed, v_packed, None, patches, head_dim ** -0.5),
             "pack": lambda: torch.ops.ember.tower_pack_kv(k, v)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # a first call of each, untimed
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(seconds(call))
    median = {name: statistics.median(values) for name, values in times.items()}
    gflops = 4 * heads * ROWS * patches * head_dim / median["ember"] / 1e9
    return (f"{label} ({patches} patches, {heads} heads, head_dim {head_dim}): torch {median['torch'] * 1e3:.1f} ms, "
            f"ember {median['ember'] * 1e3:.1f} ms ({gflops:.0f} GFLOP/s): {median['torch'] / median['ember']:.2f}x; "
            f"packing once per layer {median['pack'] * 1e3:.1f} ms")

if __name__ == "__main__":
    main()
