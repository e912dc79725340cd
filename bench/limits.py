"""The machine's limits as ember's kernels meet them: read bandwidth, int8 and bfloat16 peaks.

    python bench/limits.py [--threads 2] [--read-mib 1024] [--repeat 3] [--model FILE.gguf|FOLDER] [--json FILE]

Read bandwidth is a matrix-vector product of ember's 8-bit block kernel over a weight far larger
than the caches (how decode reads its weights); the peaks are ember's int8 kernel and the engine's
bfloat16 format on a compute-bound shape (ember/bench/limits.py says how). With --model, the
model is loaded as `ember serve` loads it and the bounds its weights give are printed too: one
stream's decode at most read bandwidth / weight bytes tokens a second, many streams and prefill
at most int8 peak / (2 x weights). `ember bench --offline` prints the same after its run, and
bench/vs_llama_cpp.py prints every speed as a fraction of these bounds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ember.bench.limits import Bounds
from ember.bench.machine_probe import probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="threads (default: torch's count)")
    parser.add_argument("--read-mib", type=int, default=1024, help="the streamed weight's size (default 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per figure, the best counts (default 3)")
    parser.add_argument("--model", default=None, help="also print the bounds of this model's weights")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    limits = probe(args.threads, args.read_mib, args.repeat)
    print(f"torch {torch.__version__}; probe took {limits.seconds:.1f} s")
    document = {"limits": limits.to_json()}
    if args.model is None:
        print(limits.describe())
    else:
        from ember.llm import LLM

        llm = LLM(args.model, num_threads=limits.threads)
        weights = llm.engine.weights  # as the engine holds them (engine.weight_footprint)
        bounds = Bounds(limits, weights.num_bytes, weights.num_weights)
        llm.close()
        print(bounds.describe())
        document = bounds.to_json()
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
