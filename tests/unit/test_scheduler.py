"""Scheduler at toy sizes (block_size 4): token budgets, admission, preemption, stops, aborts."""

import itertools
import random

import pytest

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler, SchedulerConfig
from ember.engine.step_budget import chunk_cost, tokens_within
from ember.types import FinishReason, SamplingParams

BLOCK_SIZE = 4


@pytest.fixture
def make_scheduler():
    made = []

    def make(*, num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
             enable_prefix_caching=True, attention_cost_tokens=None):
        kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                                              attention_cost_tokens), kv)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.kv_cache.check_invariants()
        assert all(r.status is RequestStatus.RUNNING and r.block_ids for r in scheduler.running)
        if not scheduler.has_unfinished():
            assert scheduler.kv_cache.num_used_blocks == 0, "an idle engine must hold no blocks"


_arrivals = itertools.count()


def make_request(request_id, prompt, *, max_tokens=8, eos=(), priority=0, arrival=None, **params):
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   max_tokens=max_tokens, eos_token_ids=eos,
                   arrival_time=next(_arrivals) if arrival is None else arrival, priority=priority)


def step(scheduler, token=7, sampled=None):
    """One engine step; every sampling request gets `token` unless `sampled` says otherwise."""
    output = scheduler.schedule()
    assert all(s.num_new_tokens > 0 for s in output.scheduled), "scheduled zero tokens"
    assert output.num_scheduled_tokens == sum(s.num_new_tokens for s in output.scheduled)
    assert output.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    decoding = any(s.num_new_tokens == 1 and s.request.num_prompt_tokens <= s.start for s in output.scheduled)
    k = scheduler.config.attention_cost_tokens if decoding else None
    costs = [chunk_cost(s.start, s.num_new_tokens, k) for s in output.scheduled]
    assert sum(costs[:-1]) < scheduler.config.max_num_batched_tokens  # each was paid from budget left
    if sampled is None:
        sampled = {s.request.request_id: [token] for s in output.scheduled if s.samples}
    finished = scheduler.update_from_output(output, sampled)
    scheduler.kv_cache.check_invariants()
    return output, finished


def chunks(output):
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in output.scheduled]


def ids(requests):
    return [r.request_id for r in requests]


