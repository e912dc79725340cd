"""The Responses stores: least recently used out by count and bytes, tenants kept apart, and (SQLite)
records kept across reopening, a bad file moved aside, a full disk turning storing off."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from ember.errors import EmberError, InvalidRequest
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.neutral import ModelInfo
from ember.protocols.openai_responses import parse_responses
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.server.response_store import MemoryResponseStore, StoredResponse, StoreUnavailable
from ember.server.responses_routes import make_context
from ember.server.sqlite_response_store import APPLICATION_ID, SqliteResponseStore

A, B = "alpha", "beta"
MODEL = ModelInfo(name="served", max_model_len=512, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))
SEAL = ReasoningSeal(b"k" * 32)


def record(response_id: str, size: int = 10, text: str = "") -> StoredResponse:
    item = {"id": f"msg_{response_id}", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text or f"hello {response_id}"}]}
    return StoredResponse({"id": response_id, "object": "response"}, (item,), (item,), size)


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    stores = []

    def make(max_records: int = 1024, max_bytes: int = 256 << 20):
        store = (MemoryResponseStore(max_records, max_bytes) if request.param == "memory"
                 else SqliteResponseStore(tmp_path / "responses.db", max_records, max_bytes))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_the_least_recently_used_go_first_by_count_and_by_size(make_store):
    store = make_store(max_records=3, max_bytes=100)
    for name in "abc":
        assert store.put(record(name), A) == []
    assert store.get("a", A) is not None  # a is now the most recently used
    assert store.put(record("d"), A) == ["b"]
    assert store.ids() == ["c", "a", "d"]
    assert store.put(record("e", 85), A) == ["c", "a"]  # room for 85 bytes: 10 + 85 <= 100
    assert store.ids() == ["d", "e"] and store.num_bytes == 95 and len(store) == 2
    assert store.delete("d", A) and not store.delete("d", A) and store.get("d", A) is None
    with pytest.raises(InvalidRequest) as caught:
        store.put(record("huge", 101), A)
    assert caught.value.code == "response_store_capacity_exceeded" and store.ids() == ["e"]
    with pytest.raises(InvalidRequest):
        store.check_fits(101)
    store.check_fits(100)


def test_a_record_comes_back_as_it_was_stored(make_store):
    store = make_store()
    stored = record("r", text="naïve café ✓")
    store.put(stored, A)
    assert store.get("r", A) == stored
    store.put(record("r", size=20), A)  # the same id again replaces it
    assert store.get("r", A).size == 20 and len(store) == 1


def test_a_tenant_sees_only_its_own_records(make_store):
    store = make_store()
    store.put(record("mine"), A)
    assert store.get("mine", B) is None
    assert not store.delete("mine", B)
    assert store.get("mine", A) is not None and store.delete("mine", A)


def test_a_tenants_requests_continue_only_its_own_responses(make_store):
    store = make_store()
    alpha, beta = make_context(store, SEAL, A), make_context(store, SEAL, B)
    first = parse_responses({"input": "Hi"}, MODEL, alpha)
    alpha.save({"id": "resp_1", **first.spec.echo}, first.spec, tuple(first.spec.input_items))
    assert parse_responses({"input": "More", "previous_response_id": "resp_1"}, MODEL, alpha).spec.history
    with pytest.raises(InvalidRequest) as caught:
        parse_responses({"input": "More", "previous_response_id": "resp_1"}, MODEL, beta)
    assert (caught.value.status, caught.value.code) == (404, "previous_response_not_found")


def test_concurrent_writers_and_readers_keep_the_bounds(make_store):
    store = make_store(max_records=20, max_bytes=10_000)
    errors = []

    def work(worker: int) -> None:
        try:
            for n in range(40):
                store.put(record(f"w{worker}-{n}"), A)
                store.get(f"w{worker}-{n // 2}", A)
        except Exception as exc:  # reported below, with the thread's name
            errors.append((worker, exc))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(store) == 20 and store.num_bytes == 200 and len(set(store.ids())) == 20


# ---- SQLite only ---------------------------------------------------------------------------------


def test_records_outlive_the_store_that_wrote_them(tmp_path):
    path = tmp_path / "state" / "responses.db"  # its folder is made too
    first = SqliteResponseStore(path, max_records=2)
    for name in "abc":
        first.put(record(name), A)
    first.get("b", A)
    first.close()
    again = SqliteResponseStore(path, max_records=2)
    assert again.ids() == ["c", "b"]  # the order of use is kept as well
    assert again.get("b", A) == record("b") and again.get("b", B) is None
    assert again.put(record("d"), A) == ["c"]
    again.close()


def test_two_stores_on_one_file_see_each_others_records(tmp_path):
    one, two = (SqliteResponseStore(tmp_path / "responses.db") for _ in range(2))
    one.put(record("r"), A)
    assert two.get("r", A) == record("r") and two.delete("r", A)
    assert one.get("r", A) is None
    one.close()
    two.close()


def test_a_file_that_is_not_a_database_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "responses.db"
    path.write_bytes(b"this is not a database, just some words " * 200)
    store = SqliteResponseStore(path)
    store.put(record("r"), A)
    assert store.get("r", A) == record("r")
    store.close()
    [aside] = tmp_path.glob("responses.db.aside-*")
    assert aside.read_bytes().startswith(b"this is not a database")
    assert "moved it to" in caplog.text and str(aside) in caplog.text


def test_another_programs_database_is_moved_aside_untouched(tmp_path, caplog):
    path = tmp_path / "responses.db"
    foreign = sqlite3.connect(path)
    foreign.execute("CREATE TABLE notes (body TEXT)")
    foreign.execute("INSERT INTO notes VALUES ('keep me')")
    foreign.commit()
    foreign.close()
    SqliteResponseStore(path).close()
    [aside] = tmp_path.glob("responses.db.aside-*")
    kept = sqlite3.connect(aside)
    assert kept.execute("SELECT body FROM notes").fetchall() == [("keep me",)]
    kept.close()
    assert "another program's database" in caplog.text
    fresh = sqlite3.connect(path)
    assert fresh.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    fresh.close()


def test_a_store_of_another_schema_version_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "responses.db"
    SqliteResponseStore(path).close()
    newer = sqlite3.connect(path)
    newer.execute("PRAGMA user_version = 99")
    newer.close()
    SqliteResponseStore(path).close()
    assert len(list(tmp_path.glob("responses.db.aside-*"))) == 1 and "version 99" in caplog.text


def test_a_damaged_database_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "responses.db"
    store = SqliteResponseStore(path)
    for n in range(200):
        store.put(record(f"r{n}", text="x" * 500), A)
    store.close()
    data = bytearray(path.read_bytes())
    page_size = int.from_bytes(data[16:18], "big")
    data[page_size * 2:page_size * 6] = b"\xff" * (page_size * 4)  # pages of the table and its index
    path.write_bytes(bytes(data))
    fresh = SqliteResponseStore(path)
    assert len(fresh) == 0
    fresh.close()
    assert len(list(tmp_path.glob("responses.db.aside-*"))) == 1 and "could not be used" in caplog.text


def test_a_full_disk_turns_storing_off_and_keeps_what_was_stored(tmp_path, caplog):
    store = SqliteResponseStore(tmp_path / "responses.db")
    store.put(record("kept"), A)
    pages = store.connection.execute("PRAGMA page_count").fetchone()[0]
    store.connection.execute(f"PRAGMA max_page_count = {pages}")  # the file may not grow: a real SQLITE_FULL
    assert store.put(record("big", text="y" * 100_000), A) == []  # the reply goes on; nothing raised
    assert "storing is off" in caplog.text
    with pytest.raises(StoreUnavailable) as caught:
        store.check_fits(10)
    error: EmberError = caught.value
    assert (error.status, error.param, error.code) == (503, "store", "response_store_unavailable")
    assert "disk is full" in error.message
    assert store.put(record("later"), A) == [] and store.ids() == ["kept"]
    context = make_context(store, SEAL, A)
    with pytest.raises(StoreUnavailable):  # refused before any work
        parse_responses({"input": "Hi"}, MODEL, context)
    assert not parse_responses({"input": "Hi", "store": False}, MODEL, context).spec.store
    assert store.get("kept", A) == record("kept") and store.delete("kept", A)
    store.close()


def test_the_file_is_for_its_owner_alone(tmp_path):
    path = tmp_path / "responses.db"
    SqliteResponseStore(path).close()
    assert path.stat().st_mode & 0o077 == 0
