"""`ember serve` started by a bench script: a subprocess on a free port (the URL read from the line it
prints when it listens), ready once /health answers 200, and stopped when the block ends. Its stderr
is drained so the pipe never fills; the last lines are kept to say why a server did not start."""

from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import httpx

_LISTENING = re.compile(r"listening on (http://\S+);")
_TAIL_LINES = 30


@contextlib.contextmanager
def serving(flags: Sequence[str], *, listen_timeout: float = 300, ready_timeout: float = 600,
            stop_timeout: float = 60) -> Iterator[tuple[subprocess.Popen, str]]:
    """`ember serve --port 0 FLAGS...` (a flag given again in FLAGS wins), as (process, base URL) once
    healthy; terminated when the block ends. SystemExit when it does not start or get healthy."""
    command = [sys.executable, "-m", "ember.cli", "serve", "--port", "0", *flags]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        yield proc, _wait_healthy(proc, listen_timeout, ready_timeout)
    finally:
        proc.terminate()
        proc.wait(stop_timeout)


def _wait_healthy(proc: subprocess.Popen, listen_timeout: float, ready_timeout: float) -> str:
    found: dict[str, str] = {}
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    listening = threading.Event()

    def drain() -> None:
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            match = _LISTENING.search(line)
            if match:
                found["url"] = match.group(1)
                listening.set()
        listening.set()

    threading.Thread(target=drain, daemon=True).start()
    listening.wait(listen_timeout)
    if "url" not in found:
        raise SystemExit("the server did not start:\n" + "\n".join(tail))
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(found["url"] + "/health", timeout=5).status_code == 200:
                return found["url"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server never became healthy:\n" + "\n".join(tail))
