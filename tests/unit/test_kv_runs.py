"""The KV manager's keep_runs: a request's next block is the one after its last wherever that one is
free, a cached block's data moving to the block the queue would have evicted. The same hashes are
evicted in the same order as without it, and every cached hash keeps naming its own data, through
the host tier's evictions and loads."""

import random

import torch

from ember.engine.attention import KVCache
from ember.engine.cache_tiers import CacheTiers
from ember.engine.cache_tiers.host import HostStore
from ember.engine.free_queue import FreeQueue
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.types import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id, token_ids):
    return Request(request_id, list(token_ids), SamplingParams(), max_tokens=1 << 20, eos_token_ids=(),
                   arrival_time=0.0)


def admit(kv, request):
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits, num_hit_tokens)
    return hits, num_hit_tokens


def test_the_free_queue_gives_a_block_the_place_of_another():
    queue = FreeQueue(range(1, 6))
    queue.move_to_front(4)
    assert list(queue) == [4, 1, 2, 3, 5] and queue.front() == 4
    assert queue.pop_front() == 4
    queue.replace(3, 4)
    assert list(queue) == [1, 2, 4, 5] and 3 not in queue and 4 in queue and len(queue) == 4
    queue.remove(2)
    queue.append(3)
    assert list(queue) == [1, 4, 5, 3]


def test_copy_blocks_reads_every_source_before_writing_any():
    cache = KVCache(2, 8, BLOCK_SIZE, 1, 16, torch.bfloat16, torch.device("cpu"), kernel_layout=True)
    for block_id in range(8):
        cache.write_block(block_id, torch.full(cache.block(0).shape, block_id, dtype=torch.bfloat16))
    before = [cache.read_block(block_id) for block_id in range(8)]
    cache.copy_blocks({5: 4, 6: 1})  # apart: block by block
    cache.copy_blocks({2: 1, 3: 2})  # block 2 is written and read: 3 takes its data from before
    assert [int(cache.read_block(block_id).flatten()[0]) for block_id in range(8)] == [0, 1, 1, 2, 4, 4, 1, 7]
    assert torch.equal(cache.read_block(3), before[2]) and torch.equal(cache.read_block(6), before[1])


def test_cached_next_blocks_are_taken_and_their_prefix_moves_to_the_queue_s_front_block():
    kv = KVCacheManager(8, BLOCK_SIZE, keep_runs=True)
    first = make_request("first", range(8))
    admit(kv, first)
    first.num_computed_tokens = 8
    kv.cache_full_blocks(first)
    kv.free(first)  # blocks 1 and 2 cached; plain 3..7 ahead of them
    assert kv.free_block_ids == [3, 4, 5, 6, 7, 2, 1]
    other = make_request("other", [0, 1, 2, 3, 90, 91, 92, 93, 94])
    hits, _ = admit(kv, other)
    # block 2's prefix went to block 3, the queue's front, and on to block 4 when the request took 3
    assert hits == [1] and other.block_ids == [1, 2, 3]
    assert kv.free_block_ids == [5, 6, 7, 4]  # block 4 in block 2's place
    moves = kv.take_moves()
    assert moves.relocated == {4: 2} and not moves.evicted and kv.blocks_relocated == 2  # one copy, from where the data lies
    assert kv.get_computed_blocks(make_request("first_again", range(9))) == ([1, 4], 8)
    kv.check_invariants()


class EvictionLog:
    """A tier that keeps nothing but the order of the hashes the pool evicts."""

    keeps_evicted, keeps_cached = True, False

    def __init__(self):
        self.evicted = []

    def fetch(self, block_hash):
        return None

    def holds(self, block_hash):
        return False


def churn(kv, seed, steps=400):
    """A server's life in miniature: conversations that go on, a shared start, growing requests;
    returns the hashes evicted in order, the hits, and the running requests' share of consecutive
    block pairs, summed over the steps."""
    rng = random.Random(seed)
    log = kv.tiers
    shared = [rng.randrange(1000) for _ in range(12)]
    finished, running, pairs, runs, count = [], [], 0, 0, 0
    for step in range(steps):
        while len(running) < 6:
            count += 1
            if finished and rng.random() < 0.5:
                tokens = rng.choice(finished[-20:]) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            else:
                tokens = (shared if rng.random() < 0.6 else []) + [rng.randrange(1000) for _ in range(rng.randrange(2, 30))]
            request = make_request(f"r{count}", tokens[-40:])
            _, num_hit_tokens = admit(kv, request)
            request.num_computed_tokens = request.num_tokens
            kv.cache_full_blocks(request)
            running.append([request, rng.randrange(4, 30)])
        for entry in list(running):
            request, left = entry
            if left == 0:
                kv.free(request)
                running.remove(entry)
                finished.append(list(request.token_ids))
                continue
            assert kv.allocate_slots(request, 1)
            request.token_ids.append(rng.randrange(1000))
            request.num_computed_tokens += 1
            kv.cache_full_blocks(request)
            entry[1] = left - 1
        log.evicted += [block_hash for block_hash, _ in kv.take_moves().evicted]
        for request, _ in running:
            pairs += len(request.block_ids) - 1
            runs += sum(b == a + 1 for a, b in zip(request.block_ids, request.block_ids[1:]))
        if step % 50 == 0:
            kv.check_invariants()
    kv.check_invariants()
    return log.evicted, kv.prefix_cache_hits, runs / pairs


def test_keep_runs_evicts_the_same_hashes_in_the_same_order_and_keeps_the_blocks_in_runs():
    with_runs = churn(KVCacheManager(128, BLOCK_SIZE, tiers=EvictionLog(), keep_runs=True), seed=3)
    without = churn(KVCacheManager(128, BLOCK_SIZE, tiers=EvictionLog()), seed=3)
    assert len(without[0]) > 100  # the pool turned over many times
    assert with_runs[:2] == without[:2]
    assert with_runs[2] > 0.7 and without[2] < 0.2  # consecutive pairs: 76% against 12%


