"""Prompt lookup: the tokens that followed the earlier occurrence of the sequence's suffix that
matches it furthest back."""

from __future__ import annotations

_LONG_LENGTHS = (8, 16, 32)  # looked up above max_n too, so that a match this long is found directly
_CANDIDATES = 16  # the latest occurrences of the looked-up n-gram that are compared further back
LONGEST_MATCH = 64  # a match is followed back this many tokens at most


class NgramIndex:
    """One request's n-grams, of `min_n` to `max_n` tokens and of 8, 16 and 32: where each one
    ended, latest last (keyed by the n-gram's hash; a match is checked token by token).

    A lookup takes the longest of those lengths that ends the sequence and occurred before, then
    follows its latest occurrences back token by token and keeps the one that matches the sequence
    furthest back (the most recent among equals): in a long file a short n-gram such as
    `return self.` recurs on many lines, and the occurrence with the longest shared past is the one
    being copied. The index grows with the sequence (each token is indexed once), so a lookup costs
    a few dict reads and at most _CANDIDATES short comparisons however long the context is.
    """

    __slots__ = ("min_n", "max_n", "_ends", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        lengths = [*range(min_n, max_n + 1), *(n for n in _LONG_LENGTHS if n > max_n)]
        self._ends: dict[int, dict[int, int | list[int]]] = {n: {} for n in reversed(lengths)}
        self._indexed = 0  # n-grams ending before this position are indexed

    def propose(self, token_ids: list[int], num_tokens: int) -> tuple[list[int], int]:
        """Up to num_tokens tokens that followed the best earlier match of token_ids' suffix, and
        the match's length in tokens (0: none; at most LONGEST_MATCH). A longer match is likelier
        to go on matching."""
        length = len(token_ids)
        # index every n-gram that ends before the last position (the suffix itself is not a match)
        for end in range(max(self._indexed, self.min_n), length):
            for n, ends_of in self._ends.items():
                if end >= n:
                    key = hash(tuple(token_ids[end - n:end]))
                    ends = ends_of.get(key)
                    if ends is None:  # most n-grams occur once: an int until a second occurrence
                        ends_of[key] = end
                    elif type(ends) is int:
                        ends_of[key] = [ends, end]
                    else:
                        ends.append(end)
                        if len(ends) >= 2 * _CANDIDATES:  # only the latest are ever compared
                            del ends[:_CANDIDATES]
        self._indexed = max(self._indexed, length)
        for n, ends_of in self._ends.items():  # longest first
            ends = ends_of.get(hash(tuple(token_ids[length - n:]))) if n <= length else None
            if ends is not None:
                end, matched = _furthest_match(token_ids, [ends] if type(ends) is int else ends[-_CANDIDATES:])
                if matched >= n:  # else the hashes collided
                    return token_ids[end:end + num_tokens], matched
        return [], 0


def _furthest_match(token_ids: list[int], ends: list[int]) -> tuple[int, int]:
    """Of the earlier positions `ends` (ascending), the one whose preceding tokens match the
    sequence's last tokens furthest back: (that position, the match's length)."""
    length = len(token_ids)
    best_end, best = ends[-1], -1
    for end in reversed(ends):
        matched = 0
        most = min(LONGEST_MATCH, end)  # an occurrence cannot reach back before the sequence starts
        while (matched + 8 <= most
               and token_ids[end - matched - 8:end - matched] == token_ids[length - matched - 8:length - matched]):
            matched += 8
        while matched < most and token_ids[end - matched - 1] == token_ids[length - matched - 1]:
            matched += 1
        if matched > best:
            best_end, best = end, matched
            if matched == LONGEST_MATCH:
                break
    return best_end, best
