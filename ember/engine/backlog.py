"""Backpressure for a request whose consumer stopped reading: a stream whose client reads nothing
blocks the front end's writes once the connection's buffers are full, and from then on the
engine's tokens pile up unread in the request's queue (engine.streams). Past a bound the engine
is told to pause the request (messages.Pause: it keeps its blocks and takes no step budget); once
the consumer has taken the queue below half the bound, to resume it (messages.Resume).

The bound counts tokens, not bytes, and can be small: the queue grows only once the connection's
buffers are full (about half a MiB: server.cli bounds the socket's send buffer), so a client that
reads again has all of that to read while its request resumes, and a pause costs it nothing it
would see. 64 tokens of frames are 10-100 KiB (a few hundred bytes a token, a few KiB with top
logprobs).
"""

from __future__ import annotations

MAX_UNREAD_TOKENS = 64


class Backlog:
    """One request's tokens delivered to its queue and not yet taken by its consumer."""

    __slots__ = ("limit", "unread", "paused")

    def __init__(self, limit: int = MAX_UNREAD_TOKENS) -> None:
        self.limit = limit
        self.unread = 0
        self.paused = False  # the engine was told to pause it, and not since to resume

    def delivered(self, num_tokens: int) -> bool:
        """True when the request should be paused now."""
        self.unread += num_tokens
        if self.paused or self.unread <= self.limit:
            return False
        self.paused = True
        return True

    def taken(self, num_tokens: int) -> bool:
        """True when the request should be resumed now."""
        self.unread -= num_tokens
        if not self.paused or self.unread >= self.limit // 2:
            return False
        self.paused = False
        return True

    def engine_forgot(self) -> None:
        """The engine that held the pause is gone (a worker restarted): the next delivery past the
        bound pauses the request again."""
        self.paused = False
