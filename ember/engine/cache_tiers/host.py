"""The host-memory tier: blocks evicted from the KV pool, kept by their chained hash in a bounded
store with its own least-recently-used order.

A block's data is an immutable tensor (layers, k/v, kv_heads, block elements) on the host; a load
reads it and leaves it here, so the pool and this store may both hold a block (a block that comes
back to the pool and is evicted again is only moved to the back of the order, not copied twice).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.evictions = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data

    def put(self, block_hash: bytes, data: torch.Tensor) -> None:
        """Keep `data` (which no one writes again) under its hash, dropping the least recently
        used blocks to stay within the capacity; a block larger than it all is not kept."""
        size = data.numel() * data.element_size()
        if block_hash in self._blocks or size > self.capacity_bytes:
            return
        while self.num_bytes + size > self.capacity_bytes:
            _, dropped = self._blocks.popitem(last=False)
            self.num_bytes -= dropped.numel() * dropped.element_size()
            self.evictions += 1
        self._blocks[block_hash] = data
        self.num_bytes += size

    def touch(self, block_hash: bytes) -> bool:
        """Mark a held block as just used; False when it is not held."""
        if block_hash not in self._blocks:
            return False
        self._blocks.move_to_end(block_hash)
        return True