def test_chunked_prefill_under_a_budget_pays_decodes_first(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", range(6)))
    output, _ = step(scheduler)
    assert chunks(output) == [("a", 0, 6)]
    assert [s.samples for s in output.scheduled] == [True]

    b = make_request("b", range(100, 112))
    scheduler.add_request(b)
    output, _ = step(scheduler)
    assert chunks(output) == [("a", 6, 1), ("b", 0, 7)]
    assert output.num_scheduled_tokens == 8
    assert b.num_computed_tokens == 7 and b.num_output_tokens == 0  # mid-prompt: nothing sampled

    output, _ = step(scheduler)
    assert chunks(output) == [("a", 7, 1), ("b", 7, 5)]
    assert b.output_token_ids == [7]
    output, _ = step(scheduler)
    assert chunks(output) == [("a", 8, 1), ("b", 12, 1)]


def test_budget_runs_out_before_later_running_requests(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", range(10)))
    scheduler.add_request(make_request("b", range(100, 103)))
    output, _ = step(scheduler)
    assert chunks(output) == [("a", 0, 4)]  # b waits: the budget is spent
    output, _ = step(scheduler)
    assert chunks(output) == [("a", 4, 4)]
    output, _ = step(scheduler)
    assert chunks(output) == [("a", 8, 2), ("b", 0, 2)]


def test_prefix_hits_are_free_and_recorded_as_cached_tokens(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=4)
    a = make_request("a", range(10), max_tokens=1)
    scheduler.add_request(a)
    assert [chunks(step(scheduler)[0]) for _ in range(3)] == [[("a", 0, 4)], [("a", 4, 4)], [("a", 8, 2)]]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_cached_tokens == 0

    b = make_request("b", [*range(10), 50, 51])
    scheduler.add_request(b)
    output, _ = step(scheduler)
    assert chunks(output) == [("b", 8, 4)]  # 8 hit tokens cost no budget
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == [1, 2]
    assert (scheduler.kv_cache.prefix_cache_queries, scheduler.kv_cache.prefix_cache_hits) == (22, 8)


def test_max_num_seqs_caps_running_requests(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, range(3), max_tokens=2))
    output, _ = step(scheduler)
    assert ids(s.request for s in output.scheduled) == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    output, finished = step(scheduler)
    assert ids(finished) == ["a", "b"]
    output, _ = step(scheduler)
    assert chunks(output) == [("c", 0, 3)]
    assert scheduler.get_request("c").num_cached_tokens == 0  # 3 tokens: no full block to hit


def test_waiting_queue_orders_by_priority_then_arrival(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("late_low", range(3), priority=1, arrival=0.0))
    scheduler.add_request(make_request("high_second", range(100, 103), arrival=2.0))
    scheduler.add_request(make_request("high_first", range(200, 203), arrival=1.0))
    output, _ = step(scheduler)
    assert ids(s.request for s in output.scheduled) == ["high_first", "high_second", "late_low"]


def test_preemption_takes_the_latest_arrival_and_it_recomputes_from_its_own_cached_blocks(make_scheduler):
    scheduler = make_scheduler(num_blocks=5)  # blocks 1..4
    a = make_request("a", range(7), max_tokens=4)
    b = make_request("b", range(100, 107), max_tokens=4)
    c = make_request("c", range(200, 202), max_tokens=2)
    for request in (a, b, c):
        scheduler.add_request(request)

    output, _ = step(scheduler)
    assert chunks(output) == [("a", 0, 7), ("b", 0, 7)]  # c: no block left
    assert (a.block_ids, b.block_ids) == ([1, 2], [3, 4])
    step(scheduler)  # both reach 8 computed tokens: two full cached blocks each

    output, _ = step(scheduler)  # a's 9th token needs a third block
    assert chunks(output) == [("a", 8, 1)]
    assert output.preempted == [b]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.num_tokens == 9
    assert a.block_ids == [1, 2, 4]  # b's chain tail (block 4) evicted first, its head (3) kept
    assert scheduler.waiting.peek() is b  # ahead of c, which arrived later

    output, finished = step(scheduler)  # b would hit block 3 but needs 2 more blocks than are free
    assert chunks(output) == [("a", 9, 1)] and finished == [a]

    output, _ = step(scheduler)
    assert chunks(output) == [("b", 4, 5), ("c", 0, 2)]
    assert b.block_ids == [3, 4, 2]  # its own block 3 hit; then the least recently freed: 4, then a's 2
    assert b.num_cached_tokens == 0  # recorded at its first scheduling only
    assert c.block_ids == [1]
    assert b.output_token_ids == [7, 7, 7] and scheduler.kv_cache.num_free_blocks == 0


def test_preempting_an_already_scheduled_victim_refunds_its_tokens(make_scheduler):
    scheduler = make_scheduler(num_blocks=6)
    a = make_request("a", range(5), priority=1)
    b = make_request("b", range(100, 107), priority=0)
    c = make_request("c", range(200, 202), priority=0)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    scheduler.add_request(c)
    step(scheduler)
    step(scheduler)
    assert (a.block_ids, b.block_ids, c.block_ids) == ([1, 2], [3, 4], [5])
    assert (a.num_tokens, b.num_tokens, c.num_tokens) == (8, 9, 4)

    output, _ = step(scheduler)  # a (first in line) fits; b needs a block; a is the least important
    assert chunks(output) == [("b", 8, 1), ("c", 3, 1)] and output.num_scheduled_tokens == 2
    assert output.preempted == [a]
    assert b.block_ids == [3, 4, 2]  # a's partial block 2 was plain, so it went first
    assert a.num_computed_tokens == 0 and a.num_tokens == 8


def test_a_running_request_preempts_itself_when_it_is_the_least_important(make_scheduler):
    scheduler = make_scheduler(num_blocks=5)
    a = make_request("a", range(5))
    b = make_request("b", range(100, 107))
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    step(scheduler)
    output, _ = step(scheduler)  # a still fits its two blocks; b needs a third and is the latest
    assert chunks(output) == [("a", 6, 1)]
    assert output.preempted == [b]
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    assert scheduler.kv_cache.num_used_blocks == 2


def test_no_admission_in_a_step_that_preempted(make_scheduler):
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=2, enable_prefix_caching=False)
    scheduler.add_request(make_request("a", range(7)))
    scheduler.add_request(make_request("b", range(100, 107)))
    output = None
    while not output or not output.preempted:
        output, _ = step(scheduler)
    assert ids(output.preempted) == ["b"]
    assert chunks(output) == [("a", 10, 1)]
    # b's freed block would hold a 1-token chunk of b again; re-admitting it at once would only thrash
    assert scheduler.kv_cache.free_block_ids == [3]
    output, _ = step(scheduler)
    assert chunks(output) == [("a", 11, 1), ("b", 0, 1)]


