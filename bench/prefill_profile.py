"""Where a long prompt's prefill goes, op by op: the prefill profile behind a prompt's time to first
token.

    python bench/prefill_profile.py [--model PATH] [--prompt-tokens 1500] [--runs 3] [--threads N]

One process, the engine alone (no HTTP). A prompt of --prompt-tokens tokens is prefilled with one
token of output, --runs times, each prompt new to the prefix cache; then once more under torch's
profiler, whose table of ops by their own time says what the prefill is made of (ember's
kernels: the linear layers, paged attention, the row ops). Beside the attention, the rate its
arithmetic ran at (two products of head_dim per query and earlier key, for every head and layer:
a sliding window's layers are counted as if they saw every key); beside the linear layers, theirs
(a multiply-add per weight per token, the LM head left out: a prefill computes one row of it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember import SamplingParams
from ember.engine.weight_footprint import weight_footprint
from ember.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="what to load (default: the default model)")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="the prompt's length")
    parser.add_argument("--runs", type=int, default=3, help="timed prefills before the profiled one")
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: torch's)")
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=max(2048, args.prompt_tokens + 64), num_threads=args.threads)
    config = llm.engine.model_config
    vocab = config.vocab_size
    one_token = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt(n: int) -> list[int]:  # a prompt no earlier run shares a block with
        return [(1000 + 7919 * n + i) % vocab for i in range(args.prompt_tokens)]

    llm.generate([prompt(0)[:64]], one_token)  # warm-up
    seconds = []
    for run in range(args.runs):
        began = time.perf_counter()
        llm.generate([prompt(run + 1)], one_token)
        seconds.append(time.perf_counter() - began)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        llm.generate([prompt(args.runs + 1)], one_token)
    ops = sorted(profiler.key_averages(), key=lambda op: op.self_cpu_time_total, reverse=True)
    total = sum(op.self_cpu_time_total for op in ops) / 1e6
    tokens = args.prompt_tokens
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_macs = tokens * (tokens + 1) / 2 * 2 * head_dim * config.num_attention_heads * config.num_hidden_layers
    model = llm.engine.runner.model
    linear_macs = tokens * (weight_footprint(model).num_weights - weight_footprint(model.lm_head).num_weights)
    work = {"ember::paged_attention": attention_macs, "ember::quantized_linear": linear_macs}
    print(f"{tokens}-token prompt, one token out: {statistics.median(seconds):.3f} s "
          f"(median of {args.runs}: {', '.join(f'{s:.3f}' for s in seconds)}); profiled run {total:.3f} s of ops")
    print(f"{'op':<28} {'s':>7} {'share':>7} {'calls':>6} {'GFLOP/s':>8}")
    for op in ops[:10]:
        own = op.self_cpu_time_total / 1e6
        rate = f"{2 * work[op.key] / own / 1e9:>8.0f}" if op.key in work and own else f"{'':>8}"
        print(f"{op.key:<28} {own:>7.3f} {own / total:>7.1%} {op.count:>6} {rate}")


if __name__ == "__main__":
    main()
