"""Stored Responses on disk under a real `ember serve` with two tenants: a file that is not a store is
moved aside at start, a tenant never reaches another's responses, and a chain lives through a
worker restart and through the server being killed outright. After SIGKILL of the server its worker
is gone at once, no socket file is left, and a new server starts on the same port and store file.
The last test replaces this module's server with that new one."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import openai
import psutil
import pytest

from conftest import START_TIMEOUT_S, ServerProcess

ALPHA, BETA = "alpha-key-0001", "beta-key-0002"
NOT_A_STORE = b"these bytes are no SQLite database " * 64
MODEL = "SmolLM2-135M-Instruct"  # the default model's id


class Durable:
    """This module's server, which the last test kills and starts again on the same port and file."""

    def __init__(self, folder) -> None:
        self.store = folder / "responses.db"
        self.store.write_bytes(NOT_A_STORE)
        keys = folder / "keys"
        keys.write_text(f"alpha: {ALPHA}\nbeta: {BETA}\n")
        with socket.socket() as probe:  # a fixed port, so the restart can ask for the same one
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.flags = ("--response-store", str(self.store), "--api-key-file", str(keys), "--max-model-len", "512",
                      "--max-num-seqs", "4")
        self.server = self.start()

    def start(self) -> ServerProcess:
        return ServerProcess(*self.flags, port=self.port).start()

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def health(self) -> dict:
        return httpx.get(self.server.url + "/health", headers={"x-api-key": ALPHA}, timeout=30).json()


@pytest.fixture(scope="module")
def durable(tmp_path_factory):
    state = Durable(tmp_path_factory.mktemp("durable"))
    yield state
    state.server.stop()


def create(client: openai.OpenAI, text: str, **fields):
    return client.responses.create(model=MODEL, input=text, max_output_tokens=6, temperature=0, **fields)


def still_running(processes: list[psutil.Process]) -> list[int]:
    running = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:  # a zombie holds no port, socket or memory
                running.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    return running


def test_a_file_that_is_not_a_store_was_moved_aside_at_start(durable):
    [aside] = durable.store.parent.glob("responses.db.aside-*")
    assert aside.read_bytes() == NOT_A_STORE
    assert any("moved it to" in line and str(aside) in line for line in durable.server.lines)
    alpha = durable.client(ALPHA)
    reply = create(alpha, "Hello.")
    assert alpha.responses.retrieve(reply.id).output == reply.output  # the fresh store works


def test_a_tenant_never_reaches_another_tenants_responses(durable):
    alpha, beta = durable.client(ALPHA), durable.client(BETA)
    mine = create(alpha, "Name a colour.")
    for reach in (lambda: beta.responses.retrieve(mine.id), lambda: beta.responses.delete(mine.id),
                  lambda: beta.responses.input_items.list(mine.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            reach()
        assert caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        create(beta, "And another?", previous_response_id=mine.id)
    assert caught.value.body["code"] == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):  # as for a response that never existed
        create(beta, "And another?", previous_response_id="resp_never")
    counted = httpx.post(durable.server.url + "/v1/responses/input_tokens", headers={"x-api-key": BETA},
                         json={"input": "More.", "previous_response_id": mine.id}, timeout=60)
    assert counted.status_code == 404
    assert alpha.responses.retrieve(mine.id).id == mine.id  # still there for its owner
    assert create(alpha, "And another?", previous_response_id=mine.id).previous_response_id == mine.id


def continues(client: openai.OpenAI, first) -> None:
    """A continuation of `first` is built on its whole conversation."""
    second = create(client, "Name another one.", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_chain_lives_through_a_worker_restart(durable):
    alpha = durable.client(ALPHA)
    first = create(alpha, "Name a fruit.")
    before = durable.health()
    os.kill(before["worker_pid"], signal.SIGKILL)
    deadline = time.monotonic() + START_TIMEOUT_S  # a restart loads the model again: as long as a start
    after = durable.health()
    while after["status"] != "ok" or after["worker_pid"] in (None, before["worker_pid"]):
        assert time.monotonic() < deadline, f"the worker did not come back: {after}"
        time.sleep(0.2)
        after = durable.health()
    assert after["worker_restarts"] == before["worker_restarts"] + 1
    continues(alpha, first)


def test_killing_the_server_leaves_nothing_behind_and_the_chain_lives_on(durable):
    first = create(durable.client(ALPHA), "Name a river.")
    front = psutil.Process(durable.server.proc.pid)
    children = front.children(recursive=True)
    assert durable.health()["worker_pid"] in [child.pid for child in children]
    bound = [c.laddr for c in front.net_connections("unix") if c.laddr]
    assert any("ember-engine" in name for name in bound)  # the worker's sockets
    assert [name for name in bound if not name.startswith(("@", "\0"))] == []  # abstract: no file to leave
    durable.server.proc.kill()
    durable.server.proc.wait()
    deadline = time.monotonic() + 2  # the bound: the kernel kills them with their parent
    while still_running(children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert still_running(children) == []
    durable.server = durable.start()  # at once, on the same port and file
    assert durable.server.port == durable.port
    alpha = durable.client(ALPHA)
    assert alpha.responses.retrieve(first.id).id == first.id
    continues(alpha, first)
    with pytest.raises(openai.NotFoundError):
        durable.client(BETA).responses.retrieve(first.id)
