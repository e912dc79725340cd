"""The tiers behind the KV pool: host memory (engine.cache_tiers.host) and disk
(engine.cache_tiers.disk), each keeping whole blocks by the prefix cache's chained hash.

The KV manager asks `fetch` for the blocks a prompt needs past the pool's run, and lists what
must move (kv_cache.BlockMoves); `move` copies it before the step's forward writes to the pool:
the data of evicted and newly cached blocks out first, then fetched data into its fresh blocks.
Evicted blocks go to host memory; newly cached ones are written through to disk, so a prefix
outlives the worker and the server. A block read from disk joins host memory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ember.engine.attention import KVCache
from ember.engine.cache_tiers import namespace
from ember.engine.cache_tiers.disk import DiskStore
from ember.engine.cache_tiers.host import HostStore
from ember.engine.kv_cache import BlockMoves, FetchedBlock

logger = logging.getLogger("ember.cache")


@dataclass(slots=True)
class TierCounters:
    hits: int = 0  # blocks fetched from the tier
    misses: int = 0  # blocks asked of it and not found


class CacheTiers:
    """`host`: the host-memory store, or None (off); `disk`: the disk store, or None."""

    def __init__(self, cache: KVCache, host: HostStore | None, disk: DiskStore | None) -> None:
        self.cache = cache
        self.host = host
        self.disk = disk
        self.keeps_evicted = host is not None
        self.keeps_cached = disk is not None
        self.counters = {"host": TierCounters(), "disk": TierCounters()}
        self.write_seconds = 0.0  # copying blocks out of the pool (to host memory, or queued for disk)
        self.read_seconds = 0.0  # copying fetched blocks into the pool

    def fetch(self, block_hash: bytes) -> FetchedBlock | None:
        if self.host is not None:
            data = self.host.get(block_hash)
            if data is not None:
                self.counters["host"].hits += 1
                return FetchedBlock(block_hash, data, "host")
            self.counters["host"].misses += 1
        if self.disk is not None:
            data = self.disk.get(block_hash)
            if data is not None:
                self.counters["disk"].hits += 1
                if self.host is not None:
                    self.host.put(block_hash, data)
                return FetchedBlock(block_hash, data, "disk")
            self.counters["disk"].misses += 1
        return None

    def holds(self, block_hash: bytes) -> bool:
        """Whether a tier has the block (its file is checked only when fetched)."""
        return (self.host is not None and block_hash in self.host) or (self.disk is not None and block_hash in self.disk)

    def move(self, moves: BlockMoves) -> None:
        """Copy what `moves` lists: the data of evicted and newly cached blocks out of the pool,
        then the data of blocks the pool moved within itself, then the fetched blocks' data into
        theirs."""
        if not moves:
            return
        began = time.perf_counter()
        evicted = [(block_hash, self.cache.read_block(block_id)) for block_hash, block_id in moves.evicted
                   if not self.host.touch(block_hash)]
        for block_hash, block_id in moves.cached:
            if block_hash not in self.disk:
                self.disk.put(block_hash, self.cache.read_block(block_id))
        copied_out = time.perf_counter()
        if moves.relocated:
            self.cache.copy_blocks(moves.relocated)
        for block_id, data in moves.loads.items():
            self.cache.write_block(block_id, data)
        loaded = time.perf_counter()
        for block_hash, data in evicted:
            self.host.put(block_hash, data)
        self.write_seconds += copied_out - began + time.perf_counter() - loaded
        self.read_seconds += loaded - copied_out

    def stats(self) -> dict:
        """Each tier that is on: its bytes, blocks, capacity, evictions, hits, misses and seconds."""
        tiers = {}
        if self.host is not None:
            tiers["host"] = self._tier_stats("host", self.host, self.read_seconds, self.write_seconds)
        if self.disk is not None:
            tiers["disk"] = self._tier_stats("disk", self.disk, self.disk.read_seconds, self.disk.write_seconds)
            tiers["disk"].update(enabled=self.disk.enabled, corrupt=self.disk.corrupt,
                                 dropped_writes=self.disk.dropped_writes)
        return tiers

    def _tier_stats(self, name: str, store, read_seconds: float, write_seconds: float) -> dict:
        counters = self.counters[name]
        return {"bytes": store.num_bytes, "blocks": len(store), "capacity_bytes": store.capacity_bytes,
                "evictions": store.evictions, "hits": counters.hits, "misses": counters.misses,
                "read_seconds": read_seconds, "write_seconds": write_seconds}

    def reset_counters(self) -> None:
        self.counters = {"host": TierCounters(), "disk": TierCounters()}

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def build_cache_tiers(cache: KVCache, host_bytes: int, disk_folder: str | None, disk_bytes: int,
                      description: dict) -> CacheTiers | None:
    """The tiers the sizes ask for (host_bytes 0: no host tier; disk_folder None: no disk tier),
    or None when neither is on. `description`: the cache namespace (cache_tiers.namespace.describe)."""
    host = HostStore(host_bytes) if host_bytes > 0 else None
    disk = None
    if disk_folder is not None and disk_bytes > 0:
        name = namespace.digest(description)
        folder = Path(disk_folder).expanduser() / name.hex()
        shape, dtype = cache.block_layout()
        disk = DiskStore(folder, disk_bytes, name, namespace.CACHE_FORMAT_VERSION, shape, dtype)
        if disk.enabled:
            try:
                (folder / "namespace.json").write_text(json.dumps(description, indent=1, default=str))
            except OSError:
                pass  # the description is for people; the blocks check their namespace themselves
            logger.info("KV cache on disk: %s (%d blocks there, up to %.0f MiB)", folder, len(disk), disk_bytes / 2**20)
    if host is None and disk is None:
        return None
    if host is not None:
        logger.info("KV cache in host memory: up to %.0f MiB", host_bytes / 2**20)
    return CacheTiers(cache, host, disk)
