"""The transport pieces under every dialect: SSE keep-alive and the admission queue (pure asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from ember.protocols.errors import QueueTimeout, ServerOverloaded, ServerUnavailable
from ember.protocols.fields import Fields
from ember.protocols.sse import KEEP_ALIVE, with_keep_alive
from ember.server.admission import Admission
from ember.server.pipeline import EventStreamResponse


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_fills_idle_gaps_and_passes_frames_through():
    gate = asyncio.Event

    async def scenario():
        release = gate()

        async def source():
            yield b"first"
            await release.wait()
            yield b"second"

        received = []
        async for frame in with_keep_alive(source(), interval=0.01):
            received.append(frame)
            if received.count(KEEP_ALIVE) == 3:
                release.set()
        return received

    received = run(scenario())
    assert received[0] == b"first" and received[-1] == b"second"
    assert received.count(KEEP_ALIVE) >= 3


def test_closing_the_stream_cleans_up_its_source():
    async def scenario():
        cleaned = asyncio.Event()

        async def source():
            try:
                yield b"one"
                await asyncio.sleep(3600)
                yield b"never"
            finally:
                cleaned.set()

        stream = with_keep_alive(source(), interval=0.01)
        assert await stream.__anext__() == b"one"
        assert await stream.__anext__() == KEEP_ALIVE  # the source is now waiting
        await stream.aclose()
        return cleaned.is_set()

    assert run(scenario())


def test_a_stream_cancelled_as_its_next_frame_arrives_still_cleans_up_its_source():
    """The client leaves in the same turn of the event loop as the source yields: the frame it
    will never send is dropped, and the source is closed then, not whenever it is collected."""

    async def scenario():
        closed = []
        ready = asyncio.Event()

        async def source():
            try:
                yield b"one"
                await ready.wait()
                yield b"two"
                await asyncio.sleep(3600)
            finally:
                closed.append(True)

        stream = with_keep_alive(source(), interval=60)
        assert await stream.__anext__() == b"one"
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the reader now waits for the source
        ready.set()
        await asyncio.sleep(0)  # the source has yielded "two"; the reader has not woken yet
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        return list(closed)  # as of now: the loop's own shutdown would close it later

    assert run(scenario()) == [True]


def test_a_stream_stops_at_its_next_frame_when_its_client_leaves_even_if_the_cancellation_is_lost():
    """The client leaves after the first frame; the server's send swallows the cancellation meant to
    stop the writer (what asyncio.wait_for does before Python 3.12 when a send finishes as it is
    cancelled). The stream must still stop, close its frames and release its ticket."""

    async def scenario():
        produced, closed = [], []
        left = asyncio.Event()

        async def frames():
            try:
                for index in range(10_000):
                    produced.append(index)
                    yield b"data: {}\n\n"
                    await asyncio.sleep(0)
            finally:
                closed.append("frames")

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message.get("body"):
                left.set()
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass

        response = EventStreamResponse(frames(), lambda: closed.append("ticket"), stalled_timeout=30)
        await asyncio.wait_for(response({"type": "http"}, receive, send), 10)
        return produced, closed

    produced, closed = run(scenario())
    assert len(produced) <= 3 and closed == ["frames", "ticket"]


def test_admission_runs_waits_refuses_and_times_out():
    async def scenario():
        admission = Admission(capacity=2, max_pending=1, timeout=0.05)
        a = await admission.acquire()
        b = await admission.acquire()
        assert admission.num_running == 2
        waiter = asyncio.ensure_future(admission.acquire())
        await asyncio.sleep(0)
        assert admission.num_waiting == 1
        with pytest.raises(ServerOverloaded) as full:
            await admission.acquire()
        assert full.value.status == 429 and full.value.retry_after > 0
        a.release()
        a.release()  # releasing twice is harmless
        c = await waiter
        assert admission.in_use == 2 and admission.num_waiting == 0
        with pytest.raises(QueueTimeout) as late:
            await admission.acquire()
        assert late.value.status == 503 and admission.num_waiting == 0
        b.release()
        c.release()
        assert admission.in_use == 0 and admission.num_running == 0

    run(scenario())


def test_admission_weights_and_fifo_order():
    async def scenario():
        admission = Admission(capacity=4, max_pending=8, timeout=0)
        held = await admission.acquire(3)
        big = asyncio.ensure_future(admission.acquire(4))
        small = asyncio.ensure_future(admission.acquire(1))
        await asyncio.sleep(0)
        assert not big.done() and not small.done()  # first come, first served
        held.release()
        assert (await big).weight == 4
        assert not small.done()
        (await asyncio.wait_for(_release_then(big.result(), small), 1)).release()
        assert (await admission.acquire(100)).weight == 4  # clamped to the capacity

    async def _release_then(ticket, future):
        ticket.release()
        return await future

    run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_close_refuses_everyone():
    async def scenario():
        admission = Admission(capacity=1, max_pending=4, timeout=0)
        held = await admission.acquire()
        cancelled = asyncio.ensure_future(admission.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert admission.num_waiting == 0
        waiting = asyncio.ensure_future(admission.acquire())
        await asyncio.sleep(0)
        admission.close(ServerUnavailable("stopping"))
        with pytest.raises(ServerUnavailable):
            await waiting
        with pytest.raises(ServerUnavailable):
            await admission.acquire()
        held.release()
        assert admission.in_use == 0

    run(scenario())


def test_fields_reader():
    f = Fields({"a": 1, "b": None, "c": 2.0, "d": "x", "e": [1], "o": {"k": True}}, "root")
    assert f.integer("a") == 1 and f.integer("b", 5) == 5 and f.integer("c") == 2
    assert f.string("d", choices=["x", "y"]) == "x" and f.array("e") == [1]
    assert f.object("o").boolean("k") is True and f.object("o").at("k") == "root.o.k"
    with pytest.raises(Exception) as caught:
        f.string("d", choices=["y"])
    assert caught.value.param == "root.d"
