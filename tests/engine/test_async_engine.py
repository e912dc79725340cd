"""The asyncio client: concurrent streams, early exit aborts, invariants checked on the engine thread."""

import asyncio
import threading

import pytest

from ember import SamplingParams
from ember.engine.backlog import MAX_UNREAD_TOKENS
from ember.engine.engine import AsyncEngine
from ember.errors import ContextLengthExceeded


def test_streams_match_offline_and_early_exit_frees_blocks(llm):
    prompts = [llm.tokenizer.encode(p) for p in ("One, two, three,", "The ocean is", "Rust and Go are")]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer)
        engine.start()

        async def collect(ids):
            tokens, text = [], ""
            async for out in engine.generate(ids, params):
                tokens += out.new_token_ids
                text += out.text_delta
            return tokens, text, out

        async def leave_early(ids):
            async for out in engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)):
                if len(out.token_ids) >= 3:
                    return len(out.token_ids)

        results = await asyncio.gather(*(collect(ids) for ids in prompts), leave_early(prompts[0]))
        with pytest.raises(ContextLengthExceeded):
            async for _ in engine.generate([1] * 5000, params):
                pass
        # The abort travels through the inbox; give the engine a moment, then check on its thread.
        for _ in range(100):
            if await engine.call(lambda core: not core.has_unfinished()):
                break
            await asyncio.sleep(0.02)
        await engine.call(lambda core: core.check_invariants())
        used = await engine.call(lambda core: core.kv_manager.num_used_blocks)
        engine.shutdown()
        return results, used

    results, used = asyncio.run(main())
    for (tokens, text, last), want in zip(results[:3], expected):
        assert tokens == want
        assert last.finished and text == llm.tokenizer.decode(want)
    assert results[3] == 3
    assert used == 0


def test_a_call_its_caller_gave_up_on_leaves_the_engine_running(llm):
    """A statistics read that timed out (its future cancelled) must not stop the engine thread."""

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer)
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        prompt = llm.tokenizer.encode("The river runs")

        async def busy():
            return [out async for out in engine.generate(prompt, params)][-1]

        running = asyncio.ensure_future(busy())
        await asyncio.sleep(0)
        for _ in range(20):  # several reads given up at once, while the engine steps
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.call(lambda core: core.stats()), timeout=0)
        last = await running
        stats = await engine.call(lambda core: core.stats())
        engine.shutdown()
        return last, stats, engine.failed

    last, stats, failed = asyncio.run(main())
    assert last.finished and len(last.token_ids) == 40
    assert failed is None and stats.num_running == 0


def test_published_statistics_are_current_after_each_step_and_readable_while_the_thread_is_busy(llm):
    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer)
        engine.start()
        before = engine.latest_stats.generation_tokens
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        async for _ in engine.generate(llm.tokenizer.encode("The river runs"), params):
            pass
        release = threading.Event()
        held = asyncio.ensure_future(engine.call(lambda core: release.wait(30)))  # a step that does not end
        await asyncio.sleep(0.1)
        during = engine.latest_stats  # read with no help from the engine thread
        release.set()
        await held
        engine.shutdown()
        return before, during

    before, during = asyncio.run(main())
    assert during.generation_tokens == before + 12
    assert during.num_running == 0 and during.kv_blocks_used == 0


def test_a_consumer_that_stops_reading_has_its_request_paused_until_it_reads_again(llm):
    prompt = llm.tokenizer.encode("Count to a thousand:")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_UNREAD_TOKENS + 64, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].token_ids
    generated_before = llm.engine.stats().generation_tokens

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer)
        engine.start()
        stream = engine.generate(prompt, params)
        tokens = list((await stream.__anext__()).new_token_ids)  # then it reads nothing for a while
        for _ in range(30000):  # a liveness bound, not a timing
            paused = await engine.call(lambda core: core.stats())
            if paused.num_paused:
                break
            await asyncio.sleep(0.01)
        again = await engine.call(lambda core: core.stats())  # a later look, between other steps
        async for out in stream:
            tokens += out.new_token_ids
        after = await engine.call(lambda core: core.stats())
        engine.shutdown()
        return paused, again, tokens, out, after

    paused, again, tokens, last, after = asyncio.run(main())
    assert paused.num_paused == 1 and paused.kv_blocks_used > 0  # paused, its blocks kept
    assert again.generation_tokens == paused.generation_tokens  # no step of it meanwhile
    assert paused.generation_tokens - generated_before < params.max_tokens
    assert tokens == expected and last.finished  # resumed where it stopped: the same reply
    assert after.num_paused == 0 and after.kv_blocks_used == 0