def test_eos_stops_with_stop_reason_none(make_scheduler):
    scheduler = make_scheduler()
    a = make_request("a", range(3), eos={9})
    scheduler.add_request(a)
    _, finished = step(scheduler, token=9)
    assert finished == [a]
    assert a.status is RequestStatus.FINISHED_STOPPED and a.finish_reason is FinishReason.STOP
    assert a.stop_reason is None and a.output_token_ids == [9] and a.block_ids == []


def test_ignore_eos_runs_to_max_tokens(make_scheduler):
    scheduler = make_scheduler()
    a = make_request("a", range(3), max_tokens=3, eos={9}, ignore_eos=True)
    scheduler.add_request(a)
    results = [step(scheduler, token=9)[1] for _ in range(3)]
    assert results == [[], [], [a]]
    assert a.finish_reason is FinishReason.LENGTH and a.output_token_ids == [9, 9, 9]


def test_min_tokens_delays_eos_and_stop_tokens(make_scheduler):
    scheduler = make_scheduler()
    a = make_request("a", range(3), eos={9}, min_tokens=2)
    b = make_request("b", range(100, 103), stop_token_ids=[5], min_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    _, finished = step(scheduler, sampled={"a": [9], "b": [5]})
    assert finished == []
    _, finished = step(scheduler, sampled={"a": [9], "b": [5]})
    assert finished == [a, b]
    assert a.output_token_ids == [9, 9] and b.output_token_ids == [5, 5]
    assert b.stop_reason == 5


def test_stop_token_ids_take_precedence_over_eos(make_scheduler):
    scheduler = make_scheduler()
    a = make_request("a", range(3), eos={5}, stop_token_ids=[5])
    scheduler.add_request(a)
    _, finished = step(scheduler, token=5)
    assert finished == [a] and a.finish_reason is FinishReason.STOP and a.stop_reason == 5


def test_max_tokens_and_max_model_len_finish_with_length(make_scheduler):
    scheduler = make_scheduler(max_model_len=6)
    by_max_tokens = make_request("a", range(3), max_tokens=2)
    by_context = make_request("b", range(100, 104), max_tokens=8)  # the engine normally prevents this
    scheduler.add_request(by_max_tokens)
    scheduler.add_request(by_context)
    assert step(scheduler)[1] == []
    assert step(scheduler)[1] == [by_max_tokens, by_context]
    assert by_max_tokens.num_output_tokens == 2 and by_context.num_tokens == 6
    assert {r.finish_reason for r in (by_max_tokens, by_context)} == {FinishReason.LENGTH}


def test_tokens_after_a_stop_in_one_step_are_dropped(make_scheduler):
    scheduler = make_scheduler()
    a = make_request("a", range(3), eos={9})
    scheduler.add_request(a)
    _, finished = step(scheduler, sampled={"a": [3, 9, 4]})
    assert finished == [a] and a.output_token_ids == [3, 9]


def test_abort_frees_every_block_and_ignores_unknown_ids(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    running = make_request("running", range(10))
    waiting = make_request("waiting", range(100, 103))
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler)
    assert scheduler.kv_cache.num_used_blocks == 3

    aborted = scheduler.finish_requests(["running", "waiting", "nobody"], RequestStatus.FINISHED_ABORTED)
    assert aborted == [running, waiting]
    assert all(r.finish_reason is FinishReason.ABORT and r.block_ids == [] for r in aborted)
    assert scheduler.kv_cache.num_used_blocks == 0
    assert not scheduler.has_unfinished() and scheduler.num_running == scheduler.num_waiting == 0
    assert scheduler.finish_requests(["running"], RequestStatus.FINISHED_ABORTED) == []
    assert scheduler.get_request("running") is None
    assert step(scheduler)[0].scheduled == []


def test_request_aborted_between_schedule_and_update_is_skipped(make_scheduler):
    scheduler = make_scheduler()
    a = make_request("a", range(3))
    scheduler.add_request(a)
    output = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(output, {"a": [7]}) == []
    assert a.num_computed_tokens == 0 and a.output_token_ids == []


def test_aborted_waiting_and_preempted_requests_are_never_admitted(make_scheduler):
    scheduler = make_scheduler(num_blocks=5)
    scheduler.add_request(make_request("a", range(5)))
    scheduler.add_request(make_request("b", range(100, 107)))
    step(scheduler)
    step(scheduler)
    assert ids(step(scheduler)[0].preempted) == ["b"]
    scheduler.add_request(make_request("c", range(200, 203)))
    scheduler.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_waiting == 0
    output, _ = step(scheduler)
    assert ids(s.request for s in output.scheduled) == ["a"]


def test_a_stop_string_found_by_the_front_end_finishes_with_stop(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(3)))
    step(scheduler)
    [a] = scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert a.finish_reason is FinishReason.STOP and scheduler.kv_cache.num_used_blocks == 0


