"""Stored Responses: in this process's memory, least recently used first out, bounded in count and size.

Each record holds its whole conversation (the parent's items, this request's input items, its
output items), so a continuation never needs its ancestors: deleting or evicting a parent leaves
its descendants working. The items themselves are shared between records, not copied; each record
is charged the JSON size of everything it holds, which over-counts what is shared and so keeps the
real memory under the bound.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequest


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


class ResponseStore:
    def __init__(self, max_records: int = 1024, max_bytes: int = 256 << 20) -> None:
        if max_records < 1:
            raise ValueError(f"the response store needs room for at least one record, got {max_records}")
        if max_bytes < 1:
            raise ValueError("the response store's size limit must be positive")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest use first
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

    def put(self, record: StoredResponse) -> list[str]:
        """Store (or replace) a record as the most recently used; returns the ids evicted for room."""
        self.check_fits(record.size)
        evicted = []
        with self._lock:
            old = self._records.pop(record.id, None)
            if old is not None:
                self._bytes -= old.size
            while self._records and (len(self._records) >= self.max_records
                                     or self._bytes + record.size > self.max_bytes):
                victim_id, victim = self._records.popitem(last=False)
                self._bytes -= victim.size
                evicted.append(victim_id)
            self._records[record.id] = record
            self._bytes += record.size
        return evicted

    def get(self, response_id: str) -> StoredResponse | None:
        """The record, now the most recently used; None when unknown, deleted or evicted."""
        with self._lock:
            record = self._records.get(response_id)
            if record is not None:
                self._records.move_to_end(response_id)
            return record

    def delete(self, response_id: str) -> bool:
        with self._lock:
            record = self._records.pop(response_id, None)
            if record is None:
                return False
            self._bytes -= record.size
            return True

    def ids(self) -> list[str]:
        """Oldest use first (the next to be evicted first)."""
        with self._lock:
            return list(self._records)
