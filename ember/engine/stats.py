"""The engine's statistics: gauges read when asked, and counters that only grow."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class EngineCounters:
    """Totals since the engine started (or since `EngineCore.reset_counters`). They only grow."""

    num_steps: int = 0
    num_preemptions: int = 0
    admitted_prompt_tokens: int = 0  # prompt tokens of admitted sequences, once each, cache hits included
    cached_prompt_tokens: int = 0  # of those, found in the prefix cache at first admission
    prompt_tokens: int = 0  # prompt tokens computed, cache hits excluded (recomputation after preemption included)
    generation_tokens: int = 0  # tokens sampled
    prefill_seconds: float = 0.0  # step time apportioned to prefill tokens
    decode_seconds: float = 0.0  # step time apportioned to decode tokens
    spec_rounds: int = 0  # speculative decoding: drafted rounds verified
    spec_proposed_tokens: int = 0  # tokens drafted
    spec_accepted_tokens: int = 0  # of those, kept

    def add_round(self, proposed: int, accepted: int) -> None:
        """A verified speculative round: `proposed` drafted tokens, `accepted` of them kept."""
        self.spec_rounds += 1
        self.spec_proposed_tokens += proposed
        self.spec_accepted_tokens += accepted

    def add_step(self, seconds: float, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        """A step's wall time, split between prefill and decode in proportion to their tokens."""
        self.num_steps += 1
        total = num_prefill_tokens + num_decode_tokens
        if total == 0:
            return
        prefill = seconds * num_prefill_tokens / total
        self.prefill_seconds += prefill
        self.decode_seconds += seconds - prefill


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_prefilling: int  # running requests whose prompt is not yet computed
    kv_blocks_total: int  # allocatable blocks (the null block excluded)
    kv_blocks_used: int
    kv_blocks_cached: int  # blocks no request holds that still keep reusable prefix KV (pinned ones included)
    kv_blocks_pinned: int  # blocks cache breakpoints keep, held or not
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    num_steps: int
    num_preemptions: int
    admitted_prompt_tokens: int
    cached_prompt_tokens: int
    prompt_tokens: int
    generation_tokens: int
    prefill_seconds: float
    decode_seconds: float
    spec_rounds: int
    spec_proposed_tokens: int
    spec_accepted_tokens: int
    num_paused: int = 0  # unfinished requests that steps skip: their streams' readers are behind (engine.backlog)
    # the tiers behind the pool that are on, by name ("host", "disk"): CacheTiers.stats()
    cache_tiers: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def build(cls, counters: EngineCounters, **gauges) -> "EngineStats":
        # built at every step: a plain read of each field, not asdict's deep copy
        return cls(**gauges, **{name: getattr(counters, name) for name in _COUNTER_NAMES})


_COUNTER_NAMES = tuple(f.name for f in fields(EngineCounters))


def sum_stats(snapshots: list[EngineStats]) -> EngineStats:
    """Several workers' stats as one: every number summed, the tiers' tier by tier (a flag such as
    a disk tier's `enabled` holds when it holds for all)."""
    totals = {name: sum(getattr(stats, name) for stats in snapshots) for name in _NUMBER_NAMES}
    tiers: dict[str, dict] = {}
    for stats in snapshots:
        for tier, values in stats.cache_tiers.items():
            merged = tiers.setdefault(tier, {})
            for key, value in values.items():
                merged[key] = (merged.get(key, True) and value) if isinstance(value, bool) else merged.get(key, 0) + value
    return EngineStats(**totals, cache_tiers=tiers)


_NUMBER_NAMES = tuple(f.name for f in fields(EngineStats) if f.name != "cache_tiers")
