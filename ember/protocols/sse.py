"""Server-sent events: framing, the end marker, and the keep-alive comment (sent while a stream is
idle: ember.server.event_stream)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KEEP_ALIVE = b": keep-alive\n\n"
DONE = "[DONE]"


@dataclass(slots=True)
class ServerEvent:
    """One SSE event: a JSON object (or a raw string such as [DONE]), with an optional event name."""

    data: Any
    event: str | None = None


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode(event: ServerEvent) -> bytes:
    data = event.data if isinstance(event.data, str) else dumps(event.data)
    head = f"event: {event.event}\n" if event.event else ""
    return f"{head}data: {data}\n\n".encode()
