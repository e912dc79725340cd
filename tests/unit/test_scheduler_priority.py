"""Foreground and background requests in the scheduler (block_size 4): order, preemption, the
starvation bound."""

import itertools

import pytest

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler, SchedulerConfig
from ember.types import SamplingParams

BLOCK_SIZE = 4
BACKGROUND = 1

_arrivals = itertools.count()


@pytest.fixture
def make_scheduler():
    made = []

    def make(*, num_blocks=32, max_num_seqs=8, max_num_batched_tokens=64, background_wait_steps=256):
        kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, 128,
                                              background_wait_steps=background_wait_steps), kv)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.kv_cache.check_invariants()
        if not scheduler.has_unfinished():
            assert scheduler.kv_cache.num_used_blocks == 0, "an idle engine must hold no blocks"


def make_request(request_id, prompt, *, max_tokens=4, priority=0):
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, priority=priority),
                   max_tokens=max_tokens, eos_token_ids=(), arrival_time=next(_arrivals), priority=priority)


def step(scheduler):
    output = scheduler.schedule()
    sampled = {s.request.request_id: [7] for s in output.scheduled if s.samples}
    finished = scheduler.update_from_output(output, sampled)
    scheduler.kv_cache.check_invariants()
    return output, finished


def chunks(output):
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in output.scheduled]


def run_to_end(scheduler, limit=500):
    order = []
    for _ in range(limit):
        if not scheduler.has_unfinished():
            return order
        _, finished = step(scheduler)
        order += [r.request_id for r in finished]
    raise AssertionError("the scheduler stopped making progress")


def test_a_waiting_foreground_request_is_admitted_before_earlier_background_ones(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=2)
    for name in ("bg1", "bg2"):
        scheduler.add_request(make_request(name, range(3), priority=BACKGROUND))
    scheduler.add_request(make_request("fg", range(100, 103)))
    output, _ = step(scheduler)
    assert [c[0] for c in chunks(output)] == ["fg", "bg1"]


def test_a_foreground_prompt_prefills_before_a_running_background_prompt(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("bg", range(20), priority=BACKGROUND))
    output, _ = step(scheduler)
    assert chunks(output) == [("bg", 0, 8)]
    scheduler.add_request(make_request("fg", range(100, 106)))
    output, _ = step(scheduler)
    assert chunks(output) == [("fg", 0, 6), ("bg", 8, 2)]  # the background prefill gets what is left


def test_a_background_request_yields_its_seat_and_resumes_with_its_tokens(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    bg = make_request("bg", range(6), max_tokens=6, priority=BACKGROUND)
    scheduler.add_request(bg)
    step(scheduler)
    step(scheduler)
    assert bg.output_token_ids == [7, 7]
    scheduler.add_request(fg := make_request("fg", range(100, 103), max_tokens=2))
    output, _ = step(scheduler)
    assert output.preempted == [bg] and chunks(output) == [("fg", 0, 3)]
    assert bg.status is RequestStatus.PREEMPTED and bg.block_ids == [] and bg.num_tokens == 8
    assert run_to_end(scheduler) == ["fg", "bg"]
    assert bg.output_token_ids == [7] * 6 and fg.num_output_tokens == 2 and bg.num_preemptions == 1


def test_a_background_request_yields_blocks_when_that_makes_room(make_scheduler):
    scheduler = make_scheduler(num_blocks=6)  # 5 blocks
    scheduler.add_request(bg := make_request("bg", range(16), max_tokens=4, priority=BACKGROUND))
    step(scheduler)
    step(scheduler)  # 18 tokens, 17 computed: 5 blocks, none left
    assert len(bg.block_ids) == 5 and scheduler.kv_cache.num_free_blocks == 0
    scheduler.add_request(make_request("fg", range(100, 107), max_tokens=2))  # 2 blocks
    output, _ = step(scheduler)
    assert output.preempted == [bg] and [c[0] for c in chunks(output)] == ["fg"]
    assert run_to_end(scheduler) == ["fg", "bg"]


def test_no_preemption_when_yielding_cannot_make_the_room(make_scheduler):
    scheduler = make_scheduler(num_blocks=6)
    scheduler.add_request(fg_big := make_request("fg_big", range(12), max_tokens=6))  # 3 blocks, then 4
    scheduler.add_request(bg := make_request("bg", range(50, 53), max_tokens=6, priority=BACKGROUND))
    step(scheduler)
    scheduler.add_request(make_request("fg_long", range(100, 115), max_tokens=1))  # 4 blocks: never with fg_big
    output, _ = step(scheduler)
    assert output.preempted == [] and bg.status is RequestStatus.RUNNING
    assert run_to_end(scheduler)[0] in ("fg_big", "bg") and fg_big.status.is_finished


def test_foreground_requests_never_preempt_each_other_to_be_admitted(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(first := make_request("first", range(3), max_tokens=3))
    step(scheduler)
    scheduler.add_request(make_request("second", range(100, 103)))
    output, _ = step(scheduler)
    assert output.preempted == [] and chunks(output) == [("first", 3, 1)]
    assert run_to_end(scheduler) == ["first", "second"] and first.num_preemptions == 0


def test_a_background_request_under_endless_foreground_load_waits_at_most_its_bound(make_scheduler):
    bound = 6
    scheduler = make_scheduler(max_num_seqs=1, background_wait_steps=bound)
    bg = make_request("bg", range(3), max_tokens=3, priority=BACKGROUND)
    scheduler.add_request(bg)
    count = itertools.count()
    waited_while_promoted = None
    for _ in range(60):  # a new foreground request every step: the queue never empties
        scheduler.add_request(make_request(f"fg{next(count)}", range(100, 103), max_tokens=3))
        if bg.promoted and waited_while_promoted is None:
            waited_while_promoted = bg.num_preemptions
        step(scheduler)
        if bg.status.is_finished:
            break
    assert bg.status is RequestStatus.FINISHED_LENGTH and bg.promoted
    # At most `bound` steps waiting, plus the steps of the one foreground request it then waits for
    # (3 tokens: three steps) to give up the seat; never preempted once promoted.
    assert bg.num_waiting_steps <= bound + 3
    assert bg.num_preemptions == waited_while_promoted
    for request in list(scheduler.requests.values()):
        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)


def test_preemptions_while_waiting_count_towards_the_bound(make_scheduler):
    bound = 10
    scheduler = make_scheduler(max_num_seqs=1, background_wait_steps=bound)
    scheduler.add_request(bg := make_request("bg", range(3), max_tokens=20, priority=BACKGROUND))
    count = itertools.count()
    for _ in range(200):  # a foreground request every third step: bg runs, yields, runs again
        if scheduler.num_steps % 3 == 0:
            scheduler.add_request(make_request(f"fg{next(count)}", range(100, 103), max_tokens=2))
        step(scheduler)
        if bg.status.is_finished:
            break
    assert bg.status.is_finished and bg.num_preemptions >= 2
    assert bg.num_waiting_steps <= bound + 2
    for request in list(scheduler.requests.values()):
        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
