"""Stored Responses in a SQLite file (`--response-store PATH`): they outlive the server and its worker.

One connection in WAL mode, behind a lock, serves every request; other processes may open the same
file (SQLite locks it for them). Each operation touches a few rows by key or by the index of last
use, so it is short enough to run on the event loop. Committed records survive the server being
killed: WAL with synchronous=NORMAL loses nothing but the last commits on a power cut.

A file that is not a database, fails SQLite's quick check, or belongs to another program (or to
another version of this schema) is moved aside, renamed with an `.aside-<time>` suffix, with a
warning, and a fresh store started. A full disk turns storing off, with a warning: the reply that
could not be stored still reaches its client, retrieval and deletion go on working, and later
`store: true` requests get a 503 (StoreUnavailable) until a restart.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ember.server.response_store import StoreCapacityExceeded, StoredResponse, StoreUnavailable, check_bounds

logger = logging.getLogger("ember.server")

APPLICATION_ID = 0x656D6272  # "embr" in the file's header: this file is ember's response store
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    used INTEGER NOT NULL,  -- order of last use: the lowest goes first
    size INTEGER NOT NULL,  -- bytes charged against the limit (record_size)
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    history TEXT NOT NULL
);
CREATE INDEX responses_by_use ON responses (used, size);
"""
_NEXT_USE = "(SELECT coalesce(max(used), 0) + 1 FROM responses)"


class NotAStore(Exception):
    """The file cannot serve as ember's response store; the message says why."""


class SqliteResponseStore:
    def __init__(self, path: str | os.PathLike, max_records: int = 1024, max_bytes: int = 256 << 20) -> None:
        check_bounds(max_records, max_bytes)
        self.path = Path(path)
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.connection = open_store_file(self.path)
        self._lock = threading.Lock()
        self._off: str | None = None  # why storing is off; None while it is on

    def __len__(self) -> int:
        with self._lock:
            return self.connection.execute("SELECT count(*) FROM responses").fetchone()[0]

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return int(self.connection.execute("SELECT total(size) FROM responses").fetchone()[0])

    def check_fits(self, size: int) -> None:
        if self._off is not None:
            raise StoreUnavailable(self._off)
        if size > self.max_bytes:
            raise StoreCapacityExceeded(size, self.max_bytes)

    def put(self, record: StoredResponse, tenant: str) -> list[str]:
        if record.size > self.max_bytes:
            raise StoreCapacityExceeded(record.size, self.max_bytes)
        row = (record.id, tenant, record.size, _json(record.response), _json(record.input_items),
               _json(record.history))
        with self._lock:
            if self._off is not None:
                return []
            try:
                with self._transaction() as db:
                    db.execute("DELETE FROM responses WHERE id = ?", (record.id,))
                    evicted = self._make_room(db, record.size)
                    db.execute(f"INSERT INTO responses VALUES (?, ?, {_NEXT_USE}, ?, ?, ?, ?)", row)
            except (sqlite3.OperationalError, OSError) as exc:
                if not _disk_full(exc):
                    raise
                self._turn_off(exc)
                return []
        return evicted

    def _make_room(self, db: sqlite3.Connection, size: int) -> list[str]:
        """Delete the least recently used records until one of `size` bytes fits; their ids."""
        count, total = db.execute("SELECT count(*), total(size) FROM responses").fetchone()
        victims = []
        if count >= self.max_records or total + size > self.max_bytes:
            oldest_first = db.execute("SELECT rowid, id, size FROM responses ORDER BY used")
            for rowid, response_id, victim_size in oldest_first:
                if count < self.max_records and total + size <= self.max_bytes:
                    break
                victims.append((rowid, response_id))
                count, total = count - 1, total - victim_size
            oldest_first.close()
            db.executemany("DELETE FROM responses WHERE rowid = ?", [(rowid,) for rowid, _ in victims])
        return [response_id for _, response_id in victims]

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        with self._lock:
            row = self.connection.execute(
                "SELECT response, input_items, history, size FROM responses WHERE id = ? AND tenant = ?",
                (response_id, tenant)).fetchone()
            if row is None:
                return None
            try:
                self.connection.execute(f"UPDATE responses SET used = {_NEXT_USE} WHERE id = ?", (response_id,))
            except (sqlite3.OperationalError, OSError) as exc:
                if not _disk_full(exc):
                    raise
                self._turn_off(exc)  # the record is still read; only its place in the order is not kept
        response, input_items, history, size = row
        return StoredResponse(json.loads(response), tuple(json.loads(input_items)), tuple(json.loads(history)), size)

    def delete(self, response_id: str, tenant: str) -> bool:
        with self._lock:
            cursor = self.connection.execute("DELETE FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant))
            return cursor.rowcount > 0

    def ids(self) -> list[str]:
        with self._lock:
            return [row[0] for row in self.connection.execute("SELECT id FROM responses ORDER BY used")]

    def close(self) -> None:
        with self._lock:
            self.connection.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self.connection
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            if db.in_transaction:  # SQLite rolls back by itself after some errors (a full disk)
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _turn_off(self, exc: BaseException) -> None:
        if self._off is None:
            self._off = f"its disk is full ({self.path})"
            logger.warning("the response store %s is full (%s): storing is off until the server restarts; "
                           "replies still reach their clients, and store: true requests get a 503", self.path, exc)


def open_store_file(path: Path) -> sqlite3.Connection:
    """A connection to the store at `path`, made fresh when the file is missing, and moved aside
    (then made fresh) when it is not a usable store."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _connect(path)
    except (sqlite3.DatabaseError, NotAStore) as exc:
        aside = move_aside(path)
        logger.warning("the response store %s could not be used (%s): moved it to %s and started a fresh one",
                       path, exc, aside)
    return _connect(path)


def _connect(path: Path) -> sqlite3.Connection:
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # conversations: for this user alone
    db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("BEGIN IMMEDIATE")  # two servers starting on one new file create it once
        try:
            _check_or_create(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        verdict = db.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise NotAStore(f"SQLite's quick check says: {verdict}")
    except BaseException:
        db.close()
        raise
    return db


def _check_or_create(db: sqlite3.Connection) -> None:
    application_id = db.execute("PRAGMA application_id").fetchone()[0]
    version = db.execute("PRAGMA user_version").fetchone()[0]
    tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    if application_id == 0 and tables == 0:
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    elif application_id != APPLICATION_ID:
        raise NotAStore("it is another program's database")
    elif version != SCHEMA_VERSION:
        raise NotAStore(f"its schema is version {version}, and this ember reads version {SCHEMA_VERSION}")


def move_aside(path: Path) -> Path:
    """Rename the store file and its WAL files with an `.aside-<time>` suffix; the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.aside-{stamp}")
    number = 1
    while aside.exists():
        number += 1
        aside = path.with_name(f"{path.name}.aside-{stamp}-{number}")
    for suffix in ("", "-wal", "-shm"):
        companion = Path(f"{path}{suffix}")
        if companion.exists():
            companion.rename(f"{aside}{suffix}")
    return aside


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC
    return getattr(exc, "sqlite_errorname", None) == "SQLITE_FULL" or "database or disk is full" in str(exc)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
