"""The SSE response every streaming route returns: frames out as they come, a keep-alive comment
while the stream is idle, and the stream cut off when its client leaves or stops reading.

One guard task per stream keeps the time (the next keep-alive, a send that has waited too long)
and sleeps until the nearest deadline: a frame costs a send and two clock reads, no task or
timer of its own, which matters once the front end streams thousands of tokens a second.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from starlette.responses import StreamingResponse

from ember.protocols.stream_format import SSE, StreamFormat

logger = logging.getLogger("ember.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def wait_for_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStreamResponse(StreamingResponse):
    """A streamed response (SSE unless `framing` says otherwise) that watches for the client leaving
    while it streams (whatever the ASGI server's version), and always cleans up: its frames are
    closed, which aborts the engine run, and its admission ticket is released, however the stream
    ends. After `keep_alive` seconds without a frame it sends the framing's keep-alive (SSE: a
    comment line; NDJSON has none), so proxies and clients keep a slow stream open (a long
    prompt's prefill, a wait in the queue). A client that reads nothing for `stalled_timeout`
    seconds (its socket's buffers full) is cut off, so it cannot hold a batch slot and KV blocks
    forever (0: never)."""

    def __init__(self, frames: AsyncIterator[bytes], on_close, keep_alive: float, stalled_timeout: float = 0.0,
                 framing: StreamFormat = SSE) -> None:
        super().__init__(frames, media_type=framing.media_type, headers=SSE_HEADERS)
        self.keep_alive_frame = framing.keep_alive
        self.frames = frames
        self._on_close = on_close
        self.keep_alive = keep_alive
        self.stalled_timeout = stalled_timeout

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        turn = asyncio.Lock()  # the writer's frames and the guard's comments go out one at a time
        last_sent = loop.time()
        sending_since: float | None = None  # when the send in progress began
        cut_off = False

        async def deliver(message) -> None:
            nonlocal last_sent, sending_since
            async with turn:
                sending_since = loop.time()
                await send(message)
                last_sent, sending_since = loop.time(), None

        watcher = asyncio.ensure_future(wait_for_disconnect(receive))

        async def stream() -> None:
            await deliver({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for frame in self.frames:
                # Cancelling this task is not enough to stop it: asyncio.wait_for before Python 3.12
                # drops a cancellation that lands as an awaited send finishes, and an ASGI server's
                # send returns quietly once the client has gone, so the stream would run to its end.
                if watcher.done() or cut_off:
                    return
                await deliver({"type": "http.response.body", "body": frame, "more_body": True})
            await deliver({"type": "http.response.body", "body": b"", "more_body": False})

        writer = asyncio.ensure_future(stream())
        comments: set[asyncio.Task] = set()

        def comment_sent(task: asyncio.Task) -> None:
            comments.discard(task)
            if not task.cancelled():
                task.exception()  # a failed send fails the writer's next one too: nothing more to say

        async def guard() -> None:
            """While the writer runs: a comment once the stream has been idle `keep_alive` seconds
            (sent by a task of its own, so that a comment the client does not read is timed like
            a frame), the writer stopped once a send has waited `stalled_timeout` seconds."""
            nonlocal cut_off
            stalled = self.stalled_timeout
            while True:
                now = loop.time()
                if sending_since is not None:
                    if stalled and now - sending_since >= stalled:
                        logger.warning("a stream's client read nothing for %g s: the stream is cut off", stalled)
                        cut_off = True
                        writer.cancel()
                        return
                    wake = sending_since + stalled if stalled else now + self.keep_alive
                elif self.keep_alive_frame is None:
                    wake = now + self.keep_alive  # nothing is sent while idle: only a stalled send is watched
                elif now - last_sent >= self.keep_alive:
                    comment = loop.create_task(deliver({"type": "http.response.body", "body": self.keep_alive_frame,
                                                        "more_body": True}))
                    comments.add(comment)
                    comment.add_done_callback(comment_sent)
                    await asyncio.sleep(0)  # the comment's send begins, or waits for the writer's
                    continue
                else:
                    wake = last_sent + self.keep_alive
                await asyncio.sleep(wake - now)

        timer = asyncio.ensure_future(guard())
        try:
            await asyncio.wait((writer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            tasks = (writer, watcher, timer, *comments)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await self.frames.aclose()
            finally:
                self._on_close()
        if not writer.cancelled() and writer.exception() is not None:
            raise writer.exception()
