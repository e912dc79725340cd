"""One record per HTTP request, and the one log line it becomes: ids and numbers, never text."""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ember.protocols.errors import openai_error_body
from ember.protocols.neutral import RunResult

logger = logging.getLogger("ember.request")

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_QUIET_PATHS = ("/health", "/v1/health", "/metrics")


@dataclass(slots=True)
class RequestRecord:
    method: str
    path: str
    request_id: str  # the x-request-id header: the client's own if it sent a sane one
    internal_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # unique; names engine requests
    received: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)
    status: int | None = None
    route: str | None = None  # the dialect, for generation routes
    error_body: Callable[[Any], dict] = openai_error_body  # how errors on this route are shaped
    error_shape: Any = None  # or an ErrorShape (status, body with the request id, id header), which wins
    error_type: str | None = None
    error_code: str | None = None
    error_param: str | None = None
    prompt_tokens: int | None = None
    job: Any = None  # the validated GenerationRequest
    params: Any = None  # its resolved SamplingParams (max_tokens fitted to the window)
    admitted: float | None = None  # time.time() when it was admitted to run; request_start was logged then
    result: RunResult | None = None
    client_gone: bool = False

    @classmethod
    def from_scope(cls, scope) -> "RequestRecord":
        client_id = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                text = value.decode("latin-1")
                client_id = text if _CLIENT_ID.fullmatch(text) else None
        record = cls(scope.get("method", ""), scope.get("path", ""), "")
        record.request_id = client_id or record.internal_id
        return record

    def note_error(self, error) -> None:
        self.error_type = getattr(error, "type", None)
        self.error_code = getattr(error, "code", None) or getattr(error, "type", None)
        self.error_param = getattr(error, "param", None)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def line(self) -> str:
        elapsed = self.elapsed()
        parts = [f"{self.request_id} {self.method} {self.path} {self.status if self.status else '-'}"]
        if self.prompt_tokens is not None:
            parts.append(f"prompt={self.prompt_tokens}")
        result = self.result
        if result is not None:
            timings = result.timings()
            first = result.first_token_time()
            ttft = f"{(first - self.received) * 1000:.0f}ms" if first is not None else "-"
            reasons = ",".join(sorted({c.finish_reason.value for c in result.choices if c.finish_reason})) or "-"
            parts.append(f"cached={result.num_cached_tokens} completion={result.num_completion_tokens} "
                         f"ttft={ttft} tok/s={timings['predicted_per_second']:.1f} finish={reasons}")
            if len(result.choices) > 1:
                parts.append(f"n={len(result.choices)}")
        if self.client_gone:
            parts.append("client_gone")
        if self.error_code:
            parts.append(f"error={self.error_code}" + (f" param={self.error_param}" if self.error_param else ""))
        parts.append(f"{elapsed:.3f}s")
        return " ".join(parts)

    def log(self) -> None:
        level = logging.DEBUG if self.path in _QUIET_PATHS else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(level, "%s", self.line())
