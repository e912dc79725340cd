"""API keys with tenants (ember.server.keys) and each tenant's share of admission."""

from __future__ import annotations

import asyncio

import pytest

from ember.protocols.errors import ServerOverloaded
from ember.server.admission import Admission
from ember.server.keys import DEFAULT_TENANT, KeyFileError, KeyRing, read_key_file


def test_a_key_file_names_tenants_and_skips_comments(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha: key-a1\n\nalpha: key-a2\nbeta:key-b\nlonely-key\n")
    assert read_key_file(str(path)) == {b"key-a1": "alpha", b"key-a2": "alpha", b"key-b": "beta",
                                        b"lonely-key": DEFAULT_TENANT}


@pytest.mark.parametrize("text, words", [
    ("alpha: two words\n", "line 1"), (": key\n", "line 1"), ("a: k\nb: k\n", "line 2: this key is listed twice"),
    ("# nothing\n\n", "holds no key"),
])
def test_a_bad_key_file_is_refused_with_its_line(tmp_path, text, words):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=words):
        read_key_file(str(path))
    with pytest.raises(KeyFileError, match="cannot read"):
        read_key_file(str(tmp_path / "missing"))


def test_the_tenant_of_an_offered_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alpha: key-a\nbeta: key-b\n")
    keys = KeyRing(api_key="single", key_file=str(path))
    assert keys.required
    assert keys.tenant_of(["key-b"]) == "beta" and keys.tenant_of(["single"]) == DEFAULT_TENANT
    assert keys.tenant_of(["wrong", "key-a"]) == "alpha"  # any offered key (bearer or x-api-key) may match
    assert keys.tenant_of(["key-"]) is None and keys.tenant_of([]) is None
    assert not KeyRing().required


def test_a_reload_swaps_the_keys_and_a_broken_file_keeps_them(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alpha: old\n")
    keys = KeyRing(key_file=str(path))
    told = []
    keys.listeners.append(told.append)
    path.write_text("alpha: new\ngamma: third\n")
    assert keys.reload() == 2
    assert keys.tenant_of(["old"]) is None and keys.tenant_of(["third"]) == "gamma"
    assert told == [["new", "third"]]
    path.write_text("broken line with spaces: a b\n")
    with pytest.raises(KeyFileError):
        keys.reload()
    assert keys.tenant_of(["new"]) == "alpha"  # unchanged


async def settle() -> None:
    for _ in range(10):  # wait_for and shield take a few turns of the loop to hand a grant over
        await asyncio.sleep(0)


def test_one_tenant_flooding_gets_its_own_429_and_never_starves_another():
    async def scenario():
        admission = Admission(capacity=1, max_pending=10, timeout=0, max_pending_per_tenant=3)
        running = await admission.acquire(tenant="alpha")
        flood = [asyncio.ensure_future(admission.acquire(tenant="alpha")) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(ServerOverloaded) as caught:
            await admission.acquire(tenant="alpha")
        assert caught.value.code == "tenant_overloaded" and "'alpha'" in caught.value.message
        assert caught.value.retry_after > 0
        other = asyncio.ensure_future(admission.acquire(tenant="beta"))  # arrives after the flood
        await asyncio.sleep(0)
        running.release()  # alpha still has 3 waiting; beta runs nothing: beta goes first
        await settle()
        assert admission.running_by_tenant == {"beta": 1}
        assert other.done() and not any(f.done() for f in flood)
        (await other).release()
        await settle()
        assert flood[0].done() and not flood[1].done()  # then alpha, in arrival order
        for future in flood:
            (await future).release()
            await settle()
        assert admission.in_use == 0 and admission.num_waiting == 0 and not admission.running_by_tenant

    asyncio.run(scenario())


def test_the_global_limit_still_holds_with_tenants():
    async def scenario():
        admission = Admission(capacity=1, max_pending=2, timeout=0, max_pending_per_tenant=5)
        held = await admission.acquire(tenant="a")
        waiting = [asyncio.ensure_future(admission.acquire(tenant=t)) for t in ("a", "b")]
        await asyncio.sleep(0)
        with pytest.raises(ServerOverloaded) as caught:
            await admission.acquire(tenant="c")
        assert caught.value.code == "server_overloaded"
        held.release()
        await settle()
        assert admission.running_by_tenant == {"b": 1}  # b's turn: a was served last
        (await waiting[1]).release()
        await settle()
        (await waiting[0]).release()
        assert admission.in_use == 0

    asyncio.run(scenario())
