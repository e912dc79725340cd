"""What each weight format costs in quality, against float32 on the same model, in one run.

    python bench/quality.py [--model PATH] [--max-tokens 48]

For each format (float32 and bfloat16 with the weights dequantized, then ember's 8- and 4-bit
blocks), on the default model unless --model names another:
- greedy agreement with float32 over 20 chat prompts: how many replies are identical, and the
  mean and smallest index of the first token that differs;
- perplexity of tests/data/lighthouse.txt (about 1,200 tokens), scored in one forward pass.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ember import LLM, SamplingParams

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "lighthouse.txt"
FORMATS = {  # label -> LLM keyword arguments
    "float32, dequantized (the reference)": dict(dtype="float32", quantization="none"),
    "bfloat16, dequantized": dict(dtype="bfloat16", quantization="none"),
    "int8 blocks": dict(dtype="bfloat16", quantization="int8"),
    "int4 blocks (the GGUF's own, the default)": dict(dtype="bfloat16", quantization="auto"),
}
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about autumn leaves.", "Why is the sky blue?",
    "List three prime numbers.", "Translate 'good morning' into Spanish.", "What does a compiler do?",
    "Give me a tip for learning to cook.", "Explain photosynthesis in one sentence.",
    "What is the boiling point of water?", "Name a famous painter and one of their works.",
    "How do bees make honey?", "Write a short greeting for a birthday card.", "What is a prime number?",
    "Suggest a name for a pet turtle.", "Why do we have seasons?", "What is the largest ocean?",
    "Describe a rainy day in two sentences.", "How many legs does a spider have?",
    "What is the difference between weather and climate?", "Recommend a board game for a family evening.",
]


class _DenseAttention:
    """One sequence, one forward over the whole text: causal attention without a cache."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(), v.transpose(0, 1)[None].float(),
            is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1).to(q.dtype)


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int]) -> float:
    model = llm.engine.runner.model
    tokens = torch.tensor(ids)
    positions = torch.arange(len(ids))
    logits = model.compute_logits(model(tokens, positions, _DenseAttention()))
    nll = -torch.log_softmax(logits[:-1], dim=-1).gather(1, tokens[1:, None]).mean()
    return math.exp(nll.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    rows, reference = [], None
    for label, settings in FORMATS.items():
        llm = LLM(args.model, max_model_len=4096, kv_cache_tokens=16384, **settings)
        replies = [out.token_ids for out in llm.generate(chats, params)]
        ids = llm.tokenizer.encode(TEXT.read_text())
        ppl = perplexity(llm, ids)
        if reference is None:
            reference = replies
        firsts = [next((i for i, (a, b) in enumerate(zip(r, ref)) if a != b), len(r)) for r, ref in zip(replies, reference)]
        rows.append((label, sum(f == len(r) for f, r in zip(firsts, replies)), sum(firsts) / len(firsts), min(firsts), ppl))
        del llm
    print(f"greedy replies of {args.max_tokens} tokens to {len(QUESTIONS)} prompts; perplexity of {TEXT.name} "
          f"({len(ids)} tokens)")
    print("| weights | replies identical to float32 | first differing token, mean | earliest | perplexity |")
    print("| --- | --- | --- | --- | --- |")
    for label, same, mean, earliest, ppl in rows:
        print(f"| {label} | {same} / {len(QUESTIONS)} | {mean:.1f} | {earliest} | {ppl:.3f} |")


if __name__ == "__main__":
    main()
