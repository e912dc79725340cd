"""Weights on huge pages against the same weights on ordinary pages, one engine, one run.

    python bench/huge_pages.py [--rounds 3] [--output-len 128]

The engine keeps its block-quantized weights in one region on 2 MiB pages
(ember.engine.host_memory). This benchmark makes a second copy of them in torch's ordinary
allocations and, before every step, picks one of the two at random for the model to read, so
both see the same requests, the same cache and the same drift of a shared machine (the copies
hold the same bytes, so the replies do not depend on the pick). It reports each copy's median
time for the decode steps of a full batch (1 stream; 8 streams) and their ratio.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

from ember import LLM, SamplingParams
from ember.models.layers import block_weights

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.",
           "List five uses of a paperclip.", "Describe a sunrise over the mountains.",
           "What is the capital of France, and why is it famous?", "Tell me a fact about octopuses.",
           "How does a bicycle stay upright?", "Give three tips for writing clear code."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()

    llm = LLM(max_model_len=2048, kv_cache_tokens=16 * 1024)
    engine, weights = llm.engine, block_weights(llm.engine.runner.model)
    copies = {"huge pages": [w.packed for w in weights], "ordinary pages": [w.packed.clone() for w in weights]}
    times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    execute, pick = engine.runner.execute, random.Random(0).choice

    def timed(scheduled):
        name = pick(list(copies))
        for holder, packed in zip(weights, copies[name]):
            holder.packed = packed
        began = time.perf_counter()
        result = execute(scheduled)
        times[(name, sum(s.num_new_tokens for s in scheduled))].append(time.perf_counter() - began)
        return result

    engine.runner.execute = timed
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    prompts = [llm.encode_prompt([{"role": "user", "content": text}]) for text in PROMPTS]
    for streams in (1, 8):
        times.clear()
        for round_index in range(args.rounds):
            for start in range(0, len(prompts), streams):
                for i, prompt in enumerate(prompts[start:start + streams]):
                    engine.add_request(f"r{streams}-{round_index}-{start + i}", prompt, params)
                while engine.has_unfinished():
                    engine.step()
        rows = streams  # the decode steps of a full batch
        huge, ordinary = times[("huge pages", rows)], times[("ordinary pages", rows)]
        print(f"{streams} stream{'s' if streams > 1 else ' '}: decode step of {rows} row{'s' if rows > 1 else ' '} "
              f"on huge pages {statistics.median(huge) * 1e3:6.2f} ms ({len(huge)} steps), on ordinary pages "
              f"{statistics.median(ordinary) * 1e3:6.2f} ms ({len(ordinary)} steps): "
              f"{statistics.median(huge) / statistics.median(ordinary):.3f}x the time", flush=True)


if __name__ == "__main__":
    main()
