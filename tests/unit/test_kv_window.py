"""Blocks behind every layer's sliding window go back to the pool (KVCacheManager.release_blocks_before),
at toy sizes: block_size 4, 8 blocks (ids 1..7 allocatable), exact block ids."""

from test_kv_cache import BLOCK_SIZE, admit_and_compute as compute, make_request

from ember.engine.kv_cache import KVCacheManager


def test_released_blocks_become_null_entries_and_return_to_the_pool():
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = make_request("a", range(100, 118))  # 18 tokens: 5 blocks
    compute(kv, request)
    assert request.block_ids == [1, 2, 3, 4, 5]
    kv.release_blocks_before(request, 9)  # tokens 0..8 are behind the window: blocks 1 and 2 hold only those
    assert request.block_ids == [0, 0, 3, 4, 5]
    assert kv.num_used_blocks == 3 and kv.num_cached_blocks == 2
    kv.check_invariants()
    kv.release_blocks_before(request, 9)  # again: nothing more to give
    assert request.block_ids == [0, 0, 3, 4, 5]
    kv.free(request)
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_a_released_block_is_a_valid_prefix_until_the_pool_hands_it_out():
    kv = KVCacheManager(8, BLOCK_SIZE)
    first = make_request("a", range(100, 118))
    compute(kv, first)
    kv.release_blocks_before(first, 9)
    # the same prompt again: blocks 1 and 2 (released, still hashed) and 3, 4 (held) are its prefix
    again = make_request("b", range(100, 118))
    assert compute(kv, again) == [1, 2, 3, 4]
    kv.check_invariants()
    kv.free(again)
    kv.free(first)
    # a prompt that fills the pool takes the released blocks and drops their hashes
    other = make_request("c", range(500, 528))  # 7 blocks
    compute(kv, other)
    kv.free(other)
    assert kv.get_computed_blocks(make_request("d", range(100, 118))) == ([], 0)
    kv.check_invariants()


def test_release_never_touches_the_blocks_a_window_still_reads():
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = make_request("a", range(100, 110))
    compute(kv, request)
    kv.release_blocks_before(request, 3)  # block 1 holds tokens 0..3; token 3 is still in the window
    assert request.block_ids == [1, 2, 3]
    kv.release_blocks_before(request, -5)
    assert request.block_ids == [1, 2, 3]
    kv.free(request)
    kv.check_invariants()
