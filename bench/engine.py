"""Offline engine benchmark on the default model, all numbers from one run.

    python bench/engine.py [--model PATH] [--concurrency 32] [--input-len 128] [--output-len 128]

Prints output tokens per second (best of two runs each) for: transformers `generate` at batch 1
(the baseline, in float32 and bfloat16, the faster one counts), ember at batch 1, and ember with
N concurrent requests, plus the ratios against the baseline.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from ember import SamplingParams
from ember.llm import LLM

REPEATS = 2  # best of: the machines here are shared and noisy


def _prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    text = ("The history of science is a story of curiosity, patience and argument. " * 64)
    base = llm.tokenizer.encode(text)
    # Different prompts (rotated starts) so the prefix cache cannot serve them.
    return [(base[i:] + base[:i])[:length] for i in range(1, count + 1)]


def bench_transformers(llm: LLM, prompt: list[int], output_len: int, dtype: torch.dtype) -> float:
    import transformers
    path = Path(llm.source.path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=dtype).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, min_new_tokens=output_len, max_new_tokens=output_len, pad_token_id=0)
    best = 0.0
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "min_new_tokens": 8, "max_new_tokens": 8})  # warm-up
        for _ in range(REPEATS):
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            best = max(best, (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start))
    del model
    gc.collect()
    return best


def bench_ember(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    best = 0.0
    for _ in range(REPEATS):
        llm.engine.kv_manager.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        best = max(best, sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--no-batch-invariant", action="store_true",
                        help="whole-batch matmuls: faster prefill, results may vary in the last bits with the batch")
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(64, args.concurrency),
              batch_invariant=not args.no_batch_invariant,
              max_model_len=args.input_len + args.output_len + 16)
    prompts = _prompts(llm, args.concurrency, args.input_len)
    print(f"model {llm.source.name}, dtype {llm.engine.dtype}, batch invariant {not args.no_batch_invariant}, "
          f"torch threads {torch.get_num_threads()}, "
          f"{args.input_len} prompt + {args.output_len} output tokens")
    results = {}
    if not args.skip_transformers:
        for dtype in (torch.float32, torch.bfloat16):
            results[f"transformers batch 1 ({str(dtype)[6:]})"] = bench_transformers(
                llm, prompts[0], args.output_len, dtype)
    results["ember batch 1"] = bench_ember(llm, prompts[:1], args.output_len)
    results[f"ember {args.concurrency} concurrent"] = bench_ember(llm, prompts, args.output_len)
    baseline = max((v for k, v in results.items() if k.startswith("transformers")), default=None)
    for name, value in results.items():
        ratio = f"  {value / baseline:5.2f}x baseline" if baseline else ""
        print(f"{name:34s} {value:8.1f} output tok/s{ratio}")


if __name__ == "__main__":
    main()
