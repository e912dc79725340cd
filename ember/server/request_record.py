"""The record of one HTTP request, filled in as it passes through the server: its ids, route,
outcome, the validated request and its result. What is said about it (the log line, the request
log's events, /debug/requests, metrics) is built from it elsewhere (server.request_events)."""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field

from ember.protocols.errors import OPENAI_ERRORS, ErrorShape
from ember.protocols.neutral import GenerationRequest, RunResult
from ember.types import SamplingParams

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
SESSION_HEADER = b"x-session-id"


def session_tag(key: str) -> str:
    """A client's session key as the log and the router keep it: as sent when it is a plain id of
    up to 128 characters, else a digest of it (no client text of any length or alphabet in the log)."""
    if _CLIENT_ID.fullmatch(key):
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()[:32]


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
    model: str | None = None  # the public id of the model it was routed to
    errors: ErrorShape = OPENAI_ERRORS  # how refusals on this route are answered
    error_type: str | None = None
    error_code: str | None = None
    error_param: str | None = None
    error_message: str | None = None  # a refusal's own words (the request log's request_rejected)
    phase: str = "parse"  # how far it got: parse, prepare (template, fit, constraint), admission, run
    prompt_tokens: int | None = None
    job: GenerationRequest | None = None  # the validated request, of whichever dialect
    params: SamplingParams | None = None  # its resolved sampling (max_tokens fitted to the window)
    admitted: float | None = None  # time.time() when it was admitted to run; request_start was logged then
    result: RunResult | None = None
    client_gone: bool = False
    tenant: str | None = None  # the owner of its API key, when the server takes keys
    session: str | None = None  # the client's session (prompt_cache_key, else X-Session-Id), by session_tag
    ignored_fields: list[str] = field(default_factory=list)  # as the x-ember-ignored-fields header lists them

    @classmethod
    def from_scope(cls, scope) -> "RequestRecord":
        client_id = session = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                text = value.decode("latin-1")
                client_id = text if _CLIENT_ID.fullmatch(text) else None
            elif name == SESSION_HEADER and value:
                session = session_tag(value.decode("latin-1"))
        record = cls(scope.get("method", ""), scope.get("path", ""), "")
        record.request_id = client_id or record.internal_id
        record.session = session
        return record

    def note_error(self, error) -> None:
        self.error_type = getattr(error, "type", None)
        self.error_code = getattr(error, "code", None) or getattr(error, "type", None)
        self.error_param = getattr(error, "param", None)
        self.error_message = getattr(error, "message", None)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
