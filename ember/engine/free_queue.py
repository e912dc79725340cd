"""The pool's free blocks in the order allocation takes them, front first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class FreeQueue:
    """Block ids in a queue that can also give one block's place to another.

    Each id sits under a key of its own, and the order is the keys', so `replace` puts a block at
    the very place of another (a cached block's data moved to another block keeps its turn to be
    evicted). Every operation is O(1).
    """

    __slots__ = ("_blocks", "_key_of", "_next_key")

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._blocks: OrderedDict[int, int] = OrderedDict()  # key -> block id, front first
        self._key_of: dict[int, int] = {}
        self._next_key = 0
        for block_id in block_ids:
            self.append(block_id)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._key_of

    def __len__(self) -> int:
        return len(self._key_of)

    def __iter__(self) -> Iterator[int]:
        return iter(self._blocks.values())

    def front(self) -> int:
        return next(iter(self._blocks.values()))

    def append(self, block_id: int) -> None:
        """Put block_id at the back (taken last)."""
        self._key_of[block_id] = self._next_key
        self._blocks[self._next_key] = block_id
        self._next_key += 1

    def move_to_front(self, block_id: int) -> None:
        self._blocks.move_to_end(self._key_of[block_id], last=False)

    def remove(self, block_id: int) -> None:
        del self._blocks[self._key_of.pop(block_id)]

    def pop_front(self) -> int:
        key, block_id = self._blocks.popitem(last=False)
        del self._key_of[block_id]
        return block_id

    def replace(self, block_id: int, by: int) -> None:
        """Put `by` (not queued) where block_id is, and take block_id out."""
        key = self._key_of.pop(block_id)
        self._blocks[key] = by
        self._key_of[by] = key
