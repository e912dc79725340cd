"""Stored Responses: the store interface the Responses routes use, and its in-memory form.

Each record holds its whole conversation (the parent's items, this request's input items, its
output items), so a continuation never needs its ancestors: deleting or evicting a parent leaves
its descendants working. Each record is charged the JSON size of everything it holds; the store
keeps at most `max_records` records and `max_bytes` of them, least recently used first out.

A record belongs to the tenant that stored it: asked with another tenant's name, a store answers
as if the record did not exist. `sqlite_response_store` keeps records on disk across restarts.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from ember.errors import EmberError, InvalidRequest


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as GET returns it
    input_items: tuple[dict[str, Any], ...]  # this request's normalized input items
    history: tuple[dict[str, Any], ...]  # the conversation a continuation starts from (no instructions)
    size: int  # bytes charged against the store's limit

    @property
    def id(self) -> str:
        return self.response["id"]


def record_size(response: dict[str, Any], history: tuple[dict[str, Any], ...]) -> int:
    """The JSON size of the response and of the conversation it holds (input items are part of it)."""
    return len(json.dumps(response, ensure_ascii=False)) + sum(len(json.dumps(item, ensure_ascii=False))
                                                               for item in history)


class StoreCapacityExceeded(InvalidRequest):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"This response and its conversation take {size / (1 << 20):.1f} MiB, more than the "
                         f"whole response store holds ({limit / (1 << 20):g} MiB, --response-store-max-mb); "
                         "send it with store: false, or start a shorter conversation.",
                         param="store", code="response_store_capacity_exceeded")


class StoreUnavailable(EmberError):
    """Storing was turned off while the server runs (its disk filled up); reading still works."""

    status = 503
    type = "server_error"

    def __init__(self, reason: str) -> None:
        super().__init__(f"The response store cannot take new responses: {reason}. Send the request with "
                         "store: false, or free disk space and restart the server.",
                         param="store", code="response_store_unavailable")


class ResponseStore(Protocol):
    max_records: int
    max_bytes: int

    def __len__(self) -> int: ...

    @property
    def num_bytes(self) -> int: ...

    def check_fits(self, size: int) -> None:
        """Refuse, before any work, a request whose record could not be stored: StoreCapacityExceeded
        (400) when `size` bytes exceed the whole store, StoreUnavailable (503) when storing is off."""

    def put(self, record: StoredResponse, tenant: str) -> list[str]:
        """Store (or replace) a record as the most recently used; returns the ids evicted for room.
        A store that cannot write any more turns storing off and keeps the reply going (no raise)."""

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The tenant's record, now the most recently used; None when unknown, another tenant's,
        deleted or evicted."""

    def delete(self, response_id: str, tenant: str) -> bool: ...

    def ids(self) -> list[str]:
        """Every tenant's, oldest use first (the next to be evicted first)."""

    def close(self) -> None: ...


def check_bounds(max_records: int, max_bytes: int) -> None:
    if max_records < 1:
        raise ValueError(f"the response store needs room for at least one record, got {max_records}")
    if max_bytes < 1:
        raise ValueError("the response store's size limit must be positive")


class MemoryResponseStore:
    """This process's memory (`--response-store memory`): a restart forgets every record. The
    items are shared between records, not copied, so charging each record all it holds keeps the
    real memory under the bound."""

    def __init__(self, max_records: int = 1024, max_bytes: int = 256 << 20) -> None:
        check_bounds(max_records, max_bytes)
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, tuple[str, StoredResponse]] = OrderedDict()  # id -> (tenant, record)
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def check_fits(self, size: int) -> None:
        if size > self.max_bytes:
            raise StoreCapacityExceeded(size, self.max_bytes)

    def put(self, record: StoredResponse, tenant: str) -> list[str]:
        self.check_fits(record.size)
        evicted = []
        with self._lock:
            old = self._records.pop(record.id, None)
            if old is not None:
                self._bytes -= old[1].size
            while self._records and (len(self._records) >= self.max_records
                                     or self._bytes + record.size > self.max_bytes):
                victim_id, (_, victim) = self._records.popitem(last=False)
                self._bytes -= victim.size
                evicted.append(victim_id)
            self._records[record.id] = (tenant, record)
            self._bytes += record.size
        return evicted

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        with self._lock:
            entry = self._records.get(response_id)
            if entry is None or entry[0] != tenant:
                return None
            self._records.move_to_end(response_id)
            return entry[1]

    def delete(self, response_id: str, tenant: str) -> bool:
        with self._lock:
            entry = self._records.get(response_id)
            if entry is None or entry[0] != tenant:
                return False
            del self._records[response_id]
            self._bytes -= entry[1].size
            return True

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def close(self) -> None:
        pass
