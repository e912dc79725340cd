"""Paged KV block manager: a pool of fixed-size blocks, ref counts, and a prefix cache.

Block 0 is a null block for padding block tables; it is never handed out. A full block whose
tokens are all computed gets a hash chained from its parent's hash, so a later request with the
same prefix (and the same cache salt) can reuse it. Free blocks sit in an LRU queue; a free block
that still has a hash stays findable until allocation takes it from the front of the queue. With
keep_runs, a request's blocks are kept in runs of consecutive ids, cached data moved aside to the
block the queue evicts (see _take_free_block).

A pinned block (engine.kv_pins) that no request holds waits aside, out of that queue, until its
pin expires. Pins give way only to a request that holds the pool alone and still cannot fit, so
they never block the engine. The changes to the set of cached hashes go to a feed
(engine.kv_changes) that the data-parallel router reads.

Behind the pool may stand slower tiers (engine.cache_tiers: host memory, disk) that keep blocks by
the same hashes. A prompt whose chain leaves the pool goes on through them: each block a tier
holds is fetched whole (its data, already checked) and loaded into a fresh block. The manager
only lists what moves (`take_moves`): blocks evicted with their hash, blocks newly cached, and
fetched data to load; the engine copies them before the step's forward writes to the pool.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ember.engine.free_queue import FreeQueue
from ember.engine.kv_changes import CacheChangeFeed
from ember.engine.kv_pins import PinTable
from ember.engine.request import Request

DEFAULT_MAX_PINNED_SHARE = 0.25
_ROOT = b"\x00"
_CHILD = b"\x01"


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], cache_salt: str | None,
               media_key: bytes | None = None) -> bytes:
    """16-byte blake2b of (parent hash, salt, media key, token ids): the media key names the images
    the block's tokens hold (Request.media_key). Every field is framed, so no two differ only in framing."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(_ROOT if parent_hash is None else _CHILD + parent_hash)
    for part in (None if cache_salt is None else cache_salt.encode(), media_key):
        digest.update(_ROOT if part is None else _CHILD + len(part).to_bytes(8, "little") + part)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockTiers(Protocol):
    """What the manager asks of the tiers behind the pool (engine.cache_tiers.CacheTiers)."""

    keeps_evicted: bool  # wants the blocks the pool evicts (a host tier)
    keeps_cached: bool  # wants every block as it is cached (a disk tier writes them through)

    def fetch(self, block_hash: bytes) -> "FetchedBlock | None": ...

    def holds(self, block_hash: bytes) -> bool: ...


@dataclass(frozen=True, slots=True)
class FetchedBlock:
    """A block a tier holds, fetched for a prompt: its hash, its data, and the tier's name."""

    block_hash: bytes
    data: Any
    tier: str


@dataclass(slots=True)
class BlockMoves:
    """What must be copied between the pool and its tiers before the pool is written again."""

    evicted: list[tuple[bytes, int]] = field(default_factory=list)  # (hash, block id) the pool let go
    cached: list[tuple[bytes, int]] = field(default_factory=list)  # (hash, block id) newly cached
    loads: dict[int, Any] = field(default_factory=dict)  # block id -> fetched data to write in
    # block id -> the block whose data it takes (KVCacheManager's keep_runs): copied after the
    # reads above and before the loads, every source read as it was before any copy
    relocated: dict[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.evicted or self.cached or self.loads or self.relocated)


def tokens_by_tier(hits: Sequence[int | FetchedBlock], block_size: int) -> dict[str, int]:
    """The tokens of get_computed_blocks' hits by where they were found: "device" (the pool), then
    each tier that served some."""
    counts = {"device": 0}
    for hit in hits:
        tier = "device" if isinstance(hit, int) else hit.tier
        counts[tier] = counts.get(tier, 0) + block_size
    return counts


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # set only while the hash map points at this block

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.hash is not None})"


