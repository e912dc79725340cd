"""Decode on a GPU against its memory-bandwidth floor: a Qwen3-0.6B-shaped model with random weights.

    python bench/gpu_decode.py [--device cuda] [--batches 1,64] [--steps 32] [--layers 28] [--json FILE]
    python bench/gpu_decode.py --device cpu --layers 2 --steps 2     # a dry run of the script itself

The model is Qwen3-0.6B's configuration (built with transformers, its layer count settable) with
random bfloat16 weights, loaded into ember's engine as a checkpoint would be. For each batch size,
that many requests of --prompt-len random tokens are prefilled, then --steps decode steps are timed
(the engine's own steps, each ending with its tokens on the host). The floor of a decode step is
the time to read every weight once: weight bytes (engine.weight_footprint) over the device's
bandwidth, measured here as a device-to-device copy of --copy-mib (read and written: twice its
bytes moved). Prints one table; the share is floor / measured step time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from ember import SamplingParams
from ember.config import EngineConfig, ModelConfig
from ember.engine.core import EngineCore
from ember.engine.loading import build_model
from ember.engine.weight_footprint import weight_footprint

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gb_per_s(device: torch.device, mib: int, repeat: int = 5) -> float:
    """Bytes moved (read plus written) per second by the best of `repeat` copies of `mib` MiB."""
    source = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeat):
        synchronize(device)
        began = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 2 * source.numel() / best / 1e9


def random_engine(layers: int, device: torch.device, max_batch: int, context: int) -> EngineCore:
    """Qwen3-0.6B's shape with `layers` layers and random bfloat16 weights, in ember's engine."""
    hf_config = transformers.Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with device:
        reference = transformers.Qwen3ForCausalLM(hf_config).to(torch.bfloat16)
    model_config = ModelConfig.from_hf(hf_config.to_dict())
    model_config.eos_token_ids = []
    model = build_model(model_config, torch.bfloat16, device)
    model.load_weights(reference.state_dict().items())
    del reference
    config = EngineConfig(device=str(device), dtype="bfloat16", max_num_seqs=max_batch, max_model_len=context,
                          kv_cache_tokens=max_batch * context, enable_prefix_caching=False)
    return EngineCore(model, model_config, config, set(), device, torch.bfloat16)


def decode_step_seconds(engine: EngineCore, batch: int, prompt_len: int, steps: int) -> float:
    """Mean time of `steps` decode steps with `batch` requests running, after their prefill."""
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for index in range(batch):
        prompt = torch.randint(0, QWEN3_0_6B["vocab_size"], (prompt_len,), generator=generator).tolist()
        engine.add_request(f"b{batch}-{index}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill until every request has its first token
        started |= {out.request_id for out in engine.step() if out.new_token_ids}
    engine.step()  # one decode step unmeasured: first-call costs
    synchronize(engine.device)
    began = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(engine.device)
    seconds = (time.perf_counter() - began) / steps
    while engine.has_unfinished():
        engine.step()
    return seconds


def table(rows: list[dict]) -> str:
    lines = ["| batch | step ms | tok/s | weights GB | bandwidth GB/s | floor ms | floor / step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['batch']} | {row['step_ms']:.2f} | {row['tokens_per_s']:.0f} | "
                     f"{row['weight_bytes'] / 1e9:.3f} | {row['bandwidth_gb_per_s']:.0f} | {row['floor_ms']:.3f} | "
                     f"{row['floor_ms'] / row['step_ms']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, or cpu for a dry run (default cuda)")
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes (default 1,64)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size (default 32)")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (default 16)")
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"],
                        help="decoder layers (default 28, Qwen3-0.6B's)")
    parser.add_argument("--copy-mib", type=int, default=1024, help="the bandwidth copy's size (default 1024)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: torch.cuda.is_available() is False (--device cpu for a dry run)")
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth_gb_per_s(device, args.copy_mib)
    engine = random_engine(args.layers, device, max(batches), args.prompt_len + args.steps + 4)
    weight_bytes = weight_footprint(engine.runner.model).num_bytes
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for batch in batches:
        seconds = decode_step_seconds(engine, batch, args.prompt_len, args.steps)
        rows.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": batch / seconds,
                     "weight_bytes": weight_bytes, "bandwidth_gb_per_s": bandwidth, "floor_ms": floor_ms})
    print(f"{name}, torch {torch.__version__}; Qwen3-0.6B shape, {args.layers} layers, random bfloat16 weights; "
          f"{args.prompt_len}-token prompts, {args.steps} decode steps timed per batch size")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "layers": args.layers, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
