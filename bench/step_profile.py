"""Where one stream's decode step goes, against the machine's read bound: the step profile that
tells what stands between a step and its weight bytes.

    python bench/step_profile.py [--model PATH] [--context 128] [--steps 300] [--threads N] [--json FILE]

One process, the engine alone (no HTTP), one greedy request: its prompt of --context tokens is
prefilled, then --steps decode steps are timed. Each step is split by timing the engine's own
calls (perf_counter around them; the step's other work is the remainder):

    schedule   the scheduler's plan for the step (Scheduler.schedule)
    prepare    the step's input tensors: ids, positions, block tables (ModelRunner.prepare)
    layers     the token embedding, every decoder layer and the final norm (the model's forward)
    lm head    the sampled row's logits over the whole vocabulary (Model.compute_logits)
    sample     the sampler (ModelRunner._sample)
    update     the scheduler's bookkeeping of the new token (Scheduler.update_from_output)
    other      the rest of EngineCore.step (outputs, counters, the KV tiers' moves)

Beside each weight-reading part, its bound: its weight bytes over the machine's read bandwidth
(ember.bench.machine_probe, on the engine's thread count); the layers' bound counts as well the
keys and values their attention reads, at the timed steps' mean context. The front end (HTTP, detokenizing,
streaming) is not in this profile: `ember bench` against a server measures the whole path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from ember import SamplingParams
from ember.bench.limits import cache_bytes_read
from ember.bench.machine_probe import probe
from ember.engine.weight_footprint import weight_footprint
from ember.llm import LLM

PARTS = ("schedule", "prepare", "layers", "lm head", "sample", "update", "other")


class StepClock:
    """Seconds per part of the decode steps it is told to watch."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.watching = False

    def timed(self, part: str, call):
        def run(*args, **kwargs):
            began = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if self.watching:
                    self.seconds[part].append(time.perf_counter() - began)
        return run


class TimedModel:
    """The runner's model with its forward and its logits timed; every other attribute as it is."""

    def __init__(self, model, clock: StepClock) -> None:
        self._model = model
        self._forward = clock.timed("layers", model.__call__)
        self.compute_logits = clock.timed("lm head", model.compute_logits)

    def __call__(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def profile(llm: LLM, context: int, steps: int) -> dict:
    core = llm.engine
    clock = StepClock()
    runner, scheduler = core.runner, core.scheduler
    model = runner.model
    runner.model = TimedModel(model, clock)
    runner.prepare = clock.timed("prepare", runner.prepare)
    runner._sample = clock.timed("sample", runner._sample)
    scheduler.schedule = clock.timed("schedule", scheduler.schedule)
    scheduler.update_from_output = clock.timed("update", scheduler.update_from_output)
    sentence = llm.tokenizer.encode("The keeper of the lighthouse wrote down the weather every hour of the night. ")
    prompt = (sentence * (context // len(sentence) + 1))[:context]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    llm.generate([prompt[:32]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))  # warm-up
    core.add_request("profiled", prompt, params)
    core.step()
    while core.scheduler.running[0].num_computed_tokens < len(prompt):
        core.step()  # the prompt, not timed
    core.step()  # the first decode step settles shapes
    whole = []
    clock.watching = True
    for _ in range(steps):
        began = time.perf_counter()
        core.step()
        whole.append(time.perf_counter() - began)
    clock.watching = False
    core.abort(["profiled"])
    medians = {part: statistics.median(values) for part, values in clock.seconds.items()}
    step = statistics.median(whole)
    medians["other"] = max(step - sum(medians.get(part, 0.0) for part in PARTS if part != "other"), 0.0)
    return {"step_seconds": step, "tokens_per_s": 1 / step, "parts": medians, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="what to load (default: the default model)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=300, help="decode steps timed")
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=max(1024, args.context + args.steps + 64), num_threads=args.threads)
    limits = probe()
    model = llm.engine.runner.model
    total = weight_footprint(model).num_bytes
    head = weight_footprint(model.lm_head).num_bytes
    result = profile(llm, args.context, args.steps)
    read = limits.read_gb_per_s * 1e9
    core, config = llm.engine, llm.engine.model_config
    per_key = core.kv_cache_bytes / core.kv_capacity_tokens / config.num_hidden_layers  # the cache's own dtype
    cache = cache_bytes_read(config.layer_windows, config.num_hidden_layers, per_key, args.context + args.steps // 2)
    bounds = {"layers": (total - head + cache) / read, "lm head": head / read}
    step = result["step_seconds"]
    print(f"{limits.describe()}")
    bound = (total + cache) / read
    print(f"weights read per token: {total / 1e6:.1f} MB (LM head {head / 1e6:.1f} MB), keys and values "
          f"{cache / 1e6:.1f} MB; bound {bound * 1e3:.3f} ms a step, {1 / bound:.0f} tok/s")
    print(f"one stream, context {args.context}: {step * 1e3:.3f} ms a step (median of {args.steps}), "
          f"{1 / step:.1f} tok/s = {bound / step:.0%} of the read bound")
    print(f"{'part':<10} {'ms':>8} {'share':>7} {'bound ms':>9} {'of bound':>9}")
    for part in PARTS:
        seconds = result["parts"].get(part, 0.0)
        bound = bounds.get(part)
        extra = f"{bound * 1e3:>9.3f} {bound / seconds:>9.0%}" if bound and seconds else f"{'':>9} {'':>9}"
        print(f"{part:<10} {seconds * 1e3:>8.3f} {seconds / step:>7.1%} {extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "limits": limits.to_json(), "weight_bytes": total, "lm_head_bytes": head,
                       "cache_bytes": cache,
                       "threads": torch.get_num_threads()}, f, indent=2)


if __name__ == "__main__":
    main()
