"""KVCacheManager at toy sizes (block_size 4, 8 blocks: ids 1..7 allocatable), exact block ids."""

import pytest

from ember.engine.kv_cache import KVCacheManager, hash_block
from ember.engine.request import Request
from ember.types import SamplingParams

BLOCK_SIZE = 4


@pytest.fixture
def make_kv():
    made = []

    def make(num_blocks=8, enable_prefix_caching=True):
        kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.check_invariants()


def make_request(request_id, token_ids, cache_salt=None):
    return Request(request_id, list(token_ids), SamplingParams(), max_tokens=16, eos_token_ids=(),
                   arrival_time=0.0, cache_salt=cache_salt)


def admit_and_compute(kv, request):
    """What the scheduler and one unbounded step do: attach hits, allocate the rest, compute, cache."""
    hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_block_ids, num_hit_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return hit_block_ids


def ref_counts(kv):
    return [block.ref_count for block in kv.blocks]


def test_allocation_takes_blocks_in_order_and_never_the_null_block(make_kv):
    kv = make_kv()
    a, b, c = make_request("a", range(10)), make_request("b", range(4)), make_request("c", range(12))
    assert kv.allocate_slots(a, 10)
    assert kv.allocate_slots(b, 4)
    assert a.block_ids == [1, 2, 3] and b.block_ids == [4]
    assert not kv.allocate_slots(c, 13)  # 4 blocks, 3 free
    assert kv.allocate_slots(c, 12)
    assert c.block_ids == [5, 6, 7]
    assert kv.num_free_blocks == 0 and kv.num_used_blocks == 7 and kv.usage == 1.0
    assert kv.blocks[0].ref_count == 0


def test_allocate_adds_a_block_only_when_the_last_one_fills(make_kv):
    kv = make_kv()
    a = make_request("a", range(7))
    assert kv.allocate_slots(a, 7)
    a.num_computed_tokens = 7
    a.append_output_token(50)  # 8 tokens: still two blocks
    assert kv.allocate_slots(a, 1) and a.block_ids == [1, 2]
    a.num_computed_tokens = 8
    a.append_output_token(51)  # 9 tokens: a third block
    assert kv.allocate_slots(a, 1) and a.block_ids == [1, 2, 3]


def test_only_full_computed_blocks_are_hashed(make_kv):
    kv = make_kv()
    a = make_request("a", range(10))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    assert len(a.block_hashes) == 1 and kv.blocks[1].hash == a.block_hashes[0]
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    assert len(a.block_hashes) == 2  # block 3 holds tokens 8-9 only
    assert kv.cached_block_ids == {a.block_hashes[0]: 1, a.block_hashes[1]: 2}
    assert kv.blocks[3].hash is None


def test_prefix_hit_shares_blocks_and_counts_refs(make_kv):
    kv = make_kv()
    a = make_request("a", range(10))
    admit_and_compute(kv, a)
    b = make_request("b", [*range(8), 100, 101])
    assert kv.get_computed_blocks(b) == ([1, 2], 8)
    assert kv.allocate_slots(b, 2, [1, 2], 8)
    assert b.block_ids == [1, 2, 4]
    assert b.block_hashes == a.block_hashes[:2]
    assert ref_counts(kv)[:5] == [0, 2, 2, 1, 1]
    assert kv.num_used_blocks == 4

    kv.free(a)
    assert ref_counts(kv)[:5] == [0, 1, 1, 0, 1]
    assert kv.num_cached_blocks == 0  # blocks 1 and 2 are still b's
    kv.free(b)
    assert b.block_ids == [] and b.block_hashes == []
    assert kv.num_cached_blocks == 2
    # plain blocks (3 from a, 4 from b) go to the front; cached ones to the tail, chain tail first
    assert kv.free_block_ids == [4, 3, 5, 6, 7, 2, 1]


def test_hits_never_cover_every_token(make_kv):
    kv = make_kv()
    admit_and_compute(kv, make_request("a", range(8)))
    assert kv.get_computed_blocks(make_request("same", range(8))) == ([1], 4)
    assert kv.get_computed_blocks(make_request("one_more", range(9))) == ([1, 2], 8)
    assert kv.get_computed_blocks(make_request("short", range(5))) == ([1], 4)
    assert kv.get_computed_blocks(make_request("one_block", range(4))) == ([], 0)


def test_lookup_stops_at_the_first_miss(make_kv):
    kv = make_kv()
    admit_and_compute(kv, make_request("a", range(12)))
    diverges_in_second_block = [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11, 12]
    assert kv.get_computed_blocks(make_request("b", diverges_in_second_block)) == ([1], 4)


