"""The structured request log (`--request-log FILE`): one JSON object per line, appended and
flushed per event. It holds counts, settings and times, never prompt or output text, never a key."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, TextIO

logger = logging.getLogger("ember.server")

REDACTED = "<redacted>"


class RequestLogError(Exception):
    """The log file cannot be opened; the message is meant for the user."""


class RequestLog:
    """Writes events to an open text file. Every event carries `event`, `time_unix_ms` and the
    `server_instance_id` that tells one server run from another in a shared file."""

    def __init__(self, stream: TextIO, path: str | None = None) -> None:
        self.stream = stream
        self.path = path
        self.server_instance_id = uuid.uuid4().hex
        self._hidden: list[str] = []  # JSON-escaped texts never written, whatever field carries them
        self._lock = threading.Lock()
        self._failed = False

    @classmethod
    def open(cls, path: str) -> "RequestLog":
        try:
            stream = open(path, "a", encoding="utf-8")
        except OSError as exc:
            raise RequestLogError(f"cannot open the request log {path}: {exc.strerror or exc}") from None
        return cls(stream, path)

    def hide(self, secret: str) -> None:
        """Never write `secret` (the API key), even where a client copied it into a field."""
        if secret:
            self._hidden.append(json.dumps(secret)[1:-1])

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time_unix_ms": round(time.time() * 1000, 3),
                  "server_instance_id": self.server_instance_id, **fields}
        line = json.dumps(record, separators=(",", ":"), allow_nan=False, default=str) + "\n"
        for secret in self._hidden:
            line = line.replace(secret, REDACTED)
        with self._lock:
            try:
                self.stream.write(line)
                self.stream.flush()
            except (OSError, ValueError) as exc:  # a full disk or a closed file must not stop serving
                if not self._failed:
                    self._failed = True
                    logger.warning("the request log %s cannot be written: %s", self.path or "", exc)

    def close(self) -> None:
        with self._lock:
            try:
                self.stream.close()
            except OSError:
                pass
