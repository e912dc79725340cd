"""What a step of R new rows of one request costs: a drafted round's verify step, by row count.

    python bench/verify_rows.py [--rows 1,4,8,12,16,24,32,64] [--context 304] [--steps 40]

One process, the engine alone, the default model. Each timed step computes R new tokens of a
request whose first --context tokens are in the prefix cache (a whole number of 16-token blocks
hits): the same rows, positions and attention as a round of R - 1 drafted tokens being verified,
the output head over every row. The table gives each row count's median and fastest step in ms and
the cost of a row against the row count before it, the figure that decides how long a draft pays.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from ember import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,12,16,24,32,64")
    parser.add_argument("--context", type=int, default=304, help="cached tokens before the new rows")
    parser.add_argument("--steps", type=int, default=40, help="steps timed at each row count")
    args = parser.parse_args()
    llm = LLM(max_model_len=2048, kv_cache_tokens=16384)
    engine = llm.engine
    tokens = random.Random(0)
    prefix = [tokens.randrange(100, 40000) for _ in range(args.context)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    serial = 0

    def last_step(rows: int) -> float:
        nonlocal serial
        serial += 1
        engine.add_request(f"r{serial}", prefix + [tokens.randrange(100, 40000) for _ in range(rows)], params)
        seconds = 0.0
        while engine.has_unfinished():
            began = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - began
        return seconds

    last_step(0)  # the prefix, into the cache
    print(f"one request, {args.context} cached tokens, {args.steps} steps a row count")
    print("| rows | median ms | fastest ms | ms a row since the row count before |")
    print("| --- | --- | --- | --- |")
    before = None
    for rows in map(int, args.rows.split(",")):
        steps = [last_step(rows) for _ in range(args.steps)]
        median = statistics.median(steps) * 1e3
        per_row = f"{(median - before[1]) / (rows - before[0]):.2f}" if before else ""
        print(f"| {rows} | {median:.2f} | {min(steps) * 1e3:.2f} | {per_row} |", flush=True)
        before = (rows, median)


if __name__ == "__main__":
    main()
