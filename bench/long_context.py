"""Long-context prefill and decode on one sequence, ember against transformers, in one run.

    python bench/long_context.py [--model PATH] [--contexts 2048,8192,20480] [--decode-tokens 32] [--kv-dtype int8]

For each context length: the seconds to prefill a prompt of that many tokens (to its first
token) and the milliseconds per token of the decode that follows, for ember (chunked prefill
through the paged cache) and for transformers' model on the same weights (its whole prompt in
one forward, then decode with its own KV cache, SDPA attention). Prompts are random token ids,
so no prefix cache can serve them; ember's window is raised to fit the longest context.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from ember import SamplingParams
from ember.llm import LLM


def ember_run(llm: LLM, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode ms per token)."""
    engine = llm.engine
    engine.kv_manager.reset_prefix_cache()
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True))
    start = time.perf_counter()
    first_token_at = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first_token_at is None:
                first_token_at = time.perf_counter()
    return first_token_at - start, (time.perf_counter() - first_token_at) / decode_tokens * 1000


def transformers_run(model, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True)
        prefilled = time.perf_counter()
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(decode_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        done = time.perf_counter()
    return prefilled - start, (done - prefilled) / decode_tokens * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", default="2048,8192,20480", help="prompt lengths, comma-separated")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--no-batch-invariant", action="store_true",
                        help="whole-batch matmuls and one attention call per chunk: faster prefill, results may "
                             "vary in the last bits with the batch and the chunking")
    parser.add_argument("--kv-dtype", default="auto", help="what ember's KV cache stores (auto, bf16, fp32, int8)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    llm = LLM(args.model, max_model_len=max(contexts) + args.decode_tokens + 16,
              batch_invariant=not args.no_batch_invariant, kv_dtype=args.kv_dtype)
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    prompts = {n: [rng.randrange(100, vocab) for _ in range(n)] for n in contexts}
    ember_run(llm, prompts[contexts[0]][:256], 4)  # warm-up
    print(f"model {llm.source.name}, dtype {llm.engine.dtype}, KV cache {llm.engine.runner.cache.kv_dtype}, "
          f"batch invariant {not args.no_batch_invariant}, "
          f"torch threads {torch.get_num_threads()}, {args.decode_tokens} decode tokens")
    reference = None
    if not args.skip_transformers:
        import transformers
        path = Path(llm.source.path)
        kwargs = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
        folder = path.parent if path.suffix == ".gguf" else path
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=llm.engine.dtype, attn_implementation="sdpa", **kwargs).eval()
        transformers_run(reference, prompts[contexts[0]][:256], 4)  # warm-up
    print(f"{'context':>8} {'ember prefill s':>16} {'ember decode ms':>16} {'hf prefill s':>13} {'hf decode ms':>13}"
          f" {'prefill ratio':>14} {'decode ratio':>13}")
    for n in contexts:
        prefill, decode = ember_run(llm, prompts[n], args.decode_tokens)
        line = f"{n:8d} {prefill:16.2f} {decode:16.1f}"
        if reference is not None:
            hf_prefill, hf_decode = transformers_run(reference, prompts[n], args.decode_tokens)
            line += f" {hf_prefill:13.2f} {hf_decode:13.1f} {hf_prefill / prefill:13.2f}x {hf_decode / decode:12.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
