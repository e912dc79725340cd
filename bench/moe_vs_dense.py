"""Two measurements of the newer architectures, on tiny random models, all numbers from one run.

    python bench/moe_vs_dense.py [--batch 8] [--output-len 64] [--window 128]

1. Decode speed of a Qwen3-MoE model against a dense Qwen3 of the same active size (its MLP as
   wide as the experts a token runs, top_k * moe_intermediate_size), same attention, same engine
   settings: output tokens per second (best of two) and the MoE step's cost as a multiple of the
   dense one.
2. KV memory of a Mistral-shaped model whose every layer has a sliding window, serving a prompt of
   4x its window plus decode, against the same shape with full attention: the most KV blocks the
   request held at once, in MiB.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from ember import SamplingParams
from ember.config import EngineConfig, ModelConfig
from ember.engine.attention import KVCache
from ember.engine.core import EngineCore
from ember.engine.loading import build_model

REPEATS = 2
SHAPE = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6)


def engine_for(reference: torch.nn.Module, **settings) -> EngineCore:
    config = ModelConfig.from_hf(reference.config.to_dict())
    config.eos_token_ids = []
    model = build_model(config, torch.bfloat16, torch.device("cpu"))
    model.load_weights(reference.state_dict().items())
    engine_config = EngineConfig(**{"kv_cache_tokens": 64 * 1024, "dtype": "bfloat16", **settings})
    return EngineCore(model, config, engine_config, set(), torch.device("cpu"), torch.bfloat16)


def random_model(config_cls: str, model_cls: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**SHAPE, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.eval()


def decode_rate(engine: EngineCore, batch: int, output_len: int) -> float:
    """Output tokens per second of `batch` requests of 32-token prompts, best of REPEATS."""
    best = 0.0
    for repeat in range(REPEATS):
        prompts = [torch.randint(0, SHAPE["vocab_size"], (32,)).tolist() for _ in range(batch)]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{repeat}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=output_len))
        began, produced = time.perf_counter(), 0
        while engine.has_unfinished():
            produced += sum(len(out.new_token_ids) for out in engine.step())
        best = max(best, produced / (time.perf_counter() - began))
    return best


def most_blocks_held(engine: EngineCore, prompt_len: int, output_len: int) -> int:
    prompt = torch.randint(0, SHAPE["vocab_size"], (prompt_len,)).tolist()
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=output_len))
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.kv_manager.num_used_blocks)
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--window", type=int, default=128)
    args = parser.parse_args()

    experts, top_k, expert_size = 16, 2, 256
    moe = random_model("Qwen3MoeConfig", "Qwen3MoeForCausalLM", intermediate_size=top_k * expert_size,
                       num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_size,
                       norm_topk_prob=True)
    dense = random_model("Qwen3Config", "Qwen3ForCausalLM", intermediate_size=top_k * expert_size)
    rates = {name: decode_rate(engine_for(model), args.batch, args.output_len)
             for name, model in (("dense", dense), ("moe", moe))}
    print(f"decode, batch {args.batch}: dense Qwen3 {rates['dense']:.0f} tok/s, Qwen3-MoE ({experts} experts, "
          f"top {top_k}) {rates['moe']:.0f} tok/s; the MoE step costs {rates['dense'] / rates['moe']:.2f}x the dense one")

    window = args.window
    block_size = 16
    per_block = KVCache.bytes_per_block(SHAPE["num_hidden_layers"], block_size, SHAPE["num_key_value_heads"],
                                        SHAPE["head_dim"], torch.bfloat16)
    held = {}
    for name, sliding in (("full attention", None), (f"sliding window {window}", window)):
        model = random_model("MistralConfig", "MistralForCausalLM", intermediate_size=512, sliding_window=sliding)
        held[name] = most_blocks_held(engine_for(model, max_num_batched_tokens=64), 4 * window, args.output_len)
    print(f"KV memory at a {4 * window}-token prompt plus {args.output_len} decoded: " + ", ".join(
        f"{name} {blocks} blocks ({blocks * per_block / 2**20:.2f} MiB)" for name, blocks in held.items()))


if __name__ == "__main__":
    main()
