"""The disk tier: KV blocks in files named by their chained hash, under a folder named by the
cache namespace (engine.cache_tiers.namespace), so another model, format or layout never reads them.

A file is a fixed header (magic, format version, payload length, namespace digest, block hash,
payload checksum) and the block's bytes. It is written to a temporary name and renamed into
place, so a reader sees a whole file or none; a file that fails any check on reading (truncated,
corrupted, foreign) is deleted and counted, never used. Files are written by one thread beside the
engine; reads happen when a prompt asks for a block. Over its capacity the tier deletes the files
written or read least recently. Where the folder cannot be written (disk full, read-only,
permissions) the tier turns itself off with one warning, and serving goes on without it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger("ember.cache")

_MAGIC = b"EMBERKV\x00"
_HEADER = struct.Struct("<8sIQ16s16s16s")  # magic, version, payload bytes, namespace, block hash, checksum
_SUFFIX = ".kv"
_MAX_PENDING_BYTES = 256 << 20  # blocks waiting to be written; past it new ones are not written


def _checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class DiskStore:
    """`shape` and `dtype`: a block's data; `namespace`: the 16-byte digest of what the blocks'
    bits depend on; `version`: ember's cache file format."""

    def __init__(self, folder: Path, capacity_bytes: int, namespace: bytes, version: int,
                 shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.folder = folder
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self.version = version
        self.shape = shape
        self.dtype = dtype
        self._payload_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        self.enabled = True
        self.num_bytes = 0
        self.evictions = 0
        self.corrupt = 0  # files found unreadable and deleted
        self.dropped_writes = 0  # blocks not written because the writer was behind
        self.write_seconds = 0.0
        self.read_seconds = 0.0
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recent first
        self._lock = threading.Lock()
        self._pending: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue()
        self._pending_bytes = 0
        self._writer: threading.Thread | None = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._turn_off(exc)
            return
        self._writer = threading.Thread(target=self._write_loop, name="ember-kv-disk", daemon=True)
        self._writer.start()

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.folder / name[:2] / (name + _SUFFIX)

    def _scan(self) -> None:
        """Index the files already here (a restart's), oldest first; delete temporary ones a
        killed writer left behind."""
        found = []
        for path in self.folder.glob("*/*"):
            if not path.name.endswith(_SUFFIX):
                path.unlink(missing_ok=True)
                continue
            try:
                block_hash = bytes.fromhex(path.name[:-len(_SUFFIX)])
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.num_bytes += size
        self._trim()

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return self.enabled and block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    # ---- reading -----------------------------------------------------------------------------

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's data, checked against its header and checksum; None when the tier does not
        hold it or its file is bad (then the file is deleted and counted)."""
        with self._lock:
            if not self.enabled or block_hash not in self._index:
                return None
        began = time.perf_counter()
        path = self._path(block_hash)
        try:
            raw = path.read_bytes()
        except OSError:
            self._forget(block_hash)
            return None
        data = self._decode(raw, block_hash)
        self.read_seconds += time.perf_counter() - began
        if data is None:
            self.corrupt += 1
            logger.warning("KV cache file %s is damaged or foreign; deleted", path.name)
            path.unlink(missing_ok=True)
            self._forget(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        os.utime(path)  # a restart's scan orders files by use
        return data

    def _decode(self, raw: bytes, block_hash: bytes) -> torch.Tensor | None:
        if len(raw) < _HEADER.size:
            return None
        magic, version, length, namespace, stored_hash, checksum = _HEADER.unpack_from(raw)
        payload = memoryview(raw)[_HEADER.size:]
        expected = self._payload_bytes
        if (magic != _MAGIC or version != self.version or namespace != self.namespace
                or stored_hash != block_hash or length != expected or len(payload) != expected
                or _checksum(payload) != checksum):
            return None
        return torch.frombuffer(bytearray(payload), dtype=self.dtype).view(self.shape)

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.num_bytes -= size

    # ---- writing -----------------------------------------------------------------------------

    def put(self, block_hash: bytes, data: torch.Tensor) -> None:
        """Queue the block to be written (a copy no one writes again); nothing if it is held
        already, the tier is off, or the writer is too far behind."""
        with self._lock:
            if not self.enabled or block_hash in self._index:
                return
            size = data.numel() * data.element_size()
            if self._pending_bytes + size > _MAX_PENDING_BYTES:
                self.dropped_writes += 1
                return
            self._pending_bytes += size
        self._pending.put((block_hash, data))

    def _write_loop(self) -> None:
        while (item := self._pending.get()) is not None:
            try:
                self._write_one(*item)
            finally:
                self._pending.task_done()

    def _write_one(self, block_hash: bytes, data: torch.Tensor) -> None:
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        with self._lock:
            self._pending_bytes -= len(payload)
            if not self.enabled:
                return
        began = time.perf_counter()
        try:
            self._write(block_hash, payload)
        except OSError as exc:
            self._turn_off(exc)
            return
        self.write_seconds += time.perf_counter() - began
        with self._lock:
            if self.enabled and block_hash not in self._index:
                self._index[block_hash] = _HEADER.size + len(payload)
                self.num_bytes += _HEADER.size + len(payload)
            self._trim()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        path = self._path(block_hash)
        path.parent.mkdir(exist_ok=True)
        header = _HEADER.pack(_MAGIC, self.version, len(payload), self.namespace, block_hash, _checksum(payload))
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as out:
                out.write(header)
                out.write(payload)
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise

    def _trim(self) -> None:
        """Delete the least recently used files past the capacity (the lock held)."""
        while self.num_bytes > self.capacity_bytes and self._index:
            block_hash, size = self._index.popitem(last=False)
            self.num_bytes -= size
            self.evictions += 1
            self._path(block_hash).unlink(missing_ok=True)

    def _turn_off(self, exc: OSError) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self._index.clear()
            self.num_bytes = 0
        logger.warning("KV cache folder %s cannot be written (%s); the disk tier is off from now on, "
                       "serving goes on without it", self.folder, exc)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (or given up); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._pending.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self._writer is not None:
            self._pending.put(None)
            self._writer.join()
            self._writer = None