def side_by_side(kv, requests=8, prompt_blocks=2, decode_blocks=12):
    """`requests` prompts admitted one after another in a fresh pool, then decoded a token each in
    turn until each holds decode_blocks more blocks; returns their block tables."""
    running = []
    for index in range(requests):
        request = make_request(f"r{index}", range(index * 100, index * 100 + prompt_blocks * BLOCK_SIZE))
        admit(kv, request)
        request.num_computed_tokens = request.num_tokens
        running.append(request)
    for _ in range(decode_blocks * BLOCK_SIZE):
        for request in running:
            assert kv.allocate_slots(request, 1)
            request.token_ids.append(7)
            request.num_computed_tokens += 1
    kv.check_invariants()
    return [request.block_ids for request in running]


def test_requests_decoding_side_by_side_leave_each_other_room_for_runs():
    room = KVCacheManager.RUN_ROOM
    tables = side_by_side(KVCacheManager(512, BLOCK_SIZE, keep_runs=True))
    for table in tables:
        runs = [1]  # lengths of the table's runs of consecutive blocks
        for a, b in zip(table, table[1:]):
            runs[-1:] = [runs[-1] + 1] if b == a + 1 else [runs[-1], 1]
        # the prompt's run goes on for room - 1 blocks, then runs of `room` or more (the last may be cut)
        assert runs[0] >= 2 + room - 1 and all(length >= room for length in runs[:-1]), table
    assert len({block for table in tables for block in table}) == sum(map(len, tables))
    # without keep_runs each request's decode blocks lie a request apart
    plain = side_by_side(KVCacheManager(512, BLOCK_SIZE))
    assert all(b == a + 8 for table in plain for a, b in zip(table[3:], table[4:]))


def test_room_for_runs_gives_way_when_the_pool_has_no_other_block():
    room = KVCacheManager.RUN_ROOM
    kv = KVCacheManager(1 + 4 * (2 + room - 1), BLOCK_SIZE, keep_runs=True)
    tables = side_by_side(kv, requests=4, decode_blocks=0)
    assert [table[0] for table in tables] == [1 + i * (2 + room - 1) for i in range(4)]  # each past the room before
    assert kv.num_free_blocks == 4 * (room - 1)  # every free block is someone's room
    late = make_request("late", range(9000, 9000 + BLOCK_SIZE))
    admit(kv, late)
    assert late.block_ids == [3]  # the queue's front, room or not
    kv.check_invariants()


def test_every_cached_hash_names_its_own_data_through_moves_evictions_and_loads():
    """Random steps on a real pool with a host tier: requests admitted (some freed again in the same
    schedule, before any data moved), grown, computed (each block written with a value that follows
    from its tokens), freed. After each step's moves, every hash the pool or the host tier holds has
    its data."""
    rng = random.Random(7)
    cache = KVCache(2, 24, BLOCK_SIZE, 1, 16, torch.bfloat16, torch.device("cpu"), kernel_layout=True)
    tiers = CacheTiers(cache, HostStore(1 << 20), None)
    kv = KVCacheManager(24, BLOCK_SIZE, tiers=tiers, keep_runs=True)
    expected = {}  # hash -> the value its block was computed with
    starts = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    running, count = [], 0

    def data(value):
        return torch.full(cache.block(0).shape, value, dtype=cache.tensor.dtype)

    for _ in range(300):
        scheduled = []
        for request in list(running):  # each grows by a few tokens, or ends
            if rng.random() < 0.15 or request.num_tokens > 70:
                kv.free(request)
                running.remove(request)
                continue
            grow = rng.randrange(1, 6)
            if not kv.allocate_slots(request, grow):
                continue
            request.token_ids += [rng.randrange(50) for _ in range(grow)]
            scheduled.append(request)
        while len(running) < 4:
            count += 1
            request = make_request(f"r{count}", rng.choice(starts)[:rng.randrange(4, 9)] +
                                   [rng.randrange(50) for _ in range(rng.randrange(1, 20))])
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            if not kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits, num_hit_tokens):
                break
            request.num_computed_tokens = num_hit_tokens
            if rng.random() < 0.2:  # preempted before the step ran: its blocks go back unwritten
                kv.free(request)
                continue
            running.append(request)
            scheduled.append(request)
        tiers.move(kv.take_moves())
        for block_hash, block_id in kv.cached_block_ids.items():
            assert torch.equal(cache.read_block(block_id), data(expected[block_hash])), block_hash
        for request in scheduled:  # the forward: a block's value follows from its tokens (a tier's copy agrees)
            for index in range(request.num_computed_tokens // BLOCK_SIZE, len(request.block_ids)):
                tokens = request.token_ids[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE]
                cache.write_block(request.block_ids[index], data(sum((t + 1) * (i + 3) for i, t in enumerate(tokens)) % 199))
            request.num_computed_tokens = request.num_tokens
            known = set(kv.cached_block_ids)
            kv.cache_full_blocks(request)
            for block_hash in set(kv.cached_block_ids) - known:
                expected[block_hash] = float(cache.read_block(kv.cached_block_ids[block_hash]).flatten()[0])
        tiers.move(kv.take_moves())
        kv.check_invariants()
    for block_hash in list(tiers.host._blocks):
        assert torch.equal(tiers.host.get(block_hash), data(expected[block_hash]))
    assert kv.blocks_relocated > 50 and tiers.counters["host"].hits > 10 and len(tiers.host) > 10
