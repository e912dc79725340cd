"""The KV pool as the engine lays it out against the same blocks laid out otherwise: decode rows'
attention.

    python bench/kv_pool_pages.py [--cases 1:8000,8:1000,32:200] [--rounds 15] [--scattered]

The engine's pool for ember's attention kernel keeps its blocks in groups of 16, each group's blocks
of one layer's keys (or values) of one KV head in one piece, on 2 MiB pages where the host grants
them (ember.engine.attention.KVCache, ember.engine.host_memory). This script builds that pool for
the default model's shape (30 layers, 3 KV heads, head dim 64, bfloat16) and two copies of its
blocks in torch's ordinary allocations: the same groups, and one run of blocks per layer's keys (or
values) of a KV head (the layout before the groups). For each case S:N it times one decode row of
each of S sequences at about N tokens of context over the 30 layers, the three in a new random
order each round, each after a 64 MB write (a step's weights pass through the caches between one
layer's attention and the next). Each sequence's blocks lie in one run, as the KV manager hands
them out while it can (`--scattered`: drawn at random from the pool). It prints each one's median
milliseconds and its rate over the keys and values read, the medians of the per-round ratios
against the single runs on ordinary pages, and whether every output has the same bits.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ember import kernels
from ember.engine.attention import KVCache

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16
POOLS = ("one run per KV head, ordinary pages", "groups, ordinary pages", "groups, huge pages (the engine's)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1:8000,8:1000,32:200", help="sequences:context, comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--scattered", action="store_true", help="blocks drawn at random from the pool")
    args = parser.parse_args()
    assert kernels.available(), kernels.status()
    cases = [tuple(int(n) for n in case.split(":")) for case in args.cases.split(",")]
    print(f"decode rows' attention, {LAYERS} layers, {HEADS} heads over {KV_HEADS} KV heads, head dim {HEAD_DIM}, "
          f"bfloat16, {torch.get_num_threads()} threads; blocks {'scattered' if args.scattered else 'in runs'}")
    print(f"| sequences x context | KV read | {' | '.join(POOLS)} | same bits |")
    print("| --- | --- |" + " --- |" * (len(POOLS) + 1))
    for sequences, context in cases:
        run_case(sequences, context, args.rounds, args.scattered)


def pools_of(num_blocks: int, generator: torch.Generator) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The three pools, holding the same random blocks: each as its layers' (k, v) caches."""
    engine = KVCache(LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cpu"),
                     kernel_layout=True)
    engine.tensor.copy_(torch.randn(engine.tensor.shape, generator=generator).bfloat16())
    grouped = engine.tensor.clone()  # torch's own allocation
    runs = torch.empty(LAYERS, 2, KV_HEADS, num_blocks, BLOCK * HEAD_DIM, dtype=torch.bfloat16)
    for block in range(num_blocks):
        runs[:, :, :, block] = engine.block(block)
    return {POOLS[0]: [(runs[i, 0], runs[i, 1]) for i in range(LAYERS)],
            POOLS[1]: [(grouped[:, i, 0], grouped[:, i, 1]) for i in range(LAYERS)],
            POOLS[2]: engine.layers}


def run_case(sequences: int, context: int, rounds: int, scattered: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    contexts = [rng.randrange(context * 9 // 10, context * 11 // 10 + 1) for _ in range(sequences)]
    needed = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(needed) + 1  # block 0: the null block
    order = list(range(1, num_blocks))
    if scattered:
        rng.shuffle(order)
    table = torch.zeros(sequences, max(needed), dtype=torch.int32)
    taken = 0
    for s, count in enumerate(needed):
        table[s, :count] = torch.tensor(order[taken:taken + count], dtype=torch.int32)
        taken += count
    pools = pools_of(num_blocks, generator)
    q = torch.randn(sequences, HEADS, HEAD_DIM, generator=generator).bfloat16()
    row_begin = torch.arange(sequences + 1, dtype=torch.int32)
    first_pos = torch.tensor([c - 1 for c in contexts], dtype=torch.int32)
    flush = torch.ones(16 << 20)
    seconds = {name: [] for name in pools}
    outputs = {}
    for round_index in range(rounds):
        for name in random.Random(round_index).sample(list(pools), len(pools)):
            flush.add_(1.0)
            began = time.perf_counter()
            for k, v in pools[name]:
                outputs[name] = torch.ops.ember.paged_attention(q, k, v, table, row_begin, first_pos,
                                                                HEAD_DIM ** -0.5, 0)
            seconds[name].append(time.perf_counter() - began)
    read = sum(contexts) * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS
    base = seconds[POOLS[0]]
    cells = []
    for name in POOLS:
        median = statistics.median(seconds[name])
        cell = f"{median * 1e3:.2f} ms ({read / median / 1e9:.1f} GB/s)"
        if name != POOLS[0]:
            cell += f", {statistics.median(t / b for t, b in zip(seconds[name], base)):.2f}x"
        cells.append(cell)
    same = all(torch.equal(outputs[name], outputs[POOLS[0]]) for name in POOLS)
    print(f"| {sequences} x {context:,} | {read / 1e6:.0f} MB | {' | '.join(cells)} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
