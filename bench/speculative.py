"""Speculative decoding against plain decoding, engine-level, all numbers from one run.

    python bench/speculative.py [--output-len 128] [--rounds 3] [--no-draft-model]
                                [--prompts FILE] [--sets repetitive,chat]

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
Each mode runs the same greedy requests. A round runs the modes of one model at once (plain and
ngram; then the two bfloat16 ones), a step of each in turn (in a new random order each pass),
each timed on a clock of its own steps, so drift on a shared machine falls on both alike, and
neither reads its weights from caches another model has just filled with its own; a row's ratio
is the median of the rounds' ratios to the plain engine of the same model and round, its tok/s
the median of its rounds.
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
import random
import statistics
import time
from dataclasses import replace

from ember import LLM, SamplingParams
from ember.config import MAX_TUNED_DRAFT_TOKENS, SpeculativeConfig
from ember.engine.core import EngineCore
from ember.engine.loading import BuiltModel, load_model
from ember.engine.spec.ngram import NgramIndex
from ember.types import SpeculationCounts

PROMPTS = pathlib.Path(__file__).parent / "speculative_prompts.json"
SETTINGS = dict(max_model_len=2048, kv_cache_tokens=48 * 1024)
_PASSES = 3  # at 8 streams, each set's prompts this many times over


def engine_like(llm: LLM, speculative: SpeculativeConfig, draft: BuiltModel | None = None) -> EngineCore:
    base = llm.engine
    return EngineCore(base.runner.model, base.model_config, replace(base.config, speculative=speculative),
                      set(base.eos_token_ids), base.device, base.dtype, draft)


class Run:
    """One mode's run over a prompt set, advanced a step at a time so that every mode's steps
    interleave: drift on a shared machine then falls on all modes alike. Its clock counts only
    its own steps (and the admissions between them)."""

    def __init__(self, engine: EngineCore, prompts: list[list[int]], streams: int, max_tokens: int) -> None:
        self.engine, self.prompts = engine, prompts
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.clock = 0.0
        self.replies: dict[str, list[int]] = {}
        self.first_token_at: dict[str, float] = {}
        self.last_token_at: dict[str, float] = {}
        self.steps: dict[str, int] = {}  # steps that gave the request tokens
        self.counts = SpeculationCounts()
        self.waiting = list(enumerate(prompts))[::-1]
        engine.kv_manager.reset_prefix_cache()
        began = time.perf_counter()
        for _ in range(min(streams, len(self.waiting))):
            self._admit()
        self.clock += time.perf_counter() - began

    def _admit(self) -> None:
        i, prompt = self.waiting.pop()
        self.engine.add_request(f"p{i}", prompt, self.params)
        self.replies[f"p{i}"] = []

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def step(self) -> None:
        began = time.perf_counter()
        for step in self.engine.step():
            now = self.clock + time.perf_counter() - began
            self.replies[step.request_id] += step.new_token_ids
            self.first_token_at.setdefault(step.request_id, now)
            self.last_token_at[step.request_id] = now
            self.steps[step.request_id] = self.steps.get(step.request_id, 0) + 1
            if step.num_drafted_tokens:
                self.counts.add(step.num_drafted_tokens, step.num_accepted_tokens)
            if step.finish_reason is not None and self.waiting:  # the stream sends its next request
                self._admit()
        self.clock += time.perf_counter() - began

    def result(self):
        """(output tokens per second, decode tokens per second of one stream, decode tokens a step,
        replies' tokens). The decode figures leave out each reply's first token and the time
        before it (the prefill), as llama.cpp's predicted_per_second does."""
        self.engine.check_invariants()
        tokens = [self.replies[f"p{i}"] for i in range(len(self.prompts))]
        decode_seconds = sum(self.last_token_at[r] - self.first_token_at[r] for r in self.replies)
        decode_tokens = sum(len(t) - 1 for t in tokens)
        tokens_a_step = decode_tokens / max(sum(self.steps.values()) - len(self.steps), 1)
        return sum(map(len, tokens)) / self.clock, decode_tokens / decode_seconds, tokens_a_step, tokens


def run_together(engines: dict[str, EngineCore], prompts: list[list[int]], streams: int, max_tokens: int,
                 seed: int) -> dict[str, Run]:
    """Every mode's run over the same prompts, a step of each in turn until all end, in a new
    random order each pass (seeded), so that no mode always follows the same one (whose weights it
    would find in the cache, or whose threads still spinning)."""
    shuffle = random.Random(seed).shuffle
    runs = {name: Run(engine, prompts, streams, max_tokens) for name, engine in engines.items()}
    order = list(runs)
    while not all(run.done for run in runs.values()):
        shuffle(order)
        for name in order:
            if not runs[name].done:
                runs[name].step()
    return runs


def lookup_ceiling(prompts: list[list[int]], replies: list[list[int]]) -> float:
    """Decode tokens a step that n-gram lookup (the default suffix lengths) would make if it always
    drafted the longest draft that holds, up to the tuned most, and verifying cost nothing: what the
    text allows, before the row cost and the tuning take their share."""
    config = SpeculativeConfig(mode="ngram")
    tokens = steps = 0
    for prompt, reply in zip(prompts, replies):
        index, i = NgramIndex(config.ngram_min, config.ngram_max), 1  # the first token is the prefill's
        while i < len(reply):
            drafts, _ = index.propose(prompt + reply[:i], MAX_TUNED_DRAFT_TOKENS)
            held = [a == b for a, b in zip(drafts, reply[i:])] + [False]
            kept = held.index(False)
            i, steps = i + kept + 1, steps + 1
        tokens += len(reply) - 1
    return tokens / max(steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-draft-model", action="store_true")
    parser.add_argument("--prompts", type=pathlib.Path, default=PROMPTS,
                        help="a JSON object of prompt sets, each a list of user messages (default: the shipped sets)")
    parser.add_argument("--sets", help="the sets to run, comma-separated (default: all in the file)")
    args = parser.parse_args()
    prompt_sets = json.loads(args.prompts.read_text())
    if args.sets:
        prompt_sets = {name: prompt_sets[name] for name in args.sets.split(",")}

    llm = LLM(**SETTINGS)
    groups = [{"plain": llm.engine, "ngram": engine_like(llm, SpeculativeConfig(mode="ngram"))}]
    if not args.no_draft_model:
        dense = LLM(quantization="none", **SETTINGS)
        draft = load_model(llm.source, replace(llm.engine.config, batch_invariant=False))
        groups.append({"bf16 plain": dense.engine,
                       "bf16 + draft": engine_like(dense, SpeculativeConfig(mode="draft", draft_model="4-bit copy"),
                                                   draft)})
    engines = {name: engine for group in groups for name, engine in group.items()}
    encoded = {name: [llm.encode_prompt([{"role": "user", "content": text}]) for text in texts]
               for name, texts in prompt_sets.items()}
    print(f"output {args.output_len} tokens, greedy, {args.rounds} rounds; median tok/s (median ratio to "
          f"its plain engine), mean accepted length")
    for set_name, prompts in encoded.items():
        for streams in (1, 8):
            batch = prompts * (1 if streams == 1 else _PASSES)
            speeds: dict[str, list[float]] = {name: [] for name in engines}
            decode_speeds: dict[str, list[float]] = {name: [] for name in engines}
            seen: dict[str, tuple] = {}
            for round_index in range(args.rounds):
                runs = {}
                for group in groups:
                    runs |= run_together(group, batch, streams, args.output_len, seed=round_index)
                for name, mode_run in runs.items():
                    speed, decode_speed, tokens_a_step, tokens = mode_run.result()
                    speeds[name].append(speed)
                    decode_speeds[name].append(decode_speed)
                    seen[name] = (tokens, mode_run.counts, tokens_a_step)
            print(f"  {set_name:10s} {streams} stream{'s' if streams > 1 else ' '}  lookup with free verification: "
                  f"{lookup_ceiling(batch, seen['plain'][0]):.2f} tokens a decode step", flush=True)
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