def test_lookup_changes_no_state(make_kv):
    kv = make_kv()
    a = make_request("a", range(8))
    admit_and_compute(kv, a)
    kv.free(a)
    before = (kv.free_block_ids, ref_counts(kv), kv.num_cached_blocks, kv.prefix_cache_queries)
    assert kv.get_computed_blocks(make_request("b", range(9))) == ([1, 2], 8)
    assert (kv.free_block_ids, ref_counts(kv), kv.num_cached_blocks, kv.prefix_cache_queries) == before


def test_lru_evicts_least_recently_freed_and_chain_tails_first(make_kv):
    kv = make_kv()
    a = make_request("a", range(12))
    b = make_request("b", range(100, 108))
    admit_and_compute(kv, a)
    admit_and_compute(kv, b)
    assert a.block_ids == [1, 2, 3] and b.block_ids == [4, 5]
    kv.free(a)
    kv.free(b)
    assert kv.free_block_ids == [6, 7, 3, 2, 1, 5, 4]
    assert kv.num_cached_blocks == 5

    c = make_request("c", range(200, 216))
    assert kv.allocate_slots(c, 16)
    assert c.block_ids == [6, 7, 3, 2]  # evicts a's blocks 3 and 2, keeps its head block 1
    assert kv.num_cached_blocks == 3
    assert kv.get_computed_blocks(make_request("a_again", range(13))) == ([1], 4)
    assert kv.get_computed_blocks(make_request("b_again", range(100, 109))) == ([4, 5], 8)


def test_a_growing_request_takes_the_block_after_its_last_when_that_one_is_plain_and_free(make_kv):
    kv = make_kv(num_blocks=12)
    a, b = make_request("a", range(40)), make_request("b", range(40))
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 4)
    assert a.block_ids == [1, 2] and b.block_ids == [3]
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 8)  # block 3 is b's: a starts a new run from the queue's front
    b.num_computed_tokens = 4
    assert kv.allocate_slots(b, 8)  # block 4 went to a, so b's run restarts too
    a.num_computed_tokens = 16
    assert kv.allocate_slots(a, 8)
    assert a.block_ids == [1, 2, 4, 5, 8, 9] and b.block_ids == [3, 6, 7]
    assert kv.free_block_ids == [10, 11]


def test_the_next_block_is_not_taken_out_of_turn_when_it_holds_a_cached_prefix(make_kv):
    kv = make_kv()
    a = make_request("a", range(8))
    admit_and_compute(kv, a)
    kv.free(a)  # blocks 1 and 2 stay cached; plain blocks 3..7 come first
    e = make_request("e", [0, 1, 2, 3, 90, 91, 92, 93, 94])
    assert admit_and_compute(kv, e) == [1]
    assert e.block_ids == [1, 3, 4]  # block 2 (a's second block) stays cached
    assert kv.get_computed_blocks(make_request("a_again", range(9))) == ([1, 2], 8)


def test_plain_free_blocks_are_reused_before_cached_ones(make_kv):
    kv = make_kv()
    a = make_request("a", range(10))
    admit_and_compute(kv, a)
    kv.free(a)
    assert kv.free_block_ids == [3, 4, 5, 6, 7, 2, 1]  # block 3 was partial, so never hashed
    d = make_request("d", range(100, 102))
    assert kv.allocate_slots(d, 2)
    assert d.block_ids == [3]
    assert kv.num_cached_blocks == 2


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue(make_kv):
    kv = make_kv()
    a = make_request("a", range(8))
    admit_and_compute(kv, a)
    kv.free(a)
    b = make_request("b", range(9))
    assert admit_and_compute(kv, b) == [1, 2]
    assert b.block_ids == [1, 2, 3]
    assert kv.free_block_ids == [4, 5, 6, 7]
    assert kv.num_cached_blocks == 0 and ref_counts(kv)[:4] == [0, 1, 1, 1]


def test_cache_salt_separates_namespaces(make_kv):
    kv = make_kv()
    admit_and_compute(kv, make_request("a", range(8), cache_salt="alice"))
    assert kv.get_computed_blocks(make_request("b", range(9), cache_salt="bob")) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", range(9))) == ([], 0)
    assert kv.get_computed_blocks(make_request("d", range(9), cache_salt="alice")) == ([1, 2], 8)


def test_hash_block_is_a_framed_16_byte_digest():
    tokens = [1, 2, 3, 4]
    root = hash_block(None, tokens, None)
    assert len(root) == 16 and root == hash_block(None, list(tokens), None)
    assert root != hash_block(None, tokens, "")
    assert root != hash_block(None, [1, 2, 3, 5], None)
    assert hash_block(root, tokens, None) != root
    assert hash_block(None, tokens, "ab") != hash_block(None, tokens, "a")


