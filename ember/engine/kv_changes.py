"""The changes to a KV manager's set of cached block hashes, for a reader that keeps a copy of
that set (the data-parallel router, engine.router). Nothing is kept until a reader starts it."""

from __future__ import annotations

from collections.abc import Iterable


class CacheChangeFeed:
    def __init__(self) -> None:
        self._changes: dict[bytes, bool] | None = None  # hash -> cached now; None: not started
        self._cleared = False

    def start(self, cached_hashes: Iterable[bytes]) -> None:
        """Keep changes from now on; the first take() reports a clear and every hash cached now.
        Once started, a second call changes nothing."""
        if self._changes is None:
            self._cleared = True
            self._changes = dict.fromkeys(cached_hashes, True)

    def stored(self, block_hash: bytes) -> None:
        if self._changes is not None:
            self._changes[block_hash] = True

    def removed(self, block_hash: bytes) -> None:
        if self._changes is not None:
            self._changes[block_hash] = False

    def cleared(self) -> None:
        if self._changes is not None:
            self._changes.clear()
            self._cleared = True

    def take(self) -> tuple[bool, list[bytes], list[bytes]]:
        """(cleared, stored, removed) since the last call: a reader that empties its copy when
        `cleared`, then drops `removed` and adds `stored`, holds the manager's cached hashes."""
        changes, cleared = self._changes or {}, self._cleared
        self._changes, self._cleared = ({} if self._changes is not None else None), False
        return (cleared, [h for h, cached in changes.items() if cached],
                [h for h, cached in changes.items() if not cached])
