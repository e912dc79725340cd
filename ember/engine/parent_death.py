"""A child process of the server (an engine worker, a tensor-parallel rank) that must not outlive it."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies, however it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # elsewhere the worker's idle poll notices the parent is gone
