"""One request as the client saw it: what was asked, what the server reported, when each chunk came."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

OK = "ok"
CANCELLED = "cancelled"  # still running when the level hit --max-seconds or Ctrl-C


class LevelClock:
    """Seconds since a level started, on the monotonic high-resolution clock."""

    def __init__(self) -> None:
        self.started_at = time.time()  # wall-clock, for the JSON only
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    level: int
    index: int  # order of sending within the level
    input_len: int  # prompt length aimed at
    output_len: int  # max_tokens sent
    conversation: int | None = None
    turn: int | None = None
    # "ok", the HTTP status of a refusal ("429", "500"), or what went wrong: "stream_error" (an error
    # event inside a 200 stream), "incomplete" (the stream closed before [DONE]), "timeout",
    # "connection_error", "bad_response", "cancelled", "engine_error" (offline)
    outcome: str = CANCELLED
    status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None  # from the server's usage, never counted here
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where reported
    # Times in seconds since the level started.
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # every chunk that carried output text
    ended: float | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    @property
    def first_token(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.ended - self.sent if self.ended is not None else None

    @property
    def inter_token_gaps(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: the decode pace one user sees."""
        if self.completion_tokens is None or self.completion_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)

    @property
    def output_tokens_per_s(self) -> float | None:
        e2e = self.e2e
        if self.completion_tokens is None or not e2e:
            return None
        return self.completion_tokens / e2e

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id, "level": self.level, "index": self.index,
            "conversation": self.conversation, "turn": self.turn, "outcome": self.outcome, "status": self.status,
            "error": self.error, "input_len": self.input_len, "output_len": self.output_len,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens, "sent": self.sent, "first_token": self.first_token,
            "ended": self.ended, "chunk_times": self.chunk_times, "ttft": self.ttft, "e2e": self.e2e,
            "tpot": self.tpot,
        }
