"""n-gram lookup as it is against the lookup it replaced, with plain decoding as the baseline.

    python bench/ngram_lookup.py [--rounds 3] [--output-len 128] [--sets repetitive,long copy]

Three engines over the same model run each set a step of each in turn (bench/speculative.py's
method, so the machine's drift falls on all alike), at 1 stream and at 8:
  plain     speculation off
  furthest  `--speculate ngram` as it is: the looked-up n-gram's occurrence that matches furthest
            back (up to 64 tokens), drafts tuned up to 32 tokens alone and 16 in a batch
  latest    the lookup before it: the latest occurrence of the longest 1- to 4-token suffix,
            drafts tuned up to 16
Sets: the shipped repetitive set (speculative_prompts.json) and `long copy`
(speculative_long.json: a 1,150-token file to repeat, an 830-token module to show again without
its comments; 256 tokens a reply), where a 4-token n-gram recurs on many lines.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from speculative import PROMPTS, SETTINGS, _PASSES, engine_like, run_together

from ember import LLM
from ember.config import SpeculativeConfig

LONG = pathlib.Path(__file__).parent / "speculative_long.json"
_LATEST_MOST = 16  # the draft cap the latest-occurrence lookup was tuned with


class LatestOccurrence:
    """The lookup before: where each 1- to 4-gram last ended; the longest suffix found wins."""

    name, free = "ngram", True

    def __init__(self) -> None:
        self._requests: dict[str, tuple[dict[tuple[int, ...], int], list[int]]] = {}

    def propose(self, wants):
        proposals = []
        for request, num_tokens in wants:
            ends, indexed = self._requests.setdefault(request.request_id, ({}, [0]))
            tokens = request.token_ids
            for end in range(max(indexed[0], 1), len(tokens)):
                for n in range(1, min(4, end) + 1):
                    ends[tuple(tokens[end - n:end])] = end
            indexed[0] = len(tokens)
            for n in range(min(4, len(tokens)), 0, -1):
                end = ends.get(tuple(tokens[len(tokens) - n:]))
                if end is not None:
                    proposals.append((tokens[end:end + num_tokens], n))
                    break
            else:
                proposals.append(([], 0))
        return proposals

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=None, help="tokens a reply (default: 128, long copy 256)")
    parser.add_argument("--sets", default="repetitive,long copy")
    args = parser.parse_args()
    texts = json.loads(PROMPTS.read_text()) | json.loads(LONG.read_text())
    llm = LLM(**(SETTINGS | {"max_model_len": 4096}))
    latest = engine_like(llm, SpeculativeConfig(mode="ngram"), LatestOccurrence())
    latest.speculator.most_alone = latest.speculator.most_in_batch = _LATEST_MOST
    engines = {"plain": llm.engine, "furthest": engine_like(llm, SpeculativeConfig(mode="ngram")), "latest": latest}
    print(f"greedy, {args.rounds} rounds; median tok/s of the whole run (median ratio to plain; "
          f"one stream's decode ratio)")
    for set_name in args.sets.split(","):
        prompts = [llm.encode_prompt([{"role": "user", "content": text}]) for text in texts[set_name]]
        output_len = args.output_len or (256 if set_name == "long copy" else 128)
        for streams in (1, 8):
            batch = prompts * (1 if streams == 1 else _PASSES)
            results = {name: [] for name in engines}
            for round_index in range(args.rounds):
                runs = run_together(engines, batch, streams, output_len, seed=round_index)
                for name, run in runs.items():
                    results[name].append(run.result())
            plain = results["plain"]
            for name, rows in results.items():
                same = "" if all(row[3] == base[3] for row, base in zip(rows, plain)) else "  REPLIES DIFFER"
                ratio = statistics.median(row[0] / base[0] for row, base in zip(rows, plain))
                decode = statistics.median(row[1] / base[1] for row, base in zip(rows, plain))
                print(f"  {set_name:10s} {streams} stream{'s' if streams > 1 else ' '}  {name:8s} "
                      f"{statistics.median(row[0] for row in rows):7.1f} tok/s ({ratio:.2f}x; decode {decode:.2f}x), "
                      f"{statistics.median(row[2] for row in rows):.2f} tokens a decode step{same}", flush=True)


if __name__ == "__main__":
    main()