def test_failed_allocation_changes_nothing(make_kv):
    kv = make_kv()
    a = make_request("a", range(8))
    admit_and_compute(kv, a)
    kv.free(a)
    c = make_request("c", range(100, 112))
    assert kv.allocate_slots(c, 12) and c.block_ids == [3, 4, 5]
    assert kv.free_block_ids == [6, 7, 2, 1]

    # 5 blocks: hits 1 and 2 (both free, so they count against the pool) + 3 new > 4 free
    b = make_request("b", [*range(8), *range(300, 312)])
    hit_block_ids, num_hit_tokens = kv.get_computed_blocks(b)
    assert (hit_block_ids, num_hit_tokens) == ([1, 2], 8)
    before = (kv.free_block_ids, ref_counts(kv), kv.num_cached_blocks, dict(kv.cached_block_ids),
              kv.prefix_cache_queries, kv.prefix_cache_hits)
    assert not kv.allocate_slots(b, 12, hit_block_ids, num_hit_tokens)
    assert b.block_ids == [] and b.block_hashes == []
    assert (kv.free_block_ids, ref_counts(kv), kv.num_cached_blocks, dict(kv.cached_block_ids),
            kv.prefix_cache_queries, kv.prefix_cache_hits) == before

    # 4 blocks: 2 hits + 2 new fits exactly
    b2 = make_request("b2", [*range(8), *range(300, 308)])
    assert kv.allocate_slots(b2, 8, [1, 2], 8)
    assert b2.block_ids == [1, 2, 6, 7] and kv.free_block_ids == []


def test_duplicate_block_keeps_the_first_mapping_and_stays_unshared(make_kv):
    kv = make_kv()
    a, b = make_request("a", range(8)), make_request("b", range(8))
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)  # both miss: neither is computed yet
    a.num_computed_tokens = b.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.cache_full_blocks(b)
    assert b.block_hashes == a.block_hashes
    assert sorted(kv.cached_block_ids.values()) == [1, 2]
    assert kv.blocks[3].hash is None and kv.blocks[4].hash is None
    kv.free(b)
    kv.free(a)
    assert kv.free_block_ids == [3, 4, 5, 6, 7, 2, 1]
    assert kv.num_cached_blocks == 2


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use(make_kv):
    kv = make_kv()
    a = make_request("a", range(8))
    admit_and_compute(kv, a)
    assert not kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", range(9))) == ([1, 2], 8)
    kv.free(a)
    assert kv.num_cached_blocks == 2
    assert kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0 and kv.cached_block_ids == {}
    assert kv.num_free_blocks == 7
    assert kv.get_computed_blocks(make_request("c", range(9))) == ([], 0)


def test_disabled_prefix_caching_never_hashes_or_hits(make_kv):
    kv = make_kv(enable_prefix_caching=False)
    a = make_request("a", range(8))
    assert admit_and_compute(kv, a) == []
    assert a.block_hashes == [] and kv.cached_block_ids == {}
    assert kv.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    kv.free(a)
    assert kv.num_cached_blocks == 0
    assert kv.free_block_ids == [1, 2, 3, 4, 5, 6, 7]
    assert kv.prefix_cache_queries == 0


def test_prefix_cache_stats_count_each_admission_once(make_kv):
    kv = make_kv()
    admit_and_compute(kv, make_request("a", range(8)))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (8, 0)
    b = make_request("b", range(9))
    admit_and_compute(kv, b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (17, 8)
    b.append_output_token(1)
    assert kv.allocate_slots(b, 1)  # a later step of a running request is not a lookup
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (17, 8)


def test_check_invariants_names_a_wrong_ref_count(make_kv):
    kv = make_kv()
    a = make_request("a", range(4))
    assert kv.allocate_slots(a, 4)
    kv.blocks[1].ref_count = 2
    with pytest.raises(AssertionError, match="block 1 has ref_count 2 but 1 holders"):
        kv.check_invariants()
    kv.blocks[1].ref_count = 1


def test_check_invariants_catches_a_leaked_block(make_kv):
    kv = make_kv()
    a = make_request("a", range(4))
    assert kv.allocate_slots(a, 4)
    a.block_ids = []  # dropped without kv.free
    with pytest.raises(AssertionError, match="holds no blocks"):
        kv.check_invariants()
    a.block_ids = [1]
    kv.free(a)
    assert kv.num_free_blocks == 7