def test_duplicate_request_id_is_refused(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(3)))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", range(3)))
    assert scheduler.num_waiting == 1


def test_a_crowded_pool_drains_to_idle_with_every_block_returned(make_scheduler):
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=12, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=40)
    shared_prefix = list(range(8))
    requests = []
    for i in range(30):
        prompt = shared_prefix[:rng.choice((0, 4, 8))] + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 12))]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 10), eos={0},
                                     priority=rng.choice((0, 0, 1))))
    for request in requests:
        scheduler.add_request(request)
    num_steps = 0
    while scheduler.has_unfinished():
        step(scheduler, sampled=None, token=rng.randrange(0, 20))
        num_steps += 1
        assert num_steps < 500, "the scheduler stopped making progress"
    assert all(r.status.is_finished and 1 <= r.num_output_tokens <= r.max_tokens for r in requests)
    assert any(r.num_preemptions for r in requests) and scheduler.kv_cache.prefix_cache_hits > 0
    assert scheduler.kv_cache.num_used_blocks == 0


def test_a_chunk_costs_its_tokens_plus_their_keys_over_the_attention_cost():
    assert chunk_cost(0, 10, None) == 10 and chunk_cost(500, 10, None) == 10
    assert chunk_cost(0, 4, 8) == 4 + (1 + 2 + 3 + 4) / 8
    assert chunk_cost(100, 1, 10) == 1 + 101 / 10
    for start, budget in ((0, 64), (1000, 64), (20000, 2048), (7, 3.5)):
        count = tokens_within(start, 10**6, budget, 512)
        assert chunk_cost(start, count, 512) <= budget or count == 1
        assert chunk_cost(start, count + 1, 512) > budget
    assert tokens_within(30000, 1, 2.0, 512) == 1  # a decode far into its context still runs
    assert tokens_within(0, 5, 0, 512) == 0


