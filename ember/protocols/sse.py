"""Server-sent events: framing, the end marker, and the keep-alive comment (sent while a stream is
idle: ember.server.event_stream)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

KEEP_ALIVE = b": keep-alive\n\n"
DONE = "[DONE]"


@dataclass(slots=True)
class ServerEvent:
    """One SSE event: a JSON object (or a raw string such as [DONE]), with an optional event name."""

    data: Any
    event: str | None = None


# msgspec writes the same compact UTF-8 JSON as json.dumps(ensure_ascii=False, separators=(",", ":")),
# a tenth of the time (a frame per token per stream); the dialects send finite floats only (a
# token of zero probability is reported as -9999).
_json = msgspec.json.Encoder()


def json_bytes(data: Any) -> bytes:
    return _json.encode(data)


def encode(event: ServerEvent) -> bytes:
    data = event.data.encode() if isinstance(event.data, str) else _json.encode(event.data)
    head = b"event: " + event.event.encode() + b"\n" if event.event else b""
    return head + b"data: " + data + b"\n\n"
