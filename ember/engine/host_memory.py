"""The loaded model's place in the host's memory, and its KV pool's.

- Huge pages: a decode step streams every weight of the model once, and its attention reads each
  sequence's keys and values. On 4 KiB pages that is a page walk per 4 KiB and a hardware
  prefetcher that stops at each page's end; on 2 MiB pages neither, and the block-quantized
  linear kernels and the attention kernel run faster (bench/huge_pages.py, bench/kv_pool_pages.py).
  A region is an anonymous mapping advised MADV_HUGEPAGE, so it works where transparent huge
  pages are `always` or `madvise` (most distributions' default) and costs nothing under `never`.
  Its pages read as zeros and become resident at their first write, 2 MiB at a time.

Loading also frees far more than it keeps; the engine hands those pages back once the model is in
place (ember.freed_heap), which takes a few hundred MB off the resident size of the default model.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14 on


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """A zeroed uint8 CPU tensor of nbytes that starts on a 2 MiB boundary, advised onto huge
    pages; None where the platform has no such advice. The tensor keeps its mapping alive."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not sys.platform.startswith("linux") or advice is None or nbytes <= 0:
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:
        region.close()
        return None
    buffer = torch.frombuffer(region, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    return buffer[start:start + nbytes]


def huge_page_tensor(shape: Sequence[int], dtype: torch.dtype, offset: int = 0) -> torch.Tensor | None:
    """A zeroed contiguous CPU tensor of `shape` and `dtype` on huge pages (huge_page_bytes),
    starting `offset` bytes past a huge page's start; None where they cannot be asked for."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = huge_page_bytes(offset + nbytes)
    return None if region is None else region[offset:].view(dtype).view(tuple(shape))


class ResidentPages:
    """Makes byte ranges of a tensor resident now (madvise's MADV_POPULATE_WRITE: each page faulted
    in as a write would, no byte changed), a range shared out in runs of whole huge pages between
    the calling thread and threads of its own, torch's thread count in all. The engine calls it
    between steps, while its own threads wait: a thread that did this beside the steps took a core
    from them (on 2 cores every step it overlapped waited), and a step's first write to a page
    holds every thread at the next barrier. A fresh huge page is a zeroed 2 MiB, and in a virtual
    machine whose host has not yet backed that memory it costs far more than the zeroing (on the
    2-core Xeon guest here 2.5 ms a MiB on one thread, 0.1-0.2 ms once touched:
    bench/page_first_touch.py). The calls run outside the GIL (ctypes). Where the kernel refuses the
    advice (before Linux 5.14), it stops asking: first writes then fault their pages in themselves."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._helpers: ThreadPoolExecutor | None = None
        self.refused = False

    def populate(self, start: int, nbytes: int) -> None:
        """Bytes [start, start + nbytes) of the tensor, widened to whole pages; returns when they
        are resident."""
        if self.refused:
            return
        first = (self._tensor.data_ptr() + start) // _PAGE * _PAGE
        end = self._tensor.data_ptr() + min(start + nbytes, self._tensor.numel() * self._tensor.element_size())
        if first >= end:
            return
        # runs of whole huge pages (no page faulted by two threads), one a thread
        first_page, pages = first // HUGE_PAGE, -(-end // HUGE_PAGE) - first // HUGE_PAGE
        per_thread = -(-pages // max(1, min(torch.get_num_threads(), pages)))
        cuts = [first, *((first_page + i) * HUGE_PAGE for i in range(per_thread, pages, per_thread)), end]
        runs = list(zip(cuts, cuts[1:]))
        helped = []
        if len(runs) > 1:
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads() - 1),
                                                   thread_name_prefix="ember-pages")
            helped = [self._helpers.submit(self._advise, *span) for span in runs[1:]]
        self._advise(*runs[0])
        for future in helped:
            future.result()

    def _advise(self, first: int, end: int) -> None:
        if first < end and self._madvise(first, end - first, _MADV_POPULATE_WRITE) != 0:
            self.refused = True


def move_to_huge_pages(owners: Sequence[Any], attribute: str) -> bool:
    """Move each owner's contiguous CPU tensor `attribute` into one huge-page region, side by
    side, one at a time (the old copy is freed as its place is taken, so memory peaks at the
    region plus one tensor). The values, shapes and dtypes stay; False (nothing moved) where
    huge pages cannot be asked for."""
    tensors = [getattr(owner, attribute) for owner in owners]
    if not tensors or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    sizes = [t.numel() * t.element_size() for t in tensors]
    del tensors  # each old tensor must be freed as soon as its owner holds the copy
    region = huge_page_bytes(sum(map(_aligned, sizes)))
    if region is None:
        return False
    offset = 0
    for owner, size in zip(owners, sizes):
        tensor = getattr(owner, attribute)
        moved = region[offset:offset + size].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor)
        setattr(owner, attribute, moved)
        offset += _aligned(size)
    return True

