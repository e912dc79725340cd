"""The loaded model's place in the host's memory.

- Huge pages: a decode step streams every weight of the model once. On 4 KiB pages that is a
  page walk per 4 KiB and a hardware prefetcher that stops at each page's end; on 2 MiB pages
  neither, and the block-quantized linear kernels run faster (bench/huge_pages.py measures it).
  The region is an anonymous mapping advised MADV_HUGEPAGE, so it works where transparent huge
  pages are `always` or `madvise` (most distributions' default) and costs nothing under `never`.

Loading also frees far more than it keeps; the engine hands those pages back once the model is in
place (ember.freed_heap), which takes a few hundred MB off the resident size of the default model.
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Sequence
from typing import Any

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line


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

