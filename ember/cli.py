"""The `ember` command: serve, generate, chat, bench, models, pull.

Environment variables read here: EMBER_CACHE_DIR (converted GGUF models) and OLLAMA_MODELS
(Ollama's store); huggingface_hub reads its own (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Environment:
    """What the commands take from the environment, read once in main()."""

    cache_dir: Path | None = None  # $EMBER_CACHE_DIR
    ollama_models: Path | None = None  # $OLLAMA_MODELS

    @classmethod
    def read(cls, environ=os.environ) -> "Environment":
        def path(key: str) -> Path | None:
            return Path(environ[key]) if environ.get(key) else None
        return cls(path("EMBER_CACHE_DIR"), path("OLLAMA_MODELS"))


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    from ember.server.flags import MODEL_HELP, REVISION_HELP
    parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    parser.add_argument("--revision", default=None, help=REVISION_HELP)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="weights and KV cache dtype (auto: bfloat16)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: the CPU; the CUDA path is not yet checked on a GPU)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context window in tokens")
    parser.add_argument("--seed", type=int, default=None,
                        help="the seed of sampled requests without --sample-seed (default: a fresh one each)")
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
    from ember.server.flags import add_serve_parser
    add_serve_parser(commands)
    from ember.bench.cli import add_bench_parser
    add_bench_parser(commands)
    from ember.store_cli import add_store_parsers
    add_store_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    environment = Environment.read()
    from ember.errors import EmberError
    try:
        return _COMMANDS[args.command](args, environment)
    except EmberError as exc:
        print(f"ember: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _load(args, environment: Environment):
    from ember.llm import LLM
    return LLM(args.model, cache_dir=environment.cache_dir, revision=args.revision,
               ollama_models=environment.ollama_models, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, seed=args.seed)


def _sampling(args):
    from ember.types import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sample_seed)


def _generate(args, environment: Environment) -> int:
    llm = _load(args, environment)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    for output in llm.stream(prompt, _sampling(args)):
        print(output.text_delta, end="", flush=True)
    print()
    return 0


def _chat(args, environment: Environment) -> int:
    llm = _load(args, environment)
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


def _serve(args, environment: Environment) -> int:
    from ember.server.cli import run_serve
    return run_serve(args)


def _bench(args, environment: Environment) -> int:
    from ember.bench.cli import run_bench
    return run_bench(args)


def _models(args, environment: Environment) -> int:
    from ember.store_cli import run_models
    return run_models(args, environment.ollama_models)


def _pull(args, environment: Environment) -> int:
    from ember.store_cli import run_pull
    return run_pull(args, environment.ollama_models)


_COMMANDS = {"generate": _generate, "chat": _chat, "serve": _serve, "bench": _bench, "models": _models,
             "pull": _pull}

if __name__ == "__main__":
    sys.exit(main())
