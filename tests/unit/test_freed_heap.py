"""The heap's freed pages go back to the system when asked (the engine after loading, the server
after unloading a model)."""

import os
import platform

import pytest

from ember.freed_heap import release_freed_heap


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap")
def test_freed_heap_pages_go_back_to_the_system():
    pieces = [bytearray(65536) for _ in range(3000)]  # 64 KiB each, zeroed, from the heap: about 190 MiB
    # a live block above them (of their size: no hole below fits it), so free() alone cannot shrink the heap
    keep = bytearray(65536)
    del pieces
    before = _resident_bytes()
    assert release_freed_heap()
    assert before - _resident_bytes() > 100 * 2**20
    assert len(keep) == 65536
