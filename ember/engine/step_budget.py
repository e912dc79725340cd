"""What tokens cost in a step's budget (engine.scheduler).

While any request decodes, the budget counts what tokens cost, not only how many there are: with
`attention_cost_tokens` (K) set, a token attending to c keys costs 1 + c / K, K being the context
at which its attention costs as much as the rest of its layer. A step of max_num_batched_tokens
short-context tokens and a step holding one chunk of a 20,000-token prompt then take about the
same time, so the streams running beside a long prompt keep the pace of a short step while it
prefills. With no stream to protect, K is None: every token costs 1 and prompts prefill in
full-budget chunks.
"""

from __future__ import annotations

import math


def chunk_cost(start: int, count: int, attention_cost_tokens: int | None) -> float:
    """What `count` tokens from position `start` cost: each 1, plus its keys / K."""
    if attention_cost_tokens is None:
        return float(count)
    keys = count * start + count * (count + 1) / 2  # token i attends start + i + 1 keys
    return count + keys / attention_cost_tokens


def tokens_within(start: int, wanted: int, budget: float, attention_cost_tokens: int | None) -> int:
    """The most tokens of `wanted` from `start` that the budget pays for (at least one if any budget
    is left, so a lone long decode is never starved)."""
    if budget <= 0 or wanted <= 0:
        return 0
    if attention_cost_tokens is None:
        return max(1, min(wanted, int(budget)))
    k = attention_cost_tokens
    # count^2 / 2K + count (1 + (start + 1/2) / K) - budget = 0
    linear = 1 + (start + 0.5) / k
    count = int((-linear + math.sqrt(linear * linear + 2 * budget / k)) * k)
    count = max(1, min(wanted, count))
    while count > 1 and chunk_cost(start, count, k) > budget:
        count -= 1
    return count
