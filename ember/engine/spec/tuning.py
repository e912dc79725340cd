"""How many tokens to draft for a request next: fixed, or tuned from what it accepted so far."""

from __future__ import annotations

from ember.config import MAX_DRAFT_TOKENS

_START = 4  # the first round's draft length when tuned
_SMOOTHING = 0.5  # weight of the latest round in the running acceptance
_GIVE_UP_RATE = 0.15  # below this running acceptance a request pauses drafting...
_PAUSE_ROUNDS = 8  # ...for this many steps, doubling each time it pauses again (at most 64)


class DraftLength:
    """Per request. Tuned: the next draft is a little longer than the run of tokens the request
    has been accepting (one more than the running mean of accepted tokens), and a request whose
    drafts keep failing pauses drafting for a while, so text that does not repeat costs nothing."""

    __slots__ = ("fixed", "_accepted", "_rate", "_pause", "_paused_for")

    def __init__(self, fixed: int | None) -> None:
        self.fixed = fixed
        self._accepted = float(_START - 1)  # running mean of accepted tokens per round
        self._rate = 1.0  # running share of drafted tokens accepted
        self._pause = 0  # steps left without drafting
        self._paused_for = _PAUSE_ROUNDS

    def next(self) -> int:
        """Tokens to draft this step (0: none)."""
        if self._pause:
            self._pause -= 1
            return 0
        if self.fixed is not None:
            return self.fixed
        return max(1, min(MAX_DRAFT_TOKENS, round(self._accepted) + 1))

    def record(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self._accepted += _SMOOTHING * (accepted - self._accepted)
        self._rate += _SMOOTHING * (accepted / proposed - self._rate)
        if self.fixed is None and self._rate < _GIVE_UP_RATE:
            self._pause = self._paused_for
            self._paused_for = min(self._paused_for * 2, 64)
            self._rate = 0.5  # a fresh chance after the pause
        elif accepted == proposed:
            self._paused_for = _PAUSE_ROUNDS
