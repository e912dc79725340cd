"""This tree's attention kernel against another version of its source, in one process.

    mkdir -p /tmp/before && git archive HEAD~1 ember/kernels | tar -x -C /tmp/before
    python bench/attention_versions.py /tmp/before/ember/kernels/attention.cpp [--prompt 4000] [--rounds 5]
        [--decode-contexts 128,256,512,1024,2048] [--decode-batches 32x250,64x128,8x1000,1x8000,4x100]
        [--store-rows 1,8,9,16,24,32,256]

The other source is built beside ember's kernels under an op namespace of its own, with the headers
of its folder (that commit's; a lone .cpp takes this tree's), and both run the default model's
attention shapes (9 query heads, 3 KV heads, head dim 64, bfloat16) on the same random cache: a
whole prompt in chunks of 512 rows, as prefill runs it, and one decode row at the prompt's end. The
two are timed in alternation, in a new random order each round; the table gives each one's median
time for the model's 30 layers and the median of the per-round ratios, this tree over the other,
and whether the outputs have the same bits.

A second table times one decode row at each of --decode-contexts three ways, microseconds a call
(the best of the rounds' medians): `warm`, one layer's cache again and again (in the caches: the
kernel's arithmetic); `cold`, thirty layers' caches called layer after layer after a 64 MB write
(a decode step's case: the weights stream through the caches between one layer's attention and
the next), each sequence's blocks in a run, as the KV manager hands them out while it can;
`scattered`, the same with blocks drawn at random from the pool (a pool after much coming and
going). An empty --decode-contexts leaves it out.

A third table times decode steps of many sequences, --decode-batches (sequences x tokens of
context each, within a tenth either way), as the engine lays them out: the pool of
ember.engine.attention.KVCache (groups of blocks on huge pages), the blocks handed out by the
engine's KV manager to 128-token prompts admitted in turn and then decoded side by side, the
model's 30 layers called one after another, each after a read of 4 MB of its own (the layer's
weights, as a step reads them between one layer's attention and the next). Milliseconds a step for
the 30 layers (the median of the rounds, the two alternating) and the median of the per-round
ratios, this tree over the other.

Two builds of nearly the same source can differ by up to a tenth in these tables from where the
compiler placed their code alone (docs/benchmarks.md, 2026-12-07): a change that only shows up
as a few percent here is measured again with a switch inside one build before it is believed.

A fourth table times the rotary embedding with the cache store (rotary_store_) for --store-rows rows
of one sequence, from a position at a block's start and from one inside a block (angles on the unit
circle, so rotating in place keeps the values' size), microseconds a call in alternation, with
whether q and the cache come out with the same bits. An empty --store-rows leaves it out."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from ember import kernels

HEADS, KV_HEADS, HEAD_DIM, LAYERS, CHUNK_ROWS, BLOCK = 9, 3, 64, 30, 512, 16
POOL_BLOCKS = 1200  # the decode table's pool of blocks per layer (19,200 tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the other version of ember/kernels/attention.cpp")
    parser.add_argument("--prompt", type=int, default=4000, help="prompt length in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-contexts", default="128,256,512,1024,2048",
                        help="contexts of the decode table (empty: none)")
    parser.add_argument("--decode-batches", default="32x250,64x128,8x1000,1x8000,4x100",
                        help="SEQUENCESxCONTEXT decode steps of the batch table (empty: none)")
    parser.add_argument("--store-rows", default="1,8,9,16,24,32,256", help="rows of the store table (empty: none)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.decode_contexts.split(",")] if args.decode_contexts else []
    if contexts and max(contexts) > POOL_BLOCKS * BLOCK:  # a longer row's table would reach past the pool
        raise SystemExit(f"--decode-contexts: at most {POOL_BLOCKS * BLOCK} tokens")
    assert kernels.available(), kernels.status()
    ops = {"this tree": torch.ops.ember, "other": kernels.kernel_copy(args.other, "ember_attention_other")}
    if hasattr(ops["other"], "attention_tiles"):  # one bfloat16 path for both (EMBER_ATTENTION_TILES=0: dot products)
        ops["other"].attention_tiles(torch.ops.ember.attention_tiles(None))
    generator = torch.Generator().manual_seed(0)
    length = args.prompt
    num_blocks = length // BLOCK + 1
    k_cache, v_cache = (torch.randn(KV_HEADS, num_blocks, BLOCK * HEAD_DIM, generator=generator).bfloat16()
                        for _ in range(2))
    q = torch.randn(length, HEADS, HEAD_DIM, generator=generator).bfloat16()
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    scale = HEAD_DIM ** -0.5

    def attend(op, first: int, rows: torch.Tensor) -> torch.Tensor:
        return op.paged_attention(rows, k_cache, v_cache, table, torch.tensor([0, len(rows)], dtype=torch.int32),
                                  torch.tensor([first], dtype=torch.int32), scale, 0)

    def prompt(op) -> tuple[float, torch.Tensor]:
        began = time.perf_counter()
        out = torch.cat([attend(op, first, q[first:first + CHUNK_ROWS]) for first in range(0, length, CHUNK_ROWS)])
        return time.perf_counter() - began, out

    def decode(op, reps: int = 100) -> tuple[float, torch.Tensor]:
        began = time.perf_counter()
        for _ in range(reps):
            out = attend(op, length - 1, q[-1:])
        return (time.perf_counter() - began) / reps, out

    kernels_of = {"prompt": prompt, "decode row": decode}
    times = {(case, name): [] for case in kernels_of for name in ops}
    outputs = {}
    for round_index in range(args.rounds):
        for name in random.Random(round_index).sample(list(ops), len(ops)):
            for case, run in kernels_of.items():
                seconds, outputs[case, name] = run(ops[name])
                times[case, name].append(seconds)
    print(f"attention of {LAYERS} layers, {HEADS} heads over {KV_HEADS} KV heads, head dim {HEAD_DIM}, bfloat16; "
          f"a {length}-token prompt in chunks of {CHUNK_ROWS} rows, then a decode row at its end")
    print("| case | this tree | other | this tree / other | same bits |")
    print("| --- | --- | --- | --- | --- |")
    for case in kernels_of:
        unit, factor = ("s", 1.0) if case == "prompt" else ("ms", 1e3)
        mine, theirs = times[case, "this tree"], times[case, "other"]
        ratio = statistics.median(a / b for a, b in zip(mine, theirs))
        same = torch.equal(outputs[case, "this tree"], outputs[case, "other"])
        print(f"| {case} | {statistics.median(mine) * LAYERS * factor:.2f} {unit} | "
              f"{statistics.median(theirs) * LAYERS * factor:.2f} {unit} | {ratio:.2f}x | {'yes' if same else 'no'} |")
    if contexts:
        decode_table(ops, contexts, args.rounds)
    if args.decode_batches:
        batch_table(ops, [tuple(int(n) for n in batch.split("x")) for batch in args.decode_batches.split(",")],
                    args.rounds)
    if args.store_rows:
        store_table(ops, [int(rows) for rows in args.store_rows.split(",")], args.rounds * 60)


def time_decode_calls(op, layers, tables, context: int, cold: bool, repeats: int) -> float:
    """Median microseconds of one decode row's attention over `layers` (one (k, v) pair each, with
    its block table), repeated; `cold`: a 64 MB write before each pass."""
    q = torch.randn(1, HEADS, HEAD_DIM).bfloat16()
    row_begin, first_pos = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([context - 1], dtype=torch.int32)
    flush = torch.ones(16 << 20)
    seconds = []
    for _ in range(repeats):
        if cold:
            flush.add_(1.0)
        began = time.perf_counter()
        for (k, v), table in zip(layers, tables):
            op.paged_attention(q, k, v, table, row_begin, first_pos, HEAD_DIM ** -0.5, 0)
        seconds.append((time.perf_counter() - began) / len(layers))
    return statistics.median(seconds) * 1e6


def decode_table(ops: dict, contexts: list[int], rounds: int) -> None:
    generator = torch.Generator().manual_seed(1)
    pool = torch.randn(LAYERS, 2, KV_HEADS, POOL_BLOCKS, BLOCK * HEAD_DIM, generator=generator).bfloat16()
    layers = [(pool[layer, 0], pool[layer, 1]) for layer in range(LAYERS)]
    settings = ("warm", "cold", "scattered")
    print(f"\none decode row, us a call ({torch.get_num_threads()} threads), other / this tree")
    print("| context | " + " | ".join(f"{setting}: other, this tree" for setting in settings) + " |")
    print("| --- |" + " --- |" * len(settings))
    for context in contexts:
        blocks = -(-context // BLOCK)
        in_order = torch.arange(blocks, dtype=torch.int32)[None]
        scattered = [torch.randperm(POOL_BLOCKS, generator=generator)[:blocks].to(torch.int32)[None]
                     for _ in range(LAYERS)]
        cases = {"warm": (layers[:1] * 200, [in_order] * 200, False, 20),
                 "cold": (layers, [in_order] * LAYERS, True, 40),
                 "scattered": (layers, scattered, True, 40)}
        figures = {(setting, name): [] for setting in settings for name in ops}
        for round_index in range(rounds):  # in turn, so the machine's drift falls on both alike
            for name in random.Random(round_index).sample(list(ops), len(ops)):
                for setting, (pairs, tables, cold, repeats) in cases.items():
                    figures[setting, name].append(time_decode_calls(ops[name], pairs, tables, context, cold, repeats))
        cells = []
        for setting in settings:
            theirs, mine = min(figures[setting, "other"]), min(figures[setting, "this tree"])
            cells.append(f"{theirs:.2f}, {mine:.2f} ({theirs / mine:.2f}x)")
        print(f"| {context:,} | " + " | ".join(cells) + " |")


def engine_tables(contexts: list[int], prompt_tokens: int = 128) -> tuple[torch.Tensor, int]:
    """Block tables as the engine's KV manager (keep_runs, as on the CPU) hands blocks out: each
    sequence's prompt of `prompt_tokens` admitted in turn, then a token each in turn until every
    sequence holds its context. Returns the tables and the pool's blocks (block 0 is the null one)."""
    from ember.engine.kv_cache import KVCacheManager
    from ember.engine.request import Request
    from ember.types import SamplingParams

    blocks = sum(-(-context // BLOCK) for context in contexts) * 2 + 1
    kv = KVCacheManager(blocks, BLOCK, enable_prefix_caching=False, keep_runs=True)
    requests = []
    for s, context in enumerate(contexts):
        request = Request(f"s{s}", list(range(min(prompt_tokens, context))), SamplingParams(), max_tokens=1 << 20,
                          eos_token_ids=(), arrival_time=0.0)
        assert kv.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        requests.append(request)
    for _ in range(max(contexts)):
        for request, context in zip(requests, contexts):
            if request.num_tokens < context:
                assert kv.allocate_slots(request, 1)
                request.token_ids.append(0)
                request.num_computed_tokens += 1
    table = torch.zeros(len(contexts), max(len(request.block_ids) for request in requests), dtype=torch.int32)
    for s, request in enumerate(requests):
        table[s, :len(request.block_ids)] = torch.tensor(request.block_ids, dtype=torch.int32)
    return table, blocks


def batch_table(ops: dict, batches: list[tuple[int, int]], rounds: int) -> None:
    from ember.engine.attention import KVCache

    print(f"\ndecode steps of many sequences, {LAYERS} layers, ms a step ({torch.get_num_threads()} threads)")
    print("| sequences x context | this tree | other | this tree / other | same bits |")
    print("| --- | --- | --- | --- | --- |")
    weights = torch.ones(LAYERS, 1 << 20)
    for sequences, context in batches:
        rng = random.Random(sequences * 100_003 + context)
        contexts = [rng.randrange(context * 9 // 10, context * 11 // 10 + 1) for _ in range(sequences)]
        table, blocks = engine_tables(contexts)
        cache = KVCache(LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cpu"),
                        kernel_layout=True)
        cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(3)).bfloat16())
        q = torch.randn(sequences, HEADS, HEAD_DIM).bfloat16()
        row_begin = torch.arange(sequences + 1, dtype=torch.int32)
        first_pos = torch.tensor([c - 1 for c in contexts], dtype=torch.int32)
        times = {name: [] for name in ops}
        outputs = {}
        for round_index in range(rounds):
            for name in random.Random(round_index).sample(list(ops), len(ops)):
                seconds = 0.0
                for layer, (k_cache, v_cache) in enumerate(cache.layers):
                    weights[layer].sum()
                    began = time.perf_counter()
                    outputs[name] = ops[name].paged_attention(q, k_cache, v_cache, table, row_begin, first_pos,
                                                              HEAD_DIM ** -0.5, 0)
                    seconds += time.perf_counter() - began
                times[name].append(seconds)
        mine, theirs = times["this tree"], times["other"]
        ratio = statistics.median(a / b for a, b in zip(mine, theirs))
        same = torch.equal(outputs["this tree"], outputs["other"])
        print(f"| {sequences} x {context} | {statistics.median(mine) * 1e3:.2f} | "
              f"{statistics.median(theirs) * 1e3:.2f} | {ratio:.3f}x | {'yes' if same else 'no'} |")


def store_table(ops: dict, row_counts: list[int], calls: int) -> None:
    generator = torch.Generator().manual_seed(2)
    print(f"\nrotary_store_, us a call ({torch.get_num_threads()} threads)")
    print("| rows | first position | this tree | other | this tree / other | same bits |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in row_counts:
        for first in (304, 300):
            qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).bfloat16()
            angles = torch.rand(rows, HEAD_DIM // 2, generator=generator) * 6.3
            cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
            slots = torch.arange(first, first + rows)
            caches = {name: [torch.zeros(KV_HEADS, (first + rows) // BLOCK + 1, BLOCK * HEAD_DIM, dtype=torch.bfloat16)
                             for _ in range(2)] for name in ops}
            outputs = {}
            for name, op in ops.items():
                rotated = qkv.clone()
                op.rotary_store_(rotated, cos, sin, *caches[name], slots, HEADS, KV_HEADS)
                outputs[name] = torch.cat([rotated.flatten(), *(cache.flatten() for cache in caches[name])])
            times = {name: [] for name in ops}
            for _ in range(calls):
                for name, op in ops.items():
                    began = time.perf_counter()
                    op.rotary_store_(qkv, cos, sin, *caches[name], slots, HEADS, KV_HEADS)
                    times[name].append(time.perf_counter() - began)
            mine, theirs = (statistics.median(times[name]) * 1e6 for name in ("this tree", "other"))
            same = torch.equal(outputs["this tree"].view(torch.int16), outputs["other"].view(torch.int16))
            print(f"| {rows} | {first} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
