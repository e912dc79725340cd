"""Server-sent events: framing, the end marker, and keep-alive comments while a stream is idle."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

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


async def with_keep_alive(frames: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """Pass frames through; after `interval` seconds without one, send a comment line instead.

    The source is never cancelled by a timeout: only when this iterator is closed (the client
    left, the server stops) is its pending read cancelled, which lets the source clean up.
    """
    source = frames.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait((pending,), timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            finished, pending = pending, None
            try:
                frame = finished.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, Exception):  # the source's own cleanup; nothing to report
                pass
        # Closed in every case: a read that finished as it was cancelled left the source waiting
        # at its next yield (closing a source that has ended does nothing).
        await _close(source)


async def _close(source) -> None:
    close = getattr(source, "aclose", None)
    if close is not None:
        await close()
