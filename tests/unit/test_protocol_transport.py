"""The transport pieces under every dialect: SSE keep-alive and the admission queue (pure asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from ember.protocols.errors import QueueTimeout, ServerOverloaded, ServerUnavailable
from ember.protocols.fields import Fields
from ember.protocols.sse import KEEP_ALIVE
from ember.server.admission import Admission
from ember.server.event_stream import EventStreamResponse


def run(coro):
    return asyncio.run(coro)


async def _never_leaves():
    await asyncio.Event().wait()


def _bodies(messages: list[dict]) -> list[bytes]:
    return [m["body"] for m in messages if m["type"] == "http.response.body" and m["body"]]


def test_keep_alive_fills_idle_gaps_and_passes_frames_through():
    async def scenario():
        sent: list[dict] = []
        release = asyncio.Event()

        async def frames():
            yield b"first"
            await release.wait()
            yield b"second"

        async def send(message):
            sent.append(message)
            if _bodies(sent).count(KEEP_ALIVE) == 3:
                release.set()

        response = EventStreamResponse(frames(), lambda: None, keep_alive=0.01)
        await asyncio.wait_for(response({"type": "http"}, _never_leaves, send), 10)
        return sent

    sent = run(scenario())
    bodies = _bodies(sent)
    assert sent[0]["type"] == "http.response.start" and sent[-1] == {"type": "http.response.body", "body": b"",
                                                                     "more_body": False}
    assert bodies[0] == b"first" and bodies[-1] == b"second" and bodies.count(KEEP_ALIVE) >= 3


def test_a_busy_stream_sends_no_keep_alive():
    async def scenario():
        sent: list[dict] = []

        async def frames():
            for _ in range(50):
                await asyncio.sleep(0.002)
                yield b"data: {}\n\n"

        async def send(message):
            sent.append(message)

        response = EventStreamResponse(frames(), lambda: None, keep_alive=0.05)
        await asyncio.wait_for(response({"type": "http"}, _never_leaves, send), 10)
        return _bodies(sent)

    bodies = run(scenario())
    assert len(bodies) == 50 and KEEP_ALIVE not in bodies


def test_a_client_leaving_an_idle_stream_cleans_up_its_source_and_ticket():
    async def scenario():
        closed, sent = [], []
        left = asyncio.Event()

        async def frames():
            try:
                yield b"one"
                await asyncio.sleep(3600)
                yield b"never"
            finally:
                closed.append("frames")

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message.get("body") == KEEP_ALIVE:  # the source is waiting: the client goes
                left.set()

        response = EventStreamResponse(frames(), lambda: closed.append("ticket"), keep_alive=0.01)
        await asyncio.wait_for(response({"type": "http"}, receive, send), 10)
        return closed, _bodies(sent)

    closed, bodies = run(scenario())
    assert closed == ["frames", "ticket"] and bodies[0] == b"one" and b"never" not in bodies


def test_a_client_that_stops_reading_is_cut_off_and_its_source_closed():
    """The client's buffers are full: a send never returns. After stalled_timeout the stream ends,
    its frames are closed (the engine run is aborted) and its ticket is released, whether the
    stalled send is a frame's or a keep-alive comment's."""

    async def scenario(stuck_on: bytes):
        closed = []

        async def frames():
            try:
                yield b"one"
                if stuck_on == b"two":
                    yield b"two"
                await asyncio.sleep(3600)
            finally:
                closed.append("frames")

        async def send(message):
            if message.get("body") == stuck_on:
                await asyncio.sleep(3600)

        response = EventStreamResponse(frames(), lambda: closed.append("ticket"), keep_alive=0.02,
                                       stalled_timeout=0.1)
        began = asyncio.get_running_loop().time()
        await asyncio.wait_for(response({"type": "http"}, _never_leaves, send), 10)
        return closed, asyncio.get_running_loop().time() - began

    for stuck_on in (b"two", KEEP_ALIVE):
        closed, took = run(scenario(stuck_on))
        assert closed == ["frames", "ticket"] and took >= 0.1, stuck_on


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

        response = EventStreamResponse(frames(), lambda: closed.append("ticket"), keep_alive=5, stalled_timeout=30)
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
    assert f.object("o").boolean("k") is True and f.object("o").path_of("k") == "root.o.k"
    with pytest.raises(Exception) as caught:
        f.string("d", choices=["y"])
    assert caught.value.param == "root.d"
