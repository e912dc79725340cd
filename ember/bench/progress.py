"""A one-line progress bar on stderr, redrawn in place; silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ember.bench.records import RequestRecord

_WIDTH = 24
_REDRAW_EVERY_S = 0.1


class ProgressBar:
    def __init__(self, label: str, total: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.started = time.perf_counter()
        self.done = 0
        self.failed = 0
        self.output_tokens = 0
        self._drawn_at = 0.0

    @staticmethod
    def wanted(quiet: bool, stream: TextIO | None = None) -> bool:
        stream = stream or sys.stderr
        return not quiet and hasattr(stream, "isatty") and stream.isatty()

    def finished(self, record: RequestRecord) -> None:
        self.done += 1
        if record.ok:
            self.output_tokens += record.completion_tokens or 0
        else:
            self.failed += 1
        self.draw()

    def draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._drawn_at < _REDRAW_EVERY_S):
            return
        self._drawn_at = now
        elapsed = now - self.started
        filled = round(_WIDTH * self.done / self.total) if self.total else _WIDTH
        rate = self.output_tokens / elapsed if elapsed > 0 else 0.0
        line = (f"{self.label:>16} [{'#' * filled}{'.' * (_WIDTH - filled)}] {self.done}/{self.total}"
                f"  failed {self.failed}  {elapsed:6.1f} s  {rate:7.1f} out tok/s")
        self.stream.write("\r" + line + "\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
