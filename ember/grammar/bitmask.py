"""The packed token bitmask a grammar fills and the sampler applies (xgrammar's layout)."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 packed bits -> (rows, vocab_size) bool: bit j of word i is id 32 * i + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
