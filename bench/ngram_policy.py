"""n-gram drafting's choices replayed on a modelled clock, beside the lookup's oracle.

How a change to the drafting policy would do, the same every run, and what the lookup would give
if it knew where each copy breaks.

    python bench/ngram_policy.py [--sets repetitive,long copy,chat] [--passes 3]
                                 [--cost A_MS,B_MS,PREFILL_MS]

On a shared machine two runs of bench/speculative.py differ by more than most changes to the
drafting policy (how long a draft, on what evidence) are worth. This separates the policy from the
clock. First the engine with `--speculate ngram` runs each set for real at one stream: its greedy
replies (what every drafted run must reproduce), and, unless --cost gives them, the step costs
fitted from its own decode steps (a + b * rows, least squares) and its prefill's seconds a prompt
token. Then ember's Speculator (engine.spec: the lookup, the tuned lengths, the gate) is replayed
over those replies, each step's drafts checked against the reply and charged the modelled cost,
--passes times over the set with one speculator (the first pass starts from the priors, as a
new server does; later passes start from what earlier ones taught, as the engines of
bench/speculative.py do after its first round).

For each pass: the whole run's modelled speed over plain decoding (prefill included), steps, rows
drafted and how many of them were not kept, and steps whose drafts all missed. The last line
is the lookup's oracle: each step drafts exactly the tokens of the full lookup (up to the tuned
most) that hold, so no row is wasted and no copy is cut short; the gap to it is what better
choices could still win, the lookup itself unchanged.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from speculative import PROMPTS, SETTINGS, engine_like

from ember import LLM, SamplingParams
from ember.config import MAX_TUNED_DRAFT_TOKENS, SpeculativeConfig
from ember.engine.request import Request
from ember.engine.spec.ngram import NgramIndex
from ember.engine.spec.speculator import build_speculator
from ember.engine.spec.tuning import StepCost

LONG = pathlib.Path(__file__).parent / "speculative_long.json"
OUTPUT_LEN = {"long copy": 256}  # else 128
LOOKUP = SpeculativeConfig(mode="ngram")


class UntimedLookups(StepCost):
    """The speculator's cost fits without the lookups' own microseconds, which it otherwise times:
    so that a replay is the same to the bit every run."""

    def observe_drafting(self, longest: int, seconds: float) -> None:
        pass


class Cost:
    """Seconds of a decode step of `rows` rows (a + b * rows) and of a prompt's prefill."""

    def __init__(self, a: float, b: float, prefill_per_token: float) -> None:
        self.a, self.b, self.prefill_per_token = a, b, prefill_per_token

    def step(self, rows: int) -> float:
        return self.a + self.b * rows

    def __str__(self) -> str:
        return (f"a {self.a * 1e3:.2f} ms + b {self.b * 1e3:.3f} ms a row, prefill "
                f"{self.prefill_per_token * 1e3:.3f} ms a prompt token")


def run_for_real(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], Cost]:
    """The n-gram engine over the prompts, one at a time: the replies and the fitted costs."""
    engine = engine_like(llm, LOOKUP)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    replies, decode, prefill_seconds = [], [], 0.0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
        reply: list[int] = []
        while engine.has_unfinished():
            began = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - began
            if reply:
                decode += [(1 + output.num_drafted_tokens, seconds) for output in outputs]
            else:  # the prompt's chunks, up to its first token
                prefill_seconds += seconds
            for output in outputs:
                reply += output.new_token_ids
        replies.append(reply)
    b, a = statistics.linear_regression(*zip(*decode))
    return replies, Cost(a, b, prefill_seconds / sum(map(len, prompts)))


def held(tokens: list[int], reply: list[int], position: int) -> int:
    """How many of `tokens` the reply writes next, from `position` on."""
    count = 0
    while count < len(tokens) and position + count < len(reply) and tokens[count] == reply[position + count]:
        count += 1
    return count


def request_id(index: int) -> str:
    return f"r{index}"


