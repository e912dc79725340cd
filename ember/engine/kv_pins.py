"""Pins on cached blocks (a request's `SamplingParams.cache_pins`, from cache breakpoints).

A pin keeps a block hash in the prefix cache until it expires: the KV manager sets a pinned block
aside when no request holds it, instead of queueing it for eviction. A block is pinned for the
longest TTL among the request's pins that cover it; reading a pinned block renews its pin for its
own TTL. At most `max_blocks` hashes are pinned at once; a pin beyond that is refused.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence

from ember.types import CachePin


class PinTable:
    """Block hashes pinned until their expiry, on an injectable clock."""

    def __init__(self, max_blocks: int, clock: Callable[[], float]) -> None:
        self.max_blocks = max_blocks
        self.num_refused = 0  # blocks a pin could not keep: the table was full
        self._clock = clock
        self._pins: dict[bytes, tuple[float, float]] = {}  # block hash -> (expires at, its TTL in seconds)
        self._expiries: list[tuple[float, bytes]] = []  # heap; entries no longer in _pins are stale

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, block_hash: bytes | None) -> bool:
        return block_hash in self._pins

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._pins)

    def expires_at(self, block_hash: bytes) -> float:
        return self._pins[block_hash][0]

    def pin_blocks(self, blocks: Iterable[tuple[bytes, int]], cache_pins: Sequence[CachePin]) -> list[bytes]:
        """Pin or renew each (hash, the number of tokens up to its block's end), in order: for the
        longest TTL among `cache_pins` that covers the block, or when none does and it is pinned
        already, for its own TTL. Returns the hashes pinned now (refused ones are not)."""
        now = self._clock()
        pinned = []
        for block_hash, end in blocks:
            ttl = max((pin.ttl_s for pin in cache_pins if pin.num_tokens >= end), default=None)
            if ttl is None:
                if block_hash not in self._pins:
                    continue
                ttl = self._pins[block_hash][1]
            if self._pin(block_hash, ttl, now):
                pinned.append(block_hash)
        return pinned

    def _pin(self, block_hash: bytes, ttl: float, now: float) -> bool:
        current = self._pins.get(block_hash)
        if current is None and len(self._pins) >= self.max_blocks:
            self.num_refused += 1
            return False
        expires = max(now + ttl, current[0] if current else 0.0)
        longest = max(ttl, current[1] if current else 0.0)
        if current != (expires, longest):
            self._pins[block_hash] = (expires, longest)
            heapq.heappush(self._expiries, (expires, block_hash))
        return True

    def num_leading_pinned(self, block_hashes: Sequence[bytes], limit: int) -> int:
        """How many of the first `limit` hashes are pinned, counting from the first up to the first
        that is not."""
        count = 0
        while count < min(limit, len(block_hashes)) and block_hashes[count] in self._pins:
            count += 1
        return count

    def expire(self) -> list[bytes]:
        """Drop the pins whose time has come; returns their hashes, soonest expired first."""
        now = self._clock()
        expired = []
        while self._expiries and self._expiries[0][0] <= now:
            expires, block_hash = heapq.heappop(self._expiries)
            current = self._pins.get(block_hash)
            if current is not None and current[0] == expires:
                del self._pins[block_hash]
                expired.append(block_hash)
        return expired

    def unpin(self, block_hash: bytes) -> None:
        del self._pins[block_hash]
