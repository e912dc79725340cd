"""Speculative decoding against plain decoding, engine-level, all numbers from one run.

    python bench/speculative.py [--output-len 128] [--rounds 2] [--no-draft-model]

Two prompt sets ship beside this script (speculative_prompts.json): repetitive work (editing
code, quoting the input) and free chat. For each set, at 1 stream (one prompt at a time) and 8
streams (8 requests in flight: each stream sends its next request as its last one ends, through
the set three times over, as a serving benchmark's fixed concurrency does; a batch that waited
for its slowest reply would measure that reply alone), it measures output tokens per second of:
  plain     the default model, speculation off
  ngram     the same engine with n-gram lookup (`--speculate ngram`, draft length tuned)
  draft     (unless --no-draft-model) the default model in bfloat16 (`--quantization none`)
            drafted by its own 4-bit GGUF file (`--speculate draft`), against that bfloat16 model
            plain: the draft is a quantized copy, the fair draft for a model this small
Each mode runs the same greedy requests; every round runs each mode once, in an order that turns
each round, so drift on a shared machine falls on all of them; a row's ratio is the median of
the rounds' ratios to the plain engine of the same round, its tok/s the median of its rounds.
Two speeds: output tokens per second of the whole run (prefill included), and one stream's decode
speed (each reply's tokens after its first over the time from its first token to its last).
Every drafted reply is checked to equal its plain reply token for token; the mean accepted length
is tokens gained per verified round, and tokens a decode step (all steps, drafted or not) bounds
what drafting could give if verifying were free.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from dataclasses import replace

from ember import LLM, SamplingParams
from ember.config import SpeculativeConfig
from ember.engine.core import EngineCore
from ember.engine.spec.draft_model import DraftModelProposer
from ember.types import SpeculationCounts

PROMPTS = json.loads((pathlib.Path(__file__).parent / "speculative_prompts.json").read_text())
SETTINGS = dict(max_model_len=2048, kv_cache_tokens=48 * 1024)
_PASSES = 3  # at 8 streams, each set's prompts this many times over


def engine_like(llm: LLM, speculative: SpeculativeConfig, draft: DraftModelProposer | None = None) -> EngineCore:
    base = llm.engine
    return EngineCore(base.runner.model, base.model_config, replace(base.config, speculative=speculative),
                      set(base.eos_token_ids), base.device, base.dtype, draft)


def run(engine: EngineCore, prompts: list[list[int]], streams: int, max_tokens: int):
    """(output tokens per second, decode tokens per second of one stream, decode tokens a step,
    replies' tokens, their speculation counts together). The decode figures leave out each reply's
    first token and the time before it (the prefill), as llama.cpp's predicted_per_second does."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.kv_manager.reset_prefix_cache()
    replies: dict[str, list[int]] = {}
    first_token_at: dict[str, float] = {}
    last_token_at: dict[str, float] = {}
    steps: dict[str, int] = {}  # steps that gave the request tokens
    counts = SpeculationCounts()
    began = time.perf_counter()
    waiting = list(enumerate(prompts))[::-1]

    def admit() -> None:
        i, prompt = waiting.pop()
        engine.add_request(f"p{i}", prompt, params)
        replies[f"p{i}"] = []

    for _ in range(min(streams, len(waiting))):
        admit()
    while engine.has_unfinished():
        for step in engine.step():
            replies[step.request_id] += step.new_token_ids
            now = time.perf_counter()
            first_token_at.setdefault(step.request_id, now)
            last_token_at[step.request_id] = now
            steps[step.request_id] = steps.get(step.request_id, 0) + 1
            if step.num_drafted_tokens:
                counts.add(step.num_drafted_tokens, step.num_accepted_tokens)
            if step.finish_reason is not None and waiting:  # the stream sends its next request
                admit()
    seconds = time.perf_counter() - began
    engine.check_invariants()
    tokens = [replies[f"p{i}"] for i in range(len(prompts))]
    decode_seconds = sum(last_token_at[r] - first_token_at[r] for r in replies)
    decode_tokens = sum(len(t) - 1 for t in tokens)
    tokens_a_step = decode_tokens / max(sum(steps.values()) - len(steps), 1)
    return sum(map(len, tokens)) / seconds, decode_tokens / decode_seconds, tokens_a_step, tokens, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-draft-model", action="store_true")
    args = parser.parse_args()

    llm = LLM(**SETTINGS)
    engines = {"plain": llm.engine, "ngram": engine_like(llm, SpeculativeConfig(mode="ngram"))}
    if not args.no_draft_model:
        dense = LLM(quantization="none", **SETTINGS)
        draft = DraftModelProposer(EngineCore.from_source(llm.source, replace(llm.engine.config, batch_invariant=False)))
        engines["bf16 plain"] = dense.engine
        engines["bf16 + draft"] = engine_like(dense, SpeculativeConfig(mode="draft", draft_model="4-bit copy"), draft)
    encoded = {name: [llm.encode_prompt([{"role": "user", "content": text}]) for text in texts]
               for name, texts in PROMPTS.items()}
    print(f"output {args.output_len} tokens, greedy, {args.rounds} rounds; median tok/s (median ratio to "
          f"its plain engine), mean accepted length")
    for set_name, prompts in encoded.items():
        for streams in (1, 8):
            batch = prompts * (1 if streams == 1 else _PASSES)
            speeds: dict[str, list[float]] = {name: [] for name in engines}
            decode_speeds: dict[str, list[float]] = {name: [] for name in engines}
            seen: dict[str, tuple] = {}
            names = list(engines)
            for round_index in range(args.rounds):
                turn = round_index % len(names)
                for name in names[turn:] + names[:turn]:
                    speed, decode_speed, tokens_a_step, tokens, counts = run(engines[name], batch, streams,
                                                                             args.output_len)
                    speeds[name].append(speed)
                    decode_speeds[name].append(decode_speed)
                    seen[name] = (tokens, counts, tokens_a_step)
            for name in engines:
                baseline = "bf16 plain" if name.startswith("bf16") else "plain"
                tokens, counts, tokens_a_step = seen[name]
                same = "" if tokens == seen[baseline][0] else "  REPLIES DIFFER"
                accepted = f", accepted length {counts.mean_accepted_length:.2f}" if counts.rounds else ""
                accepted += f", {tokens_a_step:.2f} tokens a decode step"
                ratio = statistics.median(a / b for a, b in zip(speeds[name], speeds[baseline]))
                decode_ratio = statistics.median(a / b for a, b in zip(decode_speeds[name], decode_speeds[baseline]))
                print(f"  {set_name:10s} {streams} stream{'s' if streams > 1 else ' '}  {name:13s} "
                      f"{statistics.median(speeds[name]):7.1f} tok/s ({ratio:.2f}x; one stream's decode "
                      f"{statistics.median(decode_speeds[name]):6.1f} tok/s, {decode_ratio:.2f}x){accepted}{same}",
                      flush=True)


if __name__ == "__main__":
    main()