class KVCacheManager:
    """Hands out block ids to requests and keeps the prefix cache.

    Invariant: a block's hash is set exactly when `cached_block_ids[hash]` names that block, so a
    block that lost a race to register its hash stays plain and is reused first once free.
    The manager tracks the requests that hold blocks; `check_invariants()` needs no arguments.
    """

    # With keep_runs, a request's new run starts past the RUN_ROOM - 1 blocks after every holder's
    # last one (_plain_block_with_room): 4 decoded 32 streams faster than 1 and 8 (docs/benchmarks.md).
    RUN_ROOM = 4

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_pinned_share: float = DEFAULT_MAX_PINNED_SHARE,
                 clock: Callable[[], float] = time.monotonic, tiers: BlockTiers | None = None,
                 keep_runs: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= max_pinned_share <= 1.0:
            raise ValueError(f"max_pinned_share must be between 0 and 1, got {max_pinned_share}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # front: taken next (plain blocks, then the least recently freed cached ones)
        self._free = FreeQueue(range(1, num_blocks))
        self.cached_block_ids: dict[bytes, int] = {}
        self._num_cached_free = 0
        self._holders: dict[str, Request] = {}  # requests holding blocks, for check_invariants
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens found
        self.pins = PinTable(int(max_pinned_share * self.num_allocatable_blocks), clock)
        self._pinned_idle: set[int] = set()  # pinned blocks no request holds: out of the free queue
        self._changes = CacheChangeFeed()
        self.tiers = tiers if enable_prefix_caching else None
        self._moves = BlockMoves()
        # keep_runs: a request's next block is the one after its last wherever that block is free,
        # a cached one's data moved to the block the queue would have taken (see _take_free_block)
        self.keep_runs = keep_runs
        self._origin: dict[int, int] = {}  # block -> where its cached data lies until take_moves copies it
        self.blocks_relocated = 0  # cached blocks whose data moved so that a request's blocks run on

    @property
    def num_allocatable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no request holds that keep a prefix (evictable, or pinned)."""
        return self._num_cached_free + len(self._pinned_idle)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.pins)

    @property
    def num_used_blocks(self) -> int:
        return self.num_allocatable_blocks - len(self._free) - len(self._pinned_idle)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_allocatable_blocks

    @property
    def free_block_ids(self) -> list[int]:
        """Free block ids in the order allocation will take them (a copy; for tests and debugging)."""
        return list(self._free)

    def get_computed_blocks(self, request: Request) -> tuple[list[int | FetchedBlock], int]:
        """The cached blocks matching the start of request.token_ids, and the tokens they cover:
        the pool's block ids, then the blocks the tiers behind it hold, fetched (allocate_slots
        gives those fresh blocks to load into).

        At most num_tokens - 1 tokens are hits, so the engine always computes one token to sample from,
        and none for a request that computes its whole prompt.
        """
        if not self.enable_prefix_caching or request.computes_whole_prompt:
            return [], 0
        self._expire_pins()
        hits: list[int | FetchedBlock] = []
        in_pool = True
        for block_hash in self._prefix_hashes(request):
            block_id = self.cached_block_ids.get(block_hash) if in_pool else None
            if block_id is not None:
                hits.append(block_id)
                continue
            in_pool = False  # past the pool's run, blocks come from the tiers or not at all
            fetched = self.tiers.fetch(block_hash) if self.tiers is not None else None
            if fetched is None:
                break
            hits.append(fetched)
        return hits, len(hits) * self.block_size

    def num_cached_tokens(self, request: Request) -> int:
        """The tokens get_computed_blocks would find now, read from no tier (a look, not a fetch)."""
        if not self.enable_prefix_caching:
            return 0
        count = 0
        in_pool = True
        for block_hash in self._prefix_hashes(request):
            in_pool = in_pool and block_hash in self.cached_block_ids
            if not in_pool and not (self.tiers is not None and self.tiers.holds(block_hash)):
                break
            count += self.block_size
        return count

    def _prefix_hashes(self, request: Request) -> Iterator[bytes]:
        """The chained hashes of the request's full blocks short of its last token, in order."""
        size = self.block_size
        tokens = request.token_ids
        parent = None
        for start in range(0, (len(tokens) - 1) // size * size, size):
            parent = hash_block(parent, tokens[start:start + size], request.cache_salt,
                                request.media_key(start, start + size))
            yield parent

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int | FetchedBlock] = (), num_new_computed_tokens: int = 0) -> bool:
        """Attach cache hits (get_computed_blocks), then grow request.block_ids to cover every
        token up to the new ones.

        Returns False and changes nothing when the pool cannot cover it.
        """
        assert not new_computed_blocks or not request.block_ids, "cache hits attach only to a request with no blocks"
        pool_hits = [hit for hit in new_computed_blocks if isinstance(hit, int)]
        fetched = new_computed_blocks[len(pool_hits):]
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required - len(request.block_ids) - len(pool_hits))
        self._expire_pins()
        num_free_hits = sum(1 for block_id in pool_hits if block_id in self._free)
        shortage = num_new_blocks + num_free_hits - len(self._free)
        if shortage > 0 and not (self._holders.keys() <= {request.request_id}
                                 and self._unpin_idle(shortage, keep=pool_hits)):
            return False

        if self.enable_prefix_caching and not request.block_ids and request.num_computed_tokens == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        for block_id in pool_hits:
            block = self.blocks[block_id]
            if block_id in self._free:
                self._unqueue_cached(block_id)
            self._pinned_idle.discard(block_id)
            block.ref_count += 1
            request.block_ids.append(block_id)
            request.block_hashes.append(block.hash)
        for index in range(num_new_blocks):
            block = self.blocks[self._take_free_block(request.block_ids[-1] + 1 if request.block_ids else 0)]
            if block.hash is not None:
                self._evict(block)
            block.ref_count = 1
            request.block_ids.append(block.block_id)
            if index < len(fetched):  # a tier's block: its data is written in before the step runs
                self._moves.loads[block.block_id] = fetched[index].data
                self._register(fetched[index].block_hash, block)
                request.block_hashes.append(fetched[index].block_hash)
        if new_computed_blocks:
            self._apply_pins(request, 0)
        if request.block_ids:
            self._holders[request.request_id] = request
        return True

    def _take_free_block(self, wanted: int) -> int:
        """The block right after the request's last one when it is free and holds nothing cached
        (or, with keep_runs, when it is free at all), else the front of the free queue.

        Runs of consecutive blocks are what ember's CPU attention reads fastest: a block of one KV
        head is 2 KiB for the default model, and where a pool that has served a while hands out
        blocks from all over itself, 32 streams decode about 7% slower (bench/kv_runs.py). With
        keep_runs, where the wanted block is not free, a new run starts where it leaves the others
        room (_plain_block_with_room). Plain free blocks all sit ahead of cached ones, so taking a
        plain one never evicts a cached block sooner. A cached one is not evicted out of turn
        either: the front of the queue is evicted as it would have been, and the wanted block's
        hash, data and place in the queue go to that front block (the data copied by whoever
        applies take_moves, before the next forward).
        """
        if 0 < wanted < self.num_blocks and wanted in self._free:
            block = self.blocks[wanted]
            if block.hash is None:
                self._free.remove(wanted)
                return wanted
            if self.keep_runs and self._free.front() != wanted:
                self._relocate(block, self.blocks[self._free.pop_front()])
                return wanted
        if self.keep_runs:
            block_id = self._plain_block_with_room()
            if block_id is not None:
                self._free.remove(block_id)
                return block_id
        return self._free.pop_front()

    def _plain_block_with_room(self) -> int | None:
        """Where a request starts a new run: the first plain free block that is not among the
        RUN_ROOM - 1 after any holder's last block. Requests decoding side by side each need a new
        block every block_size tokens; in a fresh pool they would take one another's next blocks in
        turn, every request's decode blocks strewn one request apart. Left room, each one's next
        blocks follow its last (runs of RUN_ROOM), and a new prompt starts past the others' room.
        Only plain blocks are passed over (their order decides nothing the prefix cache keeps);
        None where every plain block near the front is someone's room."""
        room: set[int] = set()
        for request in self._holders.values():
            last = request.block_ids[-1]
            room.update(range(last + 1, last + self.RUN_ROOM))
        for seen, block_id in enumerate(self._free):
            if seen > len(room) or self.blocks[block_id].hash is not None:
                return None
            if block_id not in room:
                return block_id
        return None

    def _relocate(self, source: Block, target: Block) -> None:
        """Give queued cached block `source`'s hash, data and place in the queue to `target`, just
        taken from the queue's front (and evicted, as the queue's turn asks); `source` leaves the
        queue plain."""
        if target.hash is not None:
            self._evict(target)
        self._free.replace(source.block_id, target.block_id)
        target.hash, source.hash = source.hash, None
        self.cached_block_ids[target.hash] = target.block_id
        load = self._moves.loads.pop(source.block_id, None)  # its data still on its way from a tier
        if load is not None:
            self._moves.loads[target.block_id] = load
        else:
            self._origin[target.block_id] = self._origin.pop(source.block_id, source.block_id)
        self.blocks_relocated += 1

    def _unqueue_cached(self, block_id: int) -> None:
        """Take a cached block out of the free queue, keeping its hash."""
        self._free.remove(block_id)
        self._num_cached_free -= 1

    def _evict(self, block: Block) -> None:
        """Forget the hash of a cached block just taken from the free queue (a tier that keeps
        evicted blocks gets it first)."""
        # a block whose data has not been loaded yet is in the tier it came from: nothing to keep
        origin = self._origin.pop(block.block_id, block.block_id)
        if self._moves.loads.pop(block.block_id, None) is None and self.tiers is not None and self.tiers.keeps_evicted:
            self._moves.evicted.append((block.hash, origin))
        del self.cached_block_ids[block.hash]
        self._changes.removed(block.hash)
        block.hash = None
        self._num_cached_free -= 1

    def _register(self, block_hash: bytes, block: Block) -> None:
        """Make `block` the one the hash map names for `block_hash`, unless another already is."""
        if block_hash not in self.cached_block_ids:
            self.cached_block_ids[block_hash] = block.block_id
            block.hash = block_hash
            self._changes.stored(block_hash)

    def take_moves(self) -> BlockMoves:
        """The copies between the pool and its tiers, and within the pool, asked for since the last
        call (BlockMoves)."""
        moves, self._moves = self._moves, BlockMoves()
        moves.relocated, self._origin = {target: source for target, source in self._origin.items()
                                          if target != source}, {}
        return moves

    def cache_full_blocks(self, request: Request) -> None:
        """Hash and register each block that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else None
        first_new = len(hashes)
        for index in range(first_new, request.num_computed_tokens // size):
            start = index * size
            parent = hash_block(parent, request.token_ids[start:start + size], request.cache_salt,
                                request.media_key(start, start + size))
            hashes.append(parent)
            block = self.blocks[request.block_ids[index]]
            if parent not in self.cached_block_ids:
                self._register(parent, block)
                if self.tiers is not None and self.tiers.keeps_cached:
                    self._moves.cached.append((parent, block.block_id))
        if len(hashes) > first_new:
            self._apply_pins(request, first_new)

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail of its chain goes to the free queue first."""
        for block_id in reversed(request.block_ids):
            if block_id:  # 0: released already, its window passed (release_blocks_before)
                self._release(block_id)
        request.block_ids = []
        request.block_hashes = []
        self._holders.pop(request.request_id, None)

    def trim_blocks(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past those its first `num_tokens` tokens need (the tail a
        rejected speculative draft was written into; such blocks were never hashed)."""
        keep = -(-num_tokens // self.block_size)
        while len(request.block_ids) > max(keep, len(request.block_hashes), 1):
            block_id = request.block_ids.pop()
            if block_id:
                self._release(block_id)

    def release_blocks_before(self, request: Request, position: int) -> None:
        """Give back the request's blocks that hold only tokens before `position`, which no layer
        reads again (a model whose every layer has a sliding window); their entries in
        request.block_ids become the null block 0, so positions keep their indices. A released
        block keeps its hash: its keys are those of its tokens, so it stays a valid prefix for a
        later request until the pool hands it out again, which drops the hash."""
        for index in range(min(max(position, 0) // self.block_size, len(request.block_ids))):
            if request.block_ids[index]:
                self._release(request.block_ids[index])
                request.block_ids[index] = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash in self.pins:
                self._pinned_idle.add(block_id)
                return
            self._free.append(block_id)
            if block.hash is None:
                self._free.move_to_front(block_id)  # holds nothing worth keeping
            else:
                self._num_cached_free += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        self._unpin_idle(len(self._pinned_idle))
        for block_id in self.cached_block_ids.values():
            self.blocks[block_id].hash = None
        self.cached_block_ids.clear()
        self._origin.clear()  # no block's data is wanted any more
        self._num_cached_free = 0
        self._changes.cleared()
        return True

    def record_cache_changes(self) -> None:
        """Keep the changes to the set of cached block hashes from now on (take_cache_changes)."""
        self._changes.start(self.cached_block_ids)

    def take_cache_changes(self) -> tuple[bool, list[bytes], list[bytes]]:
        """(cleared, stored, removed) since the last call (engine.kv_changes.CacheChangeFeed.take)."""
        return self._changes.take()

    def num_blocks_freed_by(self, requests: Iterable[Request]) -> int:
        """Blocks that would join the free queue if these requests were freed (held by them alone,
        and not pinned)."""
        holders = Counter(block_id for request in requests for block_id in request.block_ids)
        return sum(1 for block_id, count in holders.items()
                   if self.blocks[block_id].ref_count == count and self.blocks[block_id].hash not in self.pins)

    # ---- pins ------------------------------------------------------------------------------------

    def _apply_pins(self, request: Request, first_index: int) -> None:
        """Pin (or renew) the request's cached blocks from `first_index` on, under its own pins."""
        size = self.block_size
        cache_pins = request.sampling_params.cache_pins
        blocks = [(block_hash, (index + 1) * size)
                  for index, block_hash in enumerate(request.block_hashes[first_index:], first_index)
                  if block_hash in self.cached_block_ids]  # else its cached copy was evicted: this one is plain
        for block_hash in self.pins.pin_blocks(blocks, cache_pins):
            block_id = self.cached_block_ids[block_hash]
            if block_id in self._free:  # an idle copy found through another request's hash
                self._unqueue_cached(block_id)
                self._pinned_idle.add(block_id)
        if cache_pins:
            reach = max(pin.num_tokens for pin in cache_pins) // size
            request.num_pinned_tokens = self.pins.num_leading_pinned(request.block_hashes, reach) * size

    def _expire_pins(self) -> None:
        for block_hash in self.pins.expire():
            self._requeue_if_idle(block_hash)

    def _unpin_idle(self, count: int, keep: Sequence[int] = ()) -> bool:
        """Unpin the idle pinned blocks that expire soonest (other than `keep`), `count` of them;
        False, unpinning none, if there are fewer."""
        candidates = self._pinned_idle.difference(keep)
        if count > len(candidates):
            return False
        soonest = sorted(candidates, key=lambda block_id: self.pins.expires_at(self.blocks[block_id].hash))
        for block_id in soonest[:count]:
            block_hash = self.blocks[block_id].hash
            self.pins.unpin(block_hash)
            self._requeue_if_idle(block_hash)
        return True

    def _requeue_if_idle(self, block_hash: bytes) -> None:
        """An unpinned block no request holds goes back to the queue as the most recently freed."""
        block_id = self.cached_block_ids[block_hash]
        if block_id in self._pinned_idle:
            self._pinned_idle.remove(block_id)
            self._free.append(block_id)
            self._num_cached_free += 1

    # ---- invariants ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the pool."""
        assert 0 not in self._free and self.blocks[0].ref_count == 0 and self.blocks[0].hash is None, \
            "the null block 0 was handed out"
        expected_refs = [0] * self.num_blocks
        for request_id, request in self._holders.items():
            held = [block_id for block_id in request.block_ids if block_id]  # 0: released, out of its window
            assert held, f"request {request_id} is tracked but holds no blocks"
            assert len(set(held)) == len(held), f"request {request_id} lists a block twice: {request.block_ids}"
            assert len(request.block_hashes) <= len(request.block_ids), \
                f"request {request_id} has more block hashes than blocks"
            for block_id in held:
                expected_refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == expected_refs[block.block_id], \
                f"block {block.block_id} has ref_count {block.ref_count} but {expected_refs[block.block_id]} holders"
            is_free = block.block_id in self._free
            is_pinned_idle = block.block_id in self._pinned_idle
            assert not (is_free and block.ref_count), f"free block {block.block_id} has ref_count {block.ref_count}"
            assert not (is_pinned_idle and (is_free or block.ref_count or block.hash not in self.pins)), \
                f"idle pinned block {block.block_id} is also free, in use, or not pinned"
            assert is_free or is_pinned_idle or block.ref_count or block.block_id == 0, \
                f"block {block.block_id} is neither free nor in use (leaked)"
            if block.hash is not None:
                assert self.cached_block_ids.get(block.hash) == block.block_id, \
                    f"block {block.block_id} carries a hash the hash map does not point back to"
        for block_hash, block_id in self.cached_block_ids.items():
            assert self.blocks[block_id].hash == block_hash, \
                f"hash map entry points at block {block_id}, which has a different hash"
        for target in self._origin:
            assert self.blocks[target].hash is not None, f"block {target} waits for data no hash names"
        num_cached_free = sum(1 for block_id in self._free if self.blocks[block_id].hash is not None)
        assert num_cached_free == self._num_cached_free, \
            f"cached free count is {self._num_cached_free} but {num_cached_free} free blocks carry a hash"
        num_plain_free = len(self._free) - num_cached_free
        num_used = sum(1 for block in self.blocks if block.ref_count)
        num_idle = len(self._pinned_idle)
        assert num_plain_free + num_cached_free + num_used + num_idle == self.num_allocatable_blocks, \
            f"free {num_plain_free} + cached {num_cached_free} + used {num_used} + pinned {num_idle} " \
            f"!= pool {self.num_allocatable_blocks}"
        assert len(self.pins) <= self.pins.max_blocks, \
            f"{len(self.pins)} blocks pinned, above the share of {self.pins.max_blocks}"
        for block_hash in self.pins:
            assert block_hash in self.cached_block_ids, "a pin names a hash no block holds"