class Oracle:
    """The speculator's part in a replay, played by one that knows the replies: each step drafts
    exactly the tokens of the full lookup (up to the tuned most) that the reply goes on to write."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = {request_id(i): reply for i, reply in enumerate(replies)}
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[Request]) -> None:
        for request in requests:
            index = self.indexes.setdefault(request.request_id, NgramIndex(LOOKUP.ngram_min, LOOKUP.ngram_max))
            lookup, _ = index.propose(request.token_ids, MAX_TUNED_DRAFT_TOKENS)
            request.draft_token_ids = lookup[:held(lookup, self.replies[request.request_id], request.num_output_tokens)]

    def observe_step(self, *_) -> None:
        pass

    def forget(self, request: Request) -> None:
        self.indexes.pop(request.request_id, None)


def replay(speculator, prompts: list[list[int]], replies: list[list[int]], max_tokens: int, eos: set[int],
           cost: Cost) -> dict:
    """One pass of the set through `speculator` (ember's, or the Oracle) on the modelled clock."""
    plain = drafted_clock = 0.0
    steps = rows = not_kept = all_missed = 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        plain += cost.prefill_per_token * len(prompt) + cost.step(1) * (len(reply) - 1)
        drafted_clock += cost.prefill_per_token * len(prompt)
        request = Request(request_id(i), prompt, params, max_tokens=max_tokens, eos_token_ids=eos, arrival_time=0.0)
        request.token_ids.append(reply[0])  # the prefill's token
        position = 1
        while position < len(reply):
            request.num_computed_tokens = request.num_tokens - 1
            speculator.propose([request])
            drafts = request.draft_token_ids
            kept = held(drafts, reply, position)
            new_tokens = reply[position:position + kept + 1]
            seconds = cost.step(1 + len(drafts))
            drafted_clock += seconds
            steps, rows = steps + 1, rows + len(drafts)
            not_kept += len(drafts) - kept
            all_missed += bool(drafts) and not kept
            speculator.observe_step(1, 1 + len(drafts), bool(drafts), len(new_tokens), seconds, seconds)
            request.token_ids += new_tokens
            position += len(new_tokens)
        speculator.forget(request)
    return dict(ratio=plain / drafted_clock, steps=steps, rows=rows, not_kept=not_kept, all_missed=all_missed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="repetitive,long copy,chat")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--cost", help="A_MS,B_MS,PREFILL_MS: a step's fixed and per-row cost and a prompt "
                                       "token's, instead of fitting them from the real run")
    args = parser.parse_args()
    texts = json.loads(PROMPTS.read_text()) | json.loads(LONG.read_text())
    llm = LLM(**SETTINGS)
    eos = set(llm.engine.eos_token_ids)
    for name in args.sets.split(","):
        prompts = [llm.encode_prompt([{"role": "user", "content": text}]) for text in texts[name]]
        max_tokens = OUTPUT_LEN.get(name, 128)
        replies, fitted = run_for_real(llm, prompts, max_tokens)
        cost = Cost(*(float(v) / 1e3 for v in args.cost.split(","))) if args.cost else fitted
        print(f"{name}: {len(prompts)} prompts, {sum(map(len, replies))} reply tokens; cost {cost}"
              + ("" if args.cost else " (fitted)"))
        speculator = build_speculator(LOOKUP, SETTINGS["max_model_len"])
        speculator.step_cost = UntimedLookups()
        runs = [(f"pass {p + 1}", replay(speculator, prompts, replies, max_tokens, eos, cost))
                for p in range(args.passes)]
        runs.append(("oracle", replay(Oracle(replies), prompts, replies, max_tokens, eos, cost)))
        for label, r in runs:
            print(f"  {label:7s} {r['ratio']:.3f}x plain, {r['steps']} steps, {r['rows']} rows drafted, "
                  f"{r['not_kept']} of them not kept, {r['all_missed']} steps whose drafts all missed",
                  flush=True)


if __name__ == "__main__":
    main()
