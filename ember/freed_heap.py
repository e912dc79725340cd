"""The C heap's freed pages handed back to the system. glibc keeps the pages of freed allocations
mapped, in the arena of the thread that made them, so a process that has let go of a great deal
still shows it resident until it trims: the engine once its model is built (the file's tensors,
staged blocks and the packed weights' first home were freed), the server once it has unloaded a
model (its tokenizer and the tables built from it, made on a loading thread of their own). Free of
torch, so the server's process can call it without importing it."""

from __future__ import annotations

import ctypes
import ctypes.util


def release_freed_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim); False where the C
    library has no such call."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True
