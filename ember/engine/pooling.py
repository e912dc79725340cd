"""Pooling requests: a prompt's final hidden states become one vector, without keeping them.

A pooling request is a prompt-only request (max_tokens 0) whose SamplingParams name a pooling
method. Each step the runner gathers only the rows its method needs from the chunk it ran
(`step_parts`): the last row once the chunk ends the prompt, the first row when it starts it, or the
sum of the chunk's rows for a mean. The core adds the parts up across chunks (`PooledPrompts`) and
puts the vector in the request's final output. A mean sums in float64, so that how the prompt was cut
into chunks (which depends on its neighbours) leaves the float32 result's bits alone.

A classifier's reading (CLASSIFY) is the last row through the model's head (its compute_logits: a
score head, one logit per label), applied here in the worker so the hidden row never leaves it; the
rows of a step's classifying items go through the head in one call, whose bits the batch-invariance
row plan keeps (as it keeps the sampled rows' logits).

Mean and first-row pooling need every prompt row computed, so such requests take no prefix-cache
hits (Request.computes_whole_prompt); their blocks are cached when freed like any others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ember.types import CLASSIFY


def step_parts(hidden: torch.Tensor, items: Sequence,
               head: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
    """hidden: (T, hidden) of the step's rows, the items' tokens one after another; head: the
    model's compute_logits. Returns, by item index, each pooling item's part of its vector this step
    (float64: (hidden,), or (num_labels,) for CLASSIFY), where it has one."""
    parts: dict[int, torch.Tensor] = {}
    classified: dict[int, int] = {}  # item index -> its last row, read through the head
    begin = 0
    for index, item in enumerate(items):
        count = len(item.token_ids)
        if item.pooling == "mean":
            parts[index] = hidden[begin:begin + count].double().sum(dim=0)
        elif item.pooling == "cls" and item.start == 0:
            parts[index] = hidden[begin].double()
        elif item.pooling == "last" and item.ends_prompt:
            parts[index] = hidden[begin + count - 1].double()
        elif item.pooling == CLASSIFY and item.ends_prompt:
            classified[index] = begin + count - 1
        begin += count
    if classified:
        logits = head(hidden[torch.tensor(list(classified.values()), device=hidden.device)])
        parts.update({index: row.double() for index, row in zip(classified, logits)})
    return parts


class PooledPrompts:
    """The parts gathered so far of each live pooling request, by request id."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, request_id: str, part: torch.Tensor) -> None:
        held = self._sums.get(request_id)
        self._sums[request_id] = part if held is None else held + part

    def take(self, request_id: str, method: str, num_prompt_tokens: int) -> list[float] | None:
        """The request's vector (float32 values), once its prompt is done; None if no part came."""
        total = self._sums.pop(request_id, None)
        if total is None:
            return None
        if method == "mean":
            total = total / num_prompt_tokens
        return total.float().tolist()

    def forget(self, request_id: str) -> None:
        self._sums.pop(request_id, None)
