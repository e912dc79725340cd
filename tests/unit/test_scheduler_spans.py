"""Bidirectional spans in the scheduler (Gemma 3's image tokens, Request.bidirectional_spans): no
chunk ends inside one, a chunk that starts at or inside one covers it whole even past the step
budget, and its KV blocks cover all of it."""

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler, SchedulerConfig
from ember.types import SamplingParams

BLOCK_SIZE = 4


def spanned_request(request_id: str, num_prompt_tokens: int, spans: list[tuple[int, int]],
                    first_token: int = 0) -> Request:
    request = Request(request_id, list(range(first_token, first_token + num_prompt_tokens)),
                      SamplingParams(max_tokens=2), max_tokens=2, eos_token_ids=(), arrival_time=0.0)
    request.bidirectional_spans = spans
    return request


def test_computable_never_ends_a_chunk_inside_a_span():
    request = spanned_request("r", 60, [(10, 26), (30, 46)])
    assert request.computable(0, 8) == 8  # before the first span
    assert request.computable(0, 15) == 10  # it would cut the span: it ends before it
    assert request.computable(10, 3) == 16  # it starts at the span: the whole span, past the 3
    assert request.computable(14, 1) == 12  # it starts inside (a prefix-cache hit ended there): the rest
    assert request.computable(0, 28) == 28  # between the spans
    assert request.computable(26, 20) == 20  # to a span's end exactly


def test_an_unready_span_stops_a_chunk_before_any_bidirectional_widening():
    request = spanned_request("r", 60, [(10, 26), (30, 46)])
    request.unready_spans = [(30, 46)]
    assert request.computable(26, 10) == 4
    assert request.computable(30, 10) == 0
    request.unready_spans = [(10, 26)]
    assert request.computable(14, 5) == 0  # inside a span whose image is not encoded yet


def run_to_end(scheduler: Scheduler) -> list[list[tuple[str, int, int]]]:
    """Every step's chunks (request, start, tokens) until every request is done."""
    steps = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        for entry in output.scheduled:
            assert len(entry.request.block_ids) * BLOCK_SIZE >= entry.start + entry.num_new_tokens
        steps.append([(s.request.request_id, s.start, s.num_new_tokens) for s in output.scheduled])
        scheduler.update_from_output(output, {s.request.request_id: [7] for s in output.scheduled if s.samples})
        scheduler.kv_cache.check_invariants()
    return steps


def test_a_span_longer_than_the_step_budget_is_computed_in_one_chunk():
    kv = KVCacheManager(32, BLOCK_SIZE, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64), kv)
    scheduler.add_request(spanned_request("r", 30, [(5, 21)]))
    steps = run_to_end(scheduler)
    assert [chunk for step in steps for chunk in step][:4] == [("r", 0, 5), ("r", 5, 16), ("r", 21, 6), ("r", 27, 3)]
    assert kv.num_used_blocks == 0


def test_a_prefix_hit_inside_a_span_makes_the_first_chunk_cover_the_rest_of_it():
    kv = KVCacheManager(32, BLOCK_SIZE, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    scheduler.add_request(spanned_request("first", 30, [(5, 21)]))
    run_to_end(scheduler)
    # the same first 14 tokens, then others: its hit (3 full blocks) ends at 12, inside the span
    second = spanned_request("second", 30, [(5, 21)])
    second.token_ids[14:] = range(100, 116)
    scheduler.add_request(second)
    scheduler.config.max_num_batched_tokens = 4
    assert run_to_end(scheduler)[0] == [("second", 12, 9)]
