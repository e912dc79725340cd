"""Summaries of a level's records: percentiles, throughput, errors by outcome, TTFT by turn.

Throughput divides by the level's wall time: from its start to the end of its last request.
Latencies count successful requests only; output tokens are the server's usage of those requests.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

from ember.bench.records import CANCELLED, RequestRecord


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); monotone in p."""
    if not sorted_values:
        raise ValueError("no values")
    rank = (len(sorted_values) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    below, above = sorted_values[low], sorted_values[high]
    # Clamped so rounding can never step outside the bracket and break p50 <= p90 <= p99.
    return min(above, max(below, below + (above - below) * (rank - low)))


@dataclass(slots=True, frozen=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> "Distribution | None":
        if not values:
            return None
        ordered = sorted(values)
        return cls(len(ordered), math.fsum(ordered) / len(ordered), percentile(ordered, 50),
                   percentile(ordered, 90), percentile(ordered, 99), ordered[0], ordered[-1])


@dataclass(slots=True, frozen=True)
class TurnSummary:
    turn: int
    count: int  # successful requests of this turn
    prompt_tokens_mean: float | None
    cached_tokens_mean: float | None
    ttft: Distribution | None


@dataclass(slots=True, frozen=True)
class LevelSummary:
    num_sent: int
    num_ok: int
    num_cancelled: int
    errors: dict[str, int]  # outcome -> count, cancelled requests not included
    num_missing_usage: int  # successful requests whose stream carried no usage
    wall_s: float
    requests_per_s: float
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float  # output_tokens / wall_s
    ttft: Distribution | None  # seconds
    itl: Distribution | None  # seconds; every gap between output chunks after the first
    tpot: Distribution | None  # seconds; per request, decode time over its output tokens after the first
    e2e: Distribution | None  # seconds
    request_output_tokens_per_s: Distribution | None  # per request: completion tokens over its e2e
    by_turn: list[TurnSummary] | None  # multiturn only

    def to_json(self) -> dict:
        return asdict(self)


def wall_time(records: list[RequestRecord], elapsed: float) -> float:
    """From the level's start to the end of its last request (`elapsed` if none ended)."""
    ends = [r.ended for r in records if r.ended is not None]
    return max(ends) if ends else elapsed


def summarize(records: list[RequestRecord], wall_s: float) -> LevelSummary:
    ok = [r for r in records if r.ok]
    outcomes = Counter(r.outcome for r in records if not r.ok and r.outcome != CANCELLED)
    with_usage = [r for r in ok if r.completion_tokens is not None]
    output_tokens = sum(r.completion_tokens for r in with_usage)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in with_usage)
    turns = sorted({r.turn for r in records if r.turn is not None})
    return LevelSummary(
        num_sent=len(records),
        num_ok=len(ok),
        num_cancelled=sum(r.outcome == CANCELLED for r in records),
        errors=dict(sorted(outcomes.items())),
        num_missing_usage=len(ok) - len(with_usage),
        wall_s=wall_s,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / wall_s if wall_s > 0 else 0.0,
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.inter_token_gaps]),
        tpot=Distribution.of([r.tpot for r in ok if r.tpot is not None]),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None]),
        request_output_tokens_per_s=Distribution.of(
            [r.output_tokens_per_s for r in ok if r.output_tokens_per_s is not None]),
        by_turn=[_turn_summary(t, [r for r in ok if r.turn == t]) for t in turns] if turns else None,
    )


def _turn_summary(turn: int, records: list[RequestRecord]) -> TurnSummary:
    prompt = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in records if r.cached_tokens is not None]
    return TurnSummary(turn, len(records), _mean(prompt), _mean(cached),
                       Distribution.of([r.ttft for r in records if r.ttft is not None]))


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None
