"""What each weight format and KV cache dtype costs in quality, on the same model, in one run.

    python bench/quality.py [--model PATH] [--max-tokens 48] [--only weights|kv] [--kv-context 8000]

For each weight format (float32 and bfloat16 with the weights dequantized, then ember's 8- and
4-bit blocks), on the default model unless --model names another:
- greedy agreement with float32 over 20 chat prompts: how many replies are identical, and the
  mean and smallest index of the first token that differs;
- perplexity of tests/data/lighthouse.txt (about 1,200 tokens, after the model's BOS token where it
  has one), scored in one forward pass, and over the same pass, how far each next-token
  distribution lies from float32's: the mean KL divergence, and how often the likeliest token is
  float32's.

For each KV cache dtype (--kv-dtype: bfloat16, the reference, then int8), at a long context of
--kv-context tokens of ember's own docs (docs/*.md in name order, as plain text):
- perplexity of those tokens scored through the engine's paged KV cache, chunk by chunk as a
  prompt is prefilled, so every position reads its context back from the cache;
- greedy agreement with bfloat16 over 4 prompts of that length (the docs from 4 offsets, then a
  question): replies identical, and the mean and smallest index of the first token that differs.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ember import LLM, SamplingParams
from ember.engine.runner import StepItem

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "lighthouse.txt"
FORMATS = {  # label -> LLM keyword arguments
    "float32, dequantized (the reference)": dict(dtype="float32", quantization="none"),
    "bfloat16, dequantized": dict(dtype="bfloat16", quantization="none"),
    "int8 blocks": dict(dtype="bfloat16", quantization="int8"),
    "int4 blocks (the GGUF's own, the default)": dict(dtype="bfloat16", quantization="auto"),
}
KV_DTYPES = {"bfloat16 (the reference)": "bf16", "int8, a scale per row": "int8"}  # label -> kv_dtype
LONG_TEXT = sorted((ROOT / "docs").glob("*.md"))
KV_PROMPTS, KV_OFFSET_STEP, KV_CHUNK = 4, 500, 512
KV_QUESTION = "\n\nIn one paragraph, what is the text above about?\n"
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
def log_probs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float32: each position's next-token log-probabilities, in one forward."""
    model = llm.engine.runner.model
    logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), _DenseAttention()))
    return torch.log_softmax(logits.float(), dim=-1)


def perplexity_of(log_p: torch.Tensor, ids: list[int]) -> float:
    return math.exp(-log_p[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item())



@torch.inference_mode()
def cached_perplexity(llm: LLM, ids: list[int]) -> float:
    """Perplexity of `ids` through the engine's paged KV cache: chunks of KV_CHUNK tokens run as a
    prompt's prefill steps (in the idle pool's first blocks), every row's logits kept."""
    engine = llm.engine
    block_size = engine.config.block_size
    engine.kv_manager.reset_prefix_cache()
    blocks = list(range(1, -(-len(ids) // block_size) + 1))
    nll = 0.0
    for start in range(0, len(ids) - 1, KV_CHUNK):
        tokens = ids[start:start + KV_CHUNK]
        item = StepItem(tokens, start, blocks[:-(-(start + len(tokens)) // block_size)], True,
                        num_drafted=len(tokens) - 1)  # every row sampled: each position's logits
        targets = torch.tensor(ids[start + 1:start + len(tokens) + 1])
        logits = engine.runner.forward([item])[0][:len(targets)].float()
        nll -= torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum().item()
    engine.kv_manager.reset_prefix_cache()  # the blocks were written outside the prefix cache's books
    return math.exp(nll / (len(ids) - 1))


def first_differences(replies: list[list[int]], reference: list[list[int]]) -> list[int]:
    return [next((i for i, (a, b) in enumerate(zip(r, ref)) if a != b), len(r)) for r, ref in zip(replies, reference)]


def kv_dtype_table(model: str | None, context: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows, reference = [], None
    for label, kv_dtype in KV_DTYPES.items():
        llm = LLM(model, kv_dtype=kv_dtype, max_model_len=context + max_tokens + 64,
                  kv_cache_tokens=KV_PROMPTS * (context + max_tokens + 64))
        text = llm.tokenizer.encode("\n\n".join(path.read_text() for path in LONG_TEXT))
        question = llm.tokenizer.encode(KV_QUESTION)
        assert len(text) >= context + KV_OFFSET_STEP * KV_PROMPTS, "the docs are shorter than the context asked"
        ppl = cached_perplexity(llm, text[:context])
        prompts = [text[k * KV_OFFSET_STEP:k * KV_OFFSET_STEP + context - len(question)] + question
                   for k in range(KV_PROMPTS)]
        replies = [out.token_ids for out in llm.generate(prompts, params)]
        reference = reference or replies
        firsts = first_differences(replies, reference)
        rows.append((label, sum(f == len(r) for f, r in zip(firsts, replies)), sum(firsts) / len(firsts), min(firsts),
                     ppl))
        llm.close()
        del llm
    print(f"\nKV cache dtype at {context} tokens: greedy replies of {max_tokens} tokens to {KV_PROMPTS} prompts of "
          f"{context} tokens; perplexity of {context} tokens scored through the paged cache")
    print("| KV cache | replies identical to bfloat16 | first differing token, mean | earliest | perplexity |")
    print("| --- | --- | --- | --- | --- |")
    for label, same, mean, earliest, ppl in rows:
        print(f"| {label} | {same} / {KV_PROMPTS} | {mean:.1f} | {earliest} | {ppl:.3f} |")


def weight_format_table(model: str | None, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    rows, reference, reference_log_p = [], None, None
    for label, settings in FORMATS.items():
        llm = LLM(model, max_model_len=4096, kv_cache_tokens=16384, **settings)
        replies = [out.token_ids for out in llm.generate(chats, params)]
        ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=True)
        log_p = log_probs(llm, ids)
        if reference is None:
            reference, reference_log_p = replies, log_p
        firsts = first_differences(replies, reference)
        kl = (reference_log_p.exp() * (reference_log_p - log_p)).sum(-1).mean().item()
        top_same = (log_p.argmax(-1) == reference_log_p.argmax(-1)).float().mean().item()
        rows.append((label, sum(f == len(r) for f, r in zip(firsts, replies)), sum(firsts) / len(firsts), min(firsts),
                     perplexity_of(log_p, ids), kl, top_same))
        del llm, log_p
    print(f"greedy replies of {max_tokens} tokens to {len(QUESTIONS)} prompts; perplexity of {TEXT.name} "
          f"({len(ids)} tokens)")
    print("| weights | replies identical to float32 | first differing token, mean | earliest | perplexity "
          "| mean KL to float32 | likeliest token as float32's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, same, mean, earliest, ppl, kl, top_same in rows:
        print(f"| {label} | {same} / {len(QUESTIONS)} | {mean:.1f} | {earliest} | {ppl:.3f} | {kl:.5f} "
              f"| {top_same:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--only", choices=["weights", "kv"], default=None, help="one of the two tables")
    parser.add_argument("--kv-context", type=int, default=8000, help="tokens of the KV dtype comparison's context")
    args = parser.parse_args()
    if args.only != "kv":
        weight_format_table(args.model, args.max_tokens)
    if args.only != "weights":
        kv_dtype_table(args.model, args.kv_context, args.max_tokens)

if __name__ == "__main__":
    main()
