"""A child process of the server (an engine worker, a tensor-parallel rank) that must not outlive it."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
PARENT_PID = "EMBER_PARENT_PID"  # the spawner's pid, in the child's environment


def child_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a child that calls die_with_parent: it names this
    process, so the child can tell that its parent died before it could ask to follow it."""
    return {**(os.environ if env is None else env), PARENT_PID: str(os.getpid())}


def die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies, however it dies. A
    parent that died first (while this child still imported its modules) sends nothing, and the
    child, adopted by another process, would wait forever for settings: it exits at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # elsewhere the worker's idle poll notices the parent is gone
    spawner = os.environ.get(PARENT_PID)
    if spawner is not None and os.getppid() != int(spawner):
        os._exit(1)
