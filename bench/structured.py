"""Structured outputs against plain decoding, offline on the engine, in one run.

    python bench/structured.py [--model PATH] [--concurrency 16] [--input-len 64] [--output-len 128]

Runs N concurrent requests held to a JSON schema, then the same N prompts unconstrained, each group
decoding exactly --output-len tokens (the schema asks for more items than fit, and the plain group
ignores end tokens), and prints the aggregate output tokens per second of each (best of three,
interleaved so a noisy neighbour hits both) and the ratio. The grammar is compiled before the clock
starts, as the server compiles it before admitting a request.
"""

from __future__ import annotations

import argparse
import time

from ember import SamplingParams
from ember.grammar.compiler import Grammars
from ember.grammar.constraint import GrammarConstraint
from ember.llm import LLM
from ember.protocols.structured import json_schema_spec

REPEATS = 3
SCHEMA = {  # long enough that no reply completes it within --output-len
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "readings": {"type": "array", "minItems": 200, "items": {
            "type": "object",
            "properties": {"station": {"type": "string", "maxLength": 16},
                           "celsius": {"type": "number", "minimum": -60, "maximum": 60},
                           "ok": {"type": "boolean"},
                           "kind": {"enum": ["rain", "snow", "sun", "fog"]}},
            "required": ["station", "celsius", "ok", "kind"]}},
    },
    "required": ["title", "readings"],
}


def prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    text = "Weather stations report their readings every hour, from the coast to the mountains. " * 32
    base = llm.tokenizer.encode(text)
    ask = llm.tokenizer.encode(" List the readings as JSON.")
    # Rotated starts, so the prefix cache cannot serve one prompt from another.
    return [(base[i:] + base[:i])[: length - len(ask)] + ask for i in range(1, count + 1)]


def run(llm: LLM, batch: list[list[int]], params: SamplingParams, make_constraint) -> float:
    """Aggregate output tokens per second of the batch, run to the end."""
    llm.engine.kv_manager.reset_prefix_cache()
    for i, prompt in enumerate(batch):
        llm.engine.add_request(f"bench-{i}", prompt, params, constraint=make_constraint())
    produced = 0
    start = time.perf_counter()
    while llm.engine.has_unfinished():
        for step in llm.engine.step():
            produced += len(step.new_token_ids)
            if step.error:
                raise RuntimeError(step.error)
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=1024, kv_cache_tokens=64 * 1024)
    engine = llm.engine
    grammars = Grammars(llm.tokenizer.hf, engine.model_config.vocab_size, engine.eos_token_ids)
    compiled = grammars.compile(json_schema_spec(SCHEMA, "bench"))

    def constrained() -> GrammarConstraint:
        return GrammarConstraint(grammars.matcher(compiled), grammars.vocab_size, llm.tokenizer.token_bytes,
                                 grammars.stop_token_ids)

    batch = prompts(llm, args.concurrency, args.input_len)
    plain_params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    json_params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    run(llm, batch[:2], SamplingParams(temperature=0.0, max_tokens=8), constrained)  # warm-up
    best = {"plain": 0.0, "json_schema": 0.0}
    for _ in range(REPEATS):
        best["plain"] = max(best["plain"], run(llm, batch, plain_params, lambda: None))
        best["json_schema"] = max(best["json_schema"], run(llm, batch, json_params, constrained))
    print(f"{args.concurrency} concurrent requests, {args.input_len} prompt tokens, {args.output_len} output tokens each "
          f"(best of {REPEATS})")
    print(f"  unconstrained   {best['plain']:8.1f} output tok/s")
    print(f"  json_schema     {best['json_schema']:8.1f} output tok/s")
    print(f"  ratio           {best['json_schema'] / best['plain']:8.1%}")


if __name__ == "__main__":
    main()
