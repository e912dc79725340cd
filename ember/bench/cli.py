"""`ember bench`: its flags, the settings they make, the run, the report and its files.

ember/cli.py wires this in with `add_bench_parser(subcommands)` and `run_bench(args)`.
Environment variables read here: EMBER_API_KEY (the key, when --api-key is not given) and
EMBER_CACHE_DIR (where --offline caches converted GGUF models).
"""

from __future__ import annotations

import argparse
import os
import sys

from ember.bench.config import BenchConfig, BenchError, LengthRange, OfflineSettings

_DESCRIPTION = """\
Measure an OpenAI-compatible server (ember or any other) from the client side,
with streaming on: time to first token (TTFT), inter-token latency (ITL, the
gaps between output chunks), time per output token after the first (TPOT),
end-to-end latency (E2E), output tokens per second (all requests together, and
per request), requests per second, and failed requests by status.

Prompts are random words from a fixed list, drawn with --seed and sized in
tokens from two calibration requests, so two servers with the same tokenizer
get the same text. Token counts come from the server's usage
(stream_options.include_usage), never from the client.

Workloads: a closed loop at each --concurrency level (each of N clients sends
its next request when its last one ends), an open loop at each --request-rate
(Poisson arrivals), or --workload multiturn: N conversations at once, each turn
appending the reply and a new user message, with TTFT by turn.

Each level sends --num-requests requests and stops after --max-seconds; Ctrl-C
stops the run and reports what finished. Requests still in flight are cancelled
(their streams closed)."""

_EPILOG = """\
examples:
  ember bench --base-url http://127.0.0.1:8000 --concurrency 1,4,16,32 --input-len 128 --output-len 128
  ember bench --base-url http://127.0.0.1:8000 --request-rate 2,4 --num-requests 64 --json run.json
  ember bench --base-url http://127.0.0.1:8000 --workload multiturn --turns 6 --concurrency 4
  ember bench --offline --concurrency 1,32          # the engine in-process, no HTTP"""


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (or the engine offline)",
                              description=_DESCRIPTION, epilog=_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=None,
                        help="the server, e.g. http://127.0.0.1:8000 (/v1 is added when missing)")
    target.add_argument("--model", default=None,
                        help="the model id to request (default: the first one GET /v1/models lists); with "
                             "--offline, a Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    target.add_argument("--endpoint", default="chat", choices=["chat", "completions"],
                        help="/v1/chat/completions (messages through the chat template) or /v1/completions "
                             "(plain text) (default chat)")
    target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: $EMBER_API_KEY)")
    target.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds of silence on one response before it counts as a timeout (default 300)")
    work = p.add_argument_group("workload")
    work.add_argument("--workload", default="single", choices=["single", "multiturn"],
                      help="single: independent one-turn requests; multiturn: growing conversations (default single)")
    work.add_argument("--concurrency", default="1", metavar="N[,N...]",
                      help="closed-loop levels: requests kept in flight, one level after another (default 1); "
                           "for multiturn, the number of conversations")
    work.add_argument("--request-rate", default=None, metavar="R[,R...]",
                      help="open-loop levels instead: requests per second, Poisson arrivals drawn with --seed")
    work.add_argument("--num-requests", type=int, default=None,
                      help="requests per level (default: max(4 x concurrency, 16); open loop: max(16, 10 s of "
                           "arrivals); multiturn: conversations x turns, this flag unused)")
    work.add_argument("--input-len", default="128", metavar="N|LOW:HIGH",
                      help="prompt tokens per request, fixed or drawn uniformly from a range (default 128); "
                           "multiturn: the first prompt and each new user message")
    work.add_argument("--output-len", default="128", metavar="N|LOW:HIGH",
                      help="output tokens per request (max_tokens, with ignore_eos) (default 128)")
    work.add_argument("--turns", type=int, default=4, help="turns per conversation for multiturn (default 4)")
    work.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals (default 0)")
    work.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    work.add_argument("--no-ignore-eos", action="store_true",
                      help="do not send ignore_eos (for servers that refuse it); outputs may then end early")
    limits = p.add_argument_group("limits and output")
    limits.add_argument("--max-seconds", type=float, default=600.0,
                        help="stop a level after this many seconds, cancelling what is in flight (default 600)")
    limits.add_argument("--json", default=None, metavar="FILE",
                        help="write every level's summary and every request's raw numbers to FILE")
    limits.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw throughput and latency against concurrency (needs matplotlib: "
                             "pip install 'ember[plot]')")
    limits.add_argument("--quiet", action="store_true", help="no progress bar (it is drawn only on a terminal)")
    limits.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="stderr verbosity (default warning)")
    offline = p.add_argument_group("offline: the engine in-process, without HTTP")
    offline.add_argument("--offline", action="store_true",
                         help="load the model here and measure ember's engine on the same workload")
    offline.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    offline.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda when available)")
    offline.add_argument("--max-model-len", type=int, default=None, help="context window in tokens")
    offline.add_argument("--max-num-seqs", type=int, default=None,
                         help="most sequences running at once (default: the largest concurrency, at least 16)")
    offline.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    offline.add_argument("--no-batch-invariant", action="store_true",
                         help="on CPU, whole-batch matmuls: faster prefill, results may vary in the last bits")
    offline.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                         help="linear-layer weights, as for `ember serve` (default auto)")
    offline.add_argument("--no-limits", action="store_true",
                         help="skip the probe of the machine's read bandwidth and int8 and bfloat16 peaks "
                              "(a few seconds after the run) and the speeds as fractions of them")
    return p


def build_config(args: argparse.Namespace, environ=os.environ) -> BenchConfig:
    """Settings from the flags; raises BenchError with a message for the user."""
    offline = None
    if args.offline:
        if args.base_url:
            raise BenchError("--offline measures the engine in-process; leave out --base-url")
        offline = OfflineSettings(model=args.model, cache_dir=environ.get("EMBER_CACHE_DIR") or None,
                                  dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                                  batch_invariant=not args.no_batch_invariant, quantization=args.quantization,
                                  probe_limits=not args.no_limits)
    return BenchConfig(
        base_url=args.base_url, model=None if args.offline else args.model, endpoint=args.endpoint,
        api_key=args.api_key or environ.get("EMBER_API_KEY") or None, workload=args.workload,
        concurrency=_numbers(args.concurrency, int, "--concurrency"),
        request_rates=_numbers(args.request_rate, float, "--request-rate") if args.request_rate else None,
        num_requests=args.num_requests, input_len=LengthRange.parse(args.input_len),
        output_len=LengthRange.parse(args.output_len), turns=args.turns, seed=args.seed,
        temperature=args.temperature, ignore_eos=not args.no_ignore_eos, max_seconds=args.max_seconds,
        request_timeout=args.request_timeout, quiet=args.quiet, offline=offline)


def _numbers(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise BenchError(f"{flag} takes comma-separated numbers, got {text!r}") from None


def run_bench(args: argparse.Namespace) -> int:
    from ember.bench.plot import require_matplotlib, write_plot
    from ember.bench.report import format_report
    from ember.bench.runner import run

    try:
        config = build_config(args)
        if args.plot:
            require_matplotlib()
        result = run(config)
    except BenchError as exc:
        print(f"ember bench: {exc}", file=sys.stderr)
        return 2
    print(format_report(result), end="", flush=True)
    if args.json:
        result.write_json(args.json)
        print(f"ember bench: wrote every request to {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(result, args.plot)
        print(f"ember bench: wrote the plot to {args.plot}", file=sys.stderr)
    return 130 if result.interrupted else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
