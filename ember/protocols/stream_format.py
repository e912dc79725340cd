"""How a dialect frames a stream of events on the wire: server-sent events (OpenAI, Anthropic) or
newline-delimited JSON (Ollama), each with its media type and what is sent while the stream idles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ember.protocols import sse
from ember.protocols.sse import ServerEvent


@dataclass(frozen=True, slots=True)
class StreamFormat:
    media_type: str
    encode: Callable[[ServerEvent], bytes]
    keep_alive: bytes | None  # sent after an idle interval; None: nothing (a blank line is no JSON object)

    def frames(self, events: list[ServerEvent]) -> bytes:
        return b"".join(self.encode(event) for event in events)


def encode_line(event: ServerEvent) -> bytes:
    """One JSON object on a line of its own; the event name, if any, is not part of this framing."""
    return sse.json_bytes(event.data) + b"\n"


SSE = StreamFormat("text/event-stream", sse.encode, sse.KEEP_ALIVE)
NDJSON = StreamFormat("application/x-ndjson", encode_line, None)
