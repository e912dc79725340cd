"""Decode speed on a pool that has been in use a while, its requests' blocks in runs or strewn.

    python bench/kv_runs.py [--streams 32] [--context 1024] [--decode 64] [--pool-tokens 40960]
        [--churn-tokens 400000] [--rounds 3]

A fresh pool hands a request consecutive blocks; one that has served for a while holds cached
prefixes in every block, taken back in the order they were freed, so without care a request's
blocks lie all over it. Two engines of the default model share its weights, one with the KV
manager's keep_runs (the engine's default on the CPU), one without. Each serves the same churn
first (--churn-tokens of prompts at 16 streams: conversations that go on, with a shared system
prompt, and others that do not, short replies), which leaves every free block holding a cached
prefix. Then both decode the same --streams requests of --context new tokens each, a step of
each in turn, in a new random order each step, --rounds times over; the first --decode steps
in which every stream decodes are timed.

Printed: the share of consecutive block pairs in the decoding requests' tables, the cached blocks
whose data the keep_runs engine moved (and the seconds its copies took), each engine's decode
tokens per second over the steps where every stream decodes (the median of the rounds), and the
ratio. Both engines' replies are checked to be the same token for token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from speculative import engine_like

from ember import SamplingParams
from ember.engine.core import EngineCore
from ember.llm import LLM

SYSTEM_TOKENS = 400


def tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(count)]


def churn(engine: EngineCore, total_tokens: int, vocab: int, seed: int) -> None:
    """Serve prompts of total_tokens at 16 streams, as a server might: half of them go on an earlier
    conversation (its prompt and reply, then a new turn), most of the rest start with one system prompt."""
    rng = random.Random(seed)
    system = tokens(rng, SYSTEM_TOKENS, vocab)
    finished: list[list[int]] = []
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sent, live, count = 0, {}, 0
    while sent < total_tokens or live:
        while sent < total_tokens and len(live) < 16:
            if finished and rng.random() < 0.5:
                prompt = rng.choice(finished[-200:]) + tokens(rng, rng.randrange(20, 200), vocab)
            else:
                prompt = (system if rng.random() < 0.7 else []) + tokens(rng, rng.randrange(50, 800), vocab)
            if len(prompt) > 1800:
                prompt = prompt[-1800:]
            count += 1
            live[f"c{count}"] = prompt
            engine.add_request(f"c{count}", prompt, params)
            sent += len(prompt)
        for output in engine.step():
            live[output.request_id] = live[output.request_id] + list(output.new_token_ids)
            if output.finish_reason is not None:
                finished.append(live.pop(output.request_id))


def contiguity(engine: EngineCore) -> float:
    tables = [r.block_ids for r in engine.scheduler.running]
    pairs = [(a, b) for table in tables for a, b in zip(table, table[1:])]
    return sum(b == a + 1 for a, b in pairs) / max(len(pairs), 1)


def decode_round(engines: dict[str, EngineCore], prompts: list[list[int]], decode: int, seed: int):
    """Each engine's decode tokens a second over its first `decode` steps in which every stream
    decodes (the requests are ended after them), the replies, and each one's block contiguity at
    the first such step."""
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # up to the context window
    replies = {name: {} for name in engines}
    for name, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{seed}-{i}", prompt, params)
            replies[name][f"r{seed}-{i}"] = []
    seconds = dict.fromkeys(engines, 0.0)
    steps = dict.fromkeys(engines, 0)
    runs = {}
    order = list(engines)
    shuffle = random.Random(seed).shuffle
    while any(count < decode for count in steps.values()):
        shuffle(order)
        for name in order:
            engine = engines[name]
            if steps[name] == decode:
                continue
            decoding = all(replies[name].values())  # every request has its first token
            if decoding and name not in runs:
                runs[name] = contiguity(engine)
            began = time.perf_counter()
            outputs = engine.step()
            spent = time.perf_counter() - began
            if decoding:
                assert len(outputs) == len(prompts), "a stream did not decode"
                seconds[name] += spent
                steps[name] += 1
            for output in outputs:
                replies[name][output.request_id] += output.new_token_ids
            if steps[name] == decode:
                engine.abort(list(replies[name]))
    for engine in engines.values():
        engine.check_invariants()
    return {name: decode * len(prompts) / seconds[name] for name in engines}, replies, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024, help="each decoding request's prompt tokens")
    parser.add_argument("--decode", type=int, default=64, help="steps timed, every stream decoding")
    parser.add_argument("--pool-tokens", type=int, default=40960)
    parser.add_argument("--churn-tokens", type=int, default=400000, help="about ten turns of the default pool")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(max_model_len=4096, kv_cache_tokens=args.pool_tokens, cache_ram_mb=0)
    runs = llm.engine
    strewn = engine_like(llm, runs.config.speculative)  # a second pool beside the same weights
    strewn.kv_manager.keep_runs = False
    engines = {"keep_runs": runs, "without": strewn}
    vocab = runs.model_config.vocab_size
    copy_seconds = [0.0]
    copy_blocks = runs.runner.cache.copy_blocks

    def timed_copy(sources: dict[int, int]) -> None:
        began = time.perf_counter()
        copy_blocks(sources)
        copy_seconds[0] += time.perf_counter() - began

    runs.runner.cache.copy_blocks = timed_copy
    began = time.perf_counter()
    for engine in engines.values():
        churn(engine, args.churn_tokens, vocab, seed=0)
    print(f"churn: {time.perf_counter() - began:.0f} s for both; keep_runs moved {runs.kv_manager.blocks_relocated} "
          f"cached blocks in {copy_seconds[0]:.2f} s")
    rng = random.Random(1)
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        prompts = [tokens(rng, args.context, vocab) for _ in range(args.streams)]
        moved, copied = runs.kv_manager.blocks_relocated, copy_seconds[0]
        speed, replies, contiguous = decode_round(engines, prompts, args.decode, seed=round_)
        assert replies["keep_runs"] == replies["without"], "the replies differ"
        for name in engines:
            speeds[name].append(speed[name])
        print(f"round {round_ + 1}: consecutive block pairs {contiguous['keep_runs']:.1%} with keep_runs, "
              f"{contiguous['without']:.1%} without; blocks moved {runs.kv_manager.blocks_relocated - moved} "
              f"in {copy_seconds[0] - copied:.3f} s; "
              f"decode {speed['keep_runs']:.1f} against {speed['without']:.1f} tok/s "
              f"({speed['keep_runs'] / speed['without']:.2f}x)")
    median = {name: statistics.median(values) for name, values in speeds.items()}
    print(f"{args.streams} streams at {args.context} tokens, median of {args.rounds} rounds: keep_runs "
          f"{median['keep_runs']:.1f} tok/s, without {median['without']:.1f} tok/s, "
          f"{median['keep_runs'] / median['without']:.2f}x")


if __name__ == "__main__":
    main()