def test_a_long_context_chunk_is_cut_to_its_cost_and_decodes_go_first(make_scheduler):
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_model_len=256,
                               attention_cost_tokens=16)
    talker = make_request("talker", [1, 2, 3], max_tokens=40)
    scheduler.add_request(talker)
    step(scheduler)  # its prompt; it decodes from now on
    long = make_request("long", range(1, 200), max_tokens=2)
    scheduler.add_request(long)
    sizes = []
    for _ in range(6):
        output, _ = step(scheduler)
        assert chunks(output)[0][:1] == ("talker",) and chunks(output)[0][2] == 1  # its next token first
        (_, start, count), = [c for c in chunks(output) if c[0] == "long"]
        spent = chunk_cost(output.scheduled[0].start, 1, 16)
        assert count == tokens_within(start, 199 - start, 32 - spent, 16)
        sizes.append(count)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]  # later chunks see more keys: fewer tokens
    scheduler.finish_requests(["talker"], RequestStatus.FINISHED_ABORTED)
    output, _ = step(scheduler)  # no stream left to protect: the prompt goes on in full-budget chunks
    assert [c[0] for c in chunks(output)] == ["long"] and chunks(output)[0][2] == 32
    scheduler.finish_requests(["long"], RequestStatus.FINISHED_ABORTED)


def test_a_paused_request_keeps_its_blocks_and_takes_no_step_until_resumed(make_scheduler):
    scheduler = make_scheduler()
    reader = make_request("reader", range(5), max_tokens=8)
    stalled = make_request("stalled", range(100, 105), max_tokens=8)
    scheduler.add_request(reader)
    scheduler.add_request(stalled)
    step(scheduler)
    held = list(stalled.block_ids)

    scheduler.pause(["stalled", "nobody"])  # an unknown id is ignored
    assert scheduler.paused == {"stalled"} and scheduler.num_paused == 1 and scheduler.has_schedulable()
    for _ in range(3):
        output, _ = step(scheduler)
        assert chunks(output) == [("reader", reader.num_computed_tokens - 1, 1)]
    assert stalled.num_output_tokens == 1 and stalled.block_ids == held and stalled.status is RequestStatus.RUNNING
    assert reader.num_output_tokens == 4

    scheduler.resume(["stalled"])
    output, _ = step(scheduler)
    assert sorted(chunks(output)) == [("reader", 8, 1), ("stalled", 5, 1)]
    assert stalled.num_output_tokens == 2 and not scheduler.paused


def test_only_paused_requests_left_means_nothing_to_schedule(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5)))
    step(scheduler)
    scheduler.pause(["a"])
    assert scheduler.has_unfinished() and not scheduler.has_schedulable()
    assert step(scheduler)[0].scheduled == []


def test_a_paused_request_that_is_aborted_frees_its_blocks_and_leaves_the_paused_set(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(9)))
    step(scheduler)
    scheduler.pause(["a"])
    assert scheduler.kv_cache.num_used_blocks == 3
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache.num_used_blocks == 0 and not scheduler.paused and not scheduler.has_schedulable()
    scheduler.pause(["a"])  # finished: ignored
    assert not scheduler.paused


def test_a_paused_request_is_preempted_like_any_other_when_memory_runs_short(make_scheduler):
    scheduler = make_scheduler(num_blocks=5)  # blocks 1..4
    first = make_request("first", range(7), max_tokens=4)
    paused = make_request("paused", range(100, 107), max_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(paused)
    step(scheduler)
    scheduler.pause(["paused"])
    step(scheduler)  # first reaches 8 tokens; paused stays at 7
    output, _ = step(scheduler)  # first's 9th token needs a third block: the later arrival gives way
    assert output.preempted == [paused] and paused.block_ids == [] and paused.status is RequestStatus.PREEMPTED
    assert scheduler.paused == {"paused"}  # still paused while it waits
