"""The KV cache tiers at toy sizes: the host store's LRU, the disk store's files (restart, damage,
foreign files, a writer killed mid-write, a disk that cannot be written), and the KV manager moving
real pool blocks (a KVCache's tensors) out to a tier and back."""

import subprocess
import sys
import textwrap

import pytest
import torch

from ember.engine.attention import KVCache
from ember.engine.cache_tiers import CacheTiers
from ember.engine.cache_tiers.disk import DiskStore
from ember.engine.cache_tiers.host import HostStore
from ember.engine.kv_cache import FetchedBlock, KVCacheManager, tokens_by_tier
from ember.engine.request import Request
from ember.types import SamplingParams

BLOCK_SIZE = 4
SHAPE = (2, 2, 1, 8)  # layers, k/v, kv heads, block elements
NAMESPACE = b"n" * 16


def block_data(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def disk_store(folder, capacity=1 << 20, namespace=NAMESPACE) -> DiskStore:
    return DiskStore(folder, capacity, namespace, 1, SHAPE, torch.bfloat16)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_host_store_keeps_the_most_recently_used_within_its_capacity():
    size = block_data(0).numel() * 2
    host = HostStore(3 * size)
    for i in range(3):
        host.put(key(i), block_data(i))
    assert host.get(key(0)) is not None  # 0 is now the most recent: 1 goes first
    host.put(key(3), block_data(3))
    assert key(1) not in host and all(key(i) in host for i in (0, 2, 3))
    assert host.evictions == 1 and host.num_bytes == 3 * size
    host.put(key(4), torch.zeros(1000, dtype=torch.bfloat16))  # larger than the whole store: not kept
    assert key(4) not in host and len(host) == 3


def test_disk_blocks_survive_a_restart_and_read_back_equal(tmp_path):
    disk = disk_store(tmp_path)
    for i in range(4):
        disk.put(key(i), block_data(i))
    disk.close()
    again = disk_store(tmp_path)
    assert len(again) == 4
    for i in range(4):
        assert torch.equal(again.get(key(i)), block_data(i))
    assert again.get(key(9)) is None
    again.close()


def _only_file(folder, block_hash):
    return next(p for p in folder.rglob("*.kv") if p.name.startswith(block_hash.hex()))


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_file_is_deleted_and_counted_never_used(tmp_path, damage):
    disk = disk_store(tmp_path)
    disk.put(key(1), block_data(1))
    assert disk.flush()
    path = _only_file(tmp_path, key(1))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-3] ^= 0x40
    path.write_bytes(raw[: len(raw) // 2] if damage == "truncate" else b"" if damage == "empty" else raw)
    assert disk.get(key(1)) is None
    assert disk.corrupt == 1 and not path.exists() and key(1) not in disk
    disk.close()


def test_a_foreign_namespace_s_file_is_never_read(tmp_path):
    other = disk_store(tmp_path / "other", namespace=b"o" * 16)
    other.put(key(1), block_data(1))
    other.close()
    mine = disk_store(tmp_path / "mine")
    source = _only_file(tmp_path / "other", key(1))
    target = tmp_path / "mine" / source.parent.name / source.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    mine.close()
    mine = disk_store(tmp_path / "mine")  # a restart indexes the copied file
    assert key(1) in mine
    assert mine.get(key(1)) is None and mine.corrupt == 1
    mine.close()


def test_the_disk_tier_deletes_the_least_recently_used_past_its_capacity(tmp_path):
    probe = disk_store(tmp_path / "probe")
    probe.put(key(0), block_data(0))
    probe.close()
    file_bytes = probe.num_bytes
    disk = disk_store(tmp_path / "store", capacity=3 * file_bytes)
    for i in range(5):
        disk.put(key(i), block_data(i))
        assert disk.flush()
    assert [key(i) in disk for i in range(5)] == [False, False, True, True, True]
    assert disk.evictions == 2 and disk.num_bytes == 3 * file_bytes
    assert len(list((tmp_path / "store").rglob("*.kv"))) == 3
    disk.close()


_WRITER = textwrap.dedent("""
    import sys, torch
    from ember.engine.cache_tiers.disk import DiskStore
    disk = DiskStore(__import__("pathlib").Path(sys.argv[1]), 1 << 40, b"n" * 16, 1, (64, 2, 4, 1024), torch.bfloat16)
    print("ready", flush=True)
    i = 0
    while True:
        data = torch.full((64, 2, 4, 1024), float(i % 251), dtype=torch.bfloat16)
        disk.put(i.to_bytes(16, "little"), data)
        i += 1
        disk.flush()
""")


def test_a_writer_killed_mid_write_leaves_nothing_read_as_valid(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "ready"
    while len(list(tmp_path.rglob("*.kv"))) < 20:
        pass
    writer.kill()  # SIGKILL: no clean-up runs
    writer.wait()
    disk = DiskStore(tmp_path, 1 << 40, NAMESPACE, 1, (64, 2, 4, 1024), torch.bfloat16)
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".kv")]  # temporaries gone
    assert len(disk) >= 20
    for path in tmp_path.rglob("*.kv"):
        index = int.from_bytes(bytes.fromhex(path.name[:-3]), "little")
        data = disk.get(index.to_bytes(16, "little"))
        assert data is None or bool((data == float(index % 251)).all())
    disk.close()


def test_a_folder_that_cannot_be_made_turns_the_tier_off(tmp_path, caplog):
    (tmp_path / "a_file").write_text("")
    disk = disk_store(tmp_path / "a_file" / "kv")
    assert not disk.enabled
    disk.put(key(1), block_data(1))
    assert disk.get(key(1)) is None and key(1) not in disk
    assert "the disk tier is off" in caplog.text


_FULL_DISK = textwrap.dedent("""
    import logging, resource, sys, torch
    from ember.engine.cache_tiers.disk import DiskStore
    logging.basicConfig(level=logging.WARNING)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a write past 4 KiB fails: the disk is full
    disk = DiskStore(__import__("pathlib").Path(sys.argv[1]), 1 << 30, b"n" * 16, 1, (2, 2, 1, 4096), torch.bfloat16)
    for i in range(3):
        disk.put(i.to_bytes(16, "little"), torch.ones(2, 2, 1, 4096, dtype=torch.bfloat16))
        disk.flush()
    print(disk.enabled, len(disk), disk.get((0).to_bytes(16, "little")) is None)
""")


def test_a_full_disk_turns_the_tier_off_with_one_warning(tmp_path):
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["False", "0", "True"], done.stderr
    assert done.stderr.count("the disk tier is off") == 1
    assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.tmp"))


# ---- the KV manager and a real pool ---------------------------------------------------------------

def make_request(request_id, token_ids):
    return Request(request_id, list(token_ids), SamplingParams(), max_tokens=16, eos_token_ids=(), arrival_time=0.0)


def compute(kv, tiers, cache, request, fill):
    """What a step does: attach hits, allocate, move blocks, 'compute' (write `fill` into the new
    tokens' slots), cache the full blocks and move again."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits, num_hit_tokens)
    tiers.move(kv.take_moves())
    request.num_cached_tokens = num_hit_tokens
    for index in range(num_hit_tokens // BLOCK_SIZE, len(request.block_ids)):
        cache.write_block(request.block_ids[index], torch.full(cache.block(0).shape, fill + index,
                                                               dtype=cache.tensor.dtype))
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    tiers.move(kv.take_moves())
    return hits


@pytest.mark.parametrize("kernel_layout", [False, True])
def test_evicted_blocks_come_back_from_the_host_tier_with_their_data(kernel_layout):
    cache = KVCache(2, 6, BLOCK_SIZE, 1, 16, torch.bfloat16, torch.device("cpu"), kernel_layout=kernel_layout)
    tiers = CacheTiers(cache, HostStore(1 << 20), None)
    kv = KVCacheManager(6, BLOCK_SIZE, tiers=tiers)
    first = make_request("first", range(9))  # two full blocks and one token
    compute(kv, tiers, cache, first, fill=10)
    kept = [cache.read_block(block_id) for block_id in first.block_ids[:2]]
    kv.free(first)
    other = make_request("other", range(100, 120))  # five blocks: the whole pool, so both are evicted
    compute(kv, tiers, cache, other, fill=50)
    kv.free(other)
    assert len(tiers.host) == 2  # first's two blocks, evicted by the other request
    again = make_request("again", range(9))
    hits = compute(kv, tiers, cache, again, fill=90)
    assert [type(hit) for hit in hits] == [FetchedBlock, FetchedBlock] and tokens_by_tier(hits, BLOCK_SIZE) == \
        {"device": 0, "host": 8}
    for block_id, data in zip(again.block_ids[:2], kept):
        assert torch.equal(cache.read_block(block_id), data)
    assert tiers.counters["host"].hits == 2
    assert kv.num_cached_tokens(make_request("look", range(9))) == 8  # found in the pool now
    kv.free(again)
    kv.check_invariants()
    assert kv.num_used_blocks == 0


def test_a_block_evicted_before_its_data_is_loaded_is_not_copied_out():
    """A fetched block freed and handed out again within one schedule holds no data yet: the tier
    keeps the copy it came from, and nothing reads the pool's stale bytes into a tier."""
    cache = KVCache(1, 4, BLOCK_SIZE, 1, 16, torch.bfloat16, torch.device("cpu"))
    tiers = CacheTiers(cache, HostStore(1 << 20), None)
    kv = KVCacheManager(4, BLOCK_SIZE, tiers=tiers)
    first = make_request("first", range(5))
    compute(kv, tiers, cache, first, fill=1)
    kv.free(first)
    filler = make_request("filler", range(100, 112))
    compute(kv, tiers, cache, filler, fill=7)
    kv.free(filler)
    kept = tiers.host.get(next(iter(tiers.host._blocks)))
    reader = make_request("reader", range(5))
    hits, num_hit_tokens = kv.get_computed_blocks(reader)
    assert kv.allocate_slots(reader, reader.num_tokens - num_hit_tokens, hits, num_hit_tokens)
    kv.free(reader)  # preempted in the same schedule, before the step moved anything
    taker = make_request("taker", range(200, 212))
    assert kv.allocate_slots(taker, taker.num_tokens)
    moves = kv.take_moves()
    assert not moves.loads and all(block_hash != hits[0].block_hash for block_hash, _ in moves.evicted)
    tiers.move(moves)
    assert torch.equal(tiers.host.get(hits[0].block_hash), kept)
    kv.free(taker)
    kv.check_invariants()


def test_a_look_at_the_cached_prefix_counts_tier_blocks_without_fetching_them():
    cache = KVCache(1, 6, BLOCK_SIZE, 1, 16, torch.bfloat16, torch.device("cpu"))
    tiers = CacheTiers(cache, HostStore(1 << 20), None)
    kv = KVCacheManager(6, BLOCK_SIZE, tiers=tiers)
    first = make_request("first", range(9))
    compute(kv, tiers, cache, first, fill=1)
    kv.free(first)
    filler = make_request("filler", range(100, 120))
    compute(kv, tiers, cache, filler, fill=5)  # the whole pool: first's blocks go to host memory
    kv.free(filler)
    assert kv.num_cached_tokens(make_request("look", range(9))) == 8
    assert tiers.counters["host"].hits == 0 and not kv.take_moves()
    assert kv.num_cached_tokens(make_request("other", range(200, 209))) == 0
