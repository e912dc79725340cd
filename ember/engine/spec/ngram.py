"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations


class NgramIndex:
    """One request's n-grams, from `min_n` to `max_n` tokens: where each one last ended.

    The index grows with the sequence (each token is indexed once), so a lookup costs a few dict
    reads however long the context is.
    """

    __slots__ = ("min_n", "max_n", "_ends", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # n-grams ending before this position are indexed

    def propose(self, token_ids: list[int], num_tokens: int) -> tuple[list[int], int]:
        """Up to num_tokens tokens that followed the longest suffix of token_ids seen before, and
        that suffix's length (0: none matched). A longer match is likelier to go on matching."""
        length = len(token_ids)
        # index every n-gram that ends before the last position (the suffix itself is not a match)
        for end in range(max(self._indexed, self.min_n), length):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(token_ids[end - n:end])] = end
        self._indexed = max(self._indexed, length)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._ends[n].get(tuple(token_ids[length - n:]))
            if end is not None:
                return token_ids[end:end + num_tokens], n
        return [], 0
