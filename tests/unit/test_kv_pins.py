"""Prefix-cache pins (cache breakpoints) at toy sizes: block_size 4, 8 blocks (ids 1..7 allocatable).

The clock is injected, so TTLs expire when a test moves it, never by waiting.
"""

import pytest

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.types import CachePin, SamplingParams

BLOCK_SIZE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def make_kv(clock):
    made = []

    def make(num_blocks=8, max_pinned_share=0.5):
        kv = KVCacheManager(num_blocks, BLOCK_SIZE, True, max_pinned_share, clock=clock)
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.check_invariants()


def make_request(request_id, token_ids, pins=()):
    params = SamplingParams(cache_pins=[CachePin(num_tokens, ttl) for num_tokens, ttl in pins])
    return Request(request_id, list(token_ids), params, max_tokens=16, eos_token_ids=(), arrival_time=0.0)


def run(kv, request):
    """Admit with the hits there are, compute every token, cache the full blocks."""
    hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_block_ids, num_hit_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return num_hit_tokens


def fill_pool(kv, request_id, num_blocks):
    """Another request takes `num_blocks` blocks of its own, evicting what the LRU queue gives up."""
    other = make_request(request_id, range(500, 500 + num_blocks * BLOCK_SIZE))
    run(kv, other)
    return other


def test_pinned_blocks_survive_other_requests_pressure_and_are_read_later(make_kv):
    kv = make_kv()
    first = make_request("first", range(9), pins=[(8, 300.0)])  # two full blocks pinned, the third plain
    run(kv, first)
    assert first.num_pinned_tokens == 8 and kv.num_pinned_blocks == 2
    kv.free(first)
    assert kv.num_free_blocks == 5 and kv.num_cached_blocks == 2 and kv.num_used_blocks == 0

    flood = fill_pool(kv, "flood", 5)  # every free block: the pinned two are not among them
    assert not kv.allocate_slots(make_request("more", range(700, 704)), 4)  # no block left to take
    kv.free(flood)
    later = make_request("later", [*range(8), 42, 43])
    assert run(kv, later) == 8  # the pinned prefix is read back


def test_without_a_pin_the_same_pressure_evicts_the_prefix(make_kv):
    kv = make_kv()
    run(kv, first := make_request("first", range(9)))
    kv.free(first)
    kv.free(fill_pool(kv, "flood", 7))
    assert run(kv, make_request("later", [*range(8), 42, 43])) == 0


def test_a_pin_expires_after_its_ttl_and_a_read_renews_it(make_kv, clock):
    kv = make_kv()
    run(kv, first := make_request("first", range(9), pins=[(8, 60.0)]))
    kv.free(first)
    clock.now += 50
    reader = make_request("reader", [*range(8), 7, 7])  # no pin of its own: a read renews for 60 s
    assert run(kv, reader) == 8
    kv.free(reader)
    clock.now += 50  # 100 s after the write, 50 after the read
    kv.get_computed_blocks(reader)
    assert kv.num_pinned_blocks == 2
    clock.now += 11
    kv.get_computed_blocks(reader)  # expiry is checked on each lookup
    assert kv.num_pinned_blocks == 0 and kv.num_cached_blocks == 2  # still cached, evictable again
    kv.free(fill_pool(kv, "flood", 7))
    assert run(kv, make_request("late", [*range(8), 42, 43])) == 0


def test_the_longest_covering_ttl_wins_per_block(make_kv, clock):
    kv = make_kv()
    run(kv, request := make_request("two", range(9), pins=[(4, 3600.0), (8, 300.0)]))
    kv.free(request)
    clock.now += 301
    kv.get_computed_blocks(request)
    assert kv.num_pinned_blocks == 1  # the first block, under the hour-long pin
    clock.now += 3300
    kv.get_computed_blocks(request)
    assert kv.num_pinned_blocks == 0


def test_the_pinned_share_of_the_pool_is_bounded(make_kv):
    kv = make_kv(num_blocks=8, max_pinned_share=0.3)  # int(0.3 * 7) = 2 blocks
    assert kv.pins.max_blocks == 2
    big = make_request("big", range(13), pins=[(12, 300.0)])  # three full blocks asked for
    run(kv, big)
    assert kv.num_pinned_blocks == 2 and kv.pins.num_refused == 1
    assert big.num_pinned_tokens == 8  # what the share allowed, reported as it is
    other = make_request("other", range(100, 109), pins=[(8, 300.0)])
    run(kv, other)
    assert other.num_pinned_tokens == 0 and kv.num_pinned_blocks == 2 and kv.pins.num_refused == 3
    kv.free(big)
    kv.free(other)
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == 5


def test_pins_give_way_to_a_request_that_holds_the_pool_alone(make_kv):
    kv = make_kv(num_blocks=8, max_pinned_share=0.5)
    run(kv, first := make_request("first", range(13), pins=[(12, 3600.0)]))
    kv.free(first)
    assert kv.num_pinned_blocks == 3
    lone = make_request("lone", range(300, 328))  # seven blocks: the whole pool
    assert kv.allocate_slots(lone, 28)
    assert kv.num_pinned_blocks == 0 and kv.num_free_blocks == 0
    kv.free(lone)


def test_nothing_leaks_and_a_reset_releases_the_pins(make_kv):
    kv = make_kv()
    requests = [make_request(f"r{i}", [*range(8), i], pins=[(8, 300.0)]) for i in range(3)]
    for request in requests:
        run(kv, request)
    assert kv.num_pinned_blocks == 2 and [r.num_pinned_tokens for r in requests] == [8, 8, 8]
    for request in requests:
        kv.free(request)
    assert kv.num_used_blocks == 0 and kv.num_pinned_blocks == 2
    assert kv.reset_prefix_cache()
    assert kv.num_pinned_blocks == 0 and kv.num_cached_blocks == 0 and kv.num_free_blocks == 7
