"""Admission keeps background requests in a pool of their own, so they never queue ahead of
foreground ones (the engine's scheduler arbitrates between the two)."""

import asyncio

from ember.server.admission import Admission


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_background_flood_never_holds_a_foreground_request_in_the_queue():
    async def scenario():
        admission = Admission(capacity=1, max_pending=10, timeout=0)
        running = await admission.acquire(background=True)
        flood = [asyncio.ensure_future(admission.acquire(background=True)) for _ in range(3)]
        await settle()
        assert admission.num_waiting == 3
        foreground = await asyncio.wait_for(admission.acquire(), 1)  # its pool is empty: at once
        assert admission.in_use_by_pool == {False: 1, True: 1}
        waiting_foreground = asyncio.ensure_future(admission.acquire())
        await settle()
        assert not waiting_foreground.done()  # a foreground request still waits for foreground ones
        foreground.release()
        await settle()
        assert waiting_foreground.done() and not any(f.done() for f in flood)
        (await waiting_foreground).release()
        running.release()
        await settle()
        assert flood[0].done() and not flood[1].done()  # background requests in arrival order
        for future in flood:
            (await future).release()
            await settle()
        assert admission.in_use == 0 and admission.in_use_by_pool == {False: 0, True: 0}
        assert admission.num_waiting == 0 and admission.num_running == 0

    asyncio.run(scenario())
