"""A soak of `ember serve`: thousands of requests across every dialect, with clients that disconnect,
read slowly, send hostile bodies and flood; then nothing may be left held (ember/bench/soak.py).

    python bench/soak.py [--requests 10000] [--concurrency 16] [--model NAME] [--json soak.json]
        [--serve-arg=--dtype=float32 ...]

The server is started here with two tenants (a well-behaved one and a flooding one); each may have
as many requests waiting as the well-behaved clients send at once, so only the flood's bursts (one
and a half times that) meet 429s. Exit status 1 when anything leaked or a request
nobody provoked failed. Prints the counts, the latencies (well-behaved clients alone, then beside
the misbehaving ones) and what each process held before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ember.bench.serve_process import serving
from ember.bench.soak import run_soak

GOOD_KEY, FLOOD_KEY = "soak-good-key-0001", "soak-flood-key-0002"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per well-behaved reply")
    parser.add_argument("--model", help="what `ember serve` takes (default: the default model)")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more flag for ember serve")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        key_file = Path(folder) / "keys"
        key_file.write_text(f"good: {GOOD_KEY}\nflood: {FLOOD_KEY}\n")
        flags = [*([args.model] if args.model else []), "--log-level", "warning", "--max-num-seqs",
                 str(args.concurrency), "--max-model-len", "1024", "--api-key-file", str(key_file),
                 "--max-pending-per-tenant", str(args.concurrency), *args.serve_arg]
        with serving(flags) as (proc, url):
            model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {GOOD_KEY}"}).json()["data"][0]["id"]
            started = time.perf_counter()
            report = run_soak(url, proc.pid, GOOD_KEY, FLOOD_KEY, model, args.requests,
                              concurrency=args.concurrency, max_tokens=args.max_tokens)
            seconds = time.perf_counter() - started
    summary = {**report.summary(), "seconds": round(seconds, 1)}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    sys.exit(1 if report.problems else 0)


if __name__ == "__main__":
    main()
