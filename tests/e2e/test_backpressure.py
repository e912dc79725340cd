"""Backpressure under a real `ember serve`: a stream whose client reads far slower than the server
writes (a raw socket with a 4 KiB receive buffer, emptied twice a second) fills the connection's
buffers, and then
its request is paused in the engine: it keeps its blocks, takes no step, and generates nothing
while a reading client's stream runs to its end. When the stalled client leaves, its blocks return.
Counts are asserted, never speeds."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx

from conftest import wait_idle

STALLED = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 900,
           "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}  # big frames fill buffers fast


class StalledReader:
    """A streaming request on a socket whose owner takes 4 KiB twice a second: the server's writes
    block once its buffers are full, while the window keeps opening (a reader that took nothing at
    all would meet the server's 15 s TCP_USER_TIMEOUT, which ends a connection whose window stays
    shut, before a slow machine had filled the buffers)."""

    def __init__(self, url: str, model: str) -> None:
        parsed = urlparse(url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((parsed.hostname, parsed.port))
        body = json.dumps({**STALLED, "model": model}).encode()
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.sock.recv(4096)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(5)


def engine_stats(http: httpx.Client) -> dict:
    return http.get("/health").json()["engine"]


def test_a_reader_that_stops_is_paused_while_another_stream_runs(http, client, model_id):
    wait_idle(http)
    stalled = StalledReader(str(http.base_url), model_id)
    try:
        deadline = time.monotonic() + 300
        while engine_stats(http)["num_paused"] != 1:
            assert time.monotonic() < deadline, f"the stalled stream was never paused: {engine_stats(http)}"
            time.sleep(0.2)
        before = engine_stats(http)
        assert before["num_running"] == 1 and before["kv_blocks_used"] > 0  # paused, its blocks kept
        reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi."}],
                                               max_tokens=48, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
        assert sum(1 for chunk in reply if chunk.choices and chunk.choices[0].delta.content is not None) > 0
        after = engine_stats(http)
        # every token generated meanwhile was the reader's: the paused request took no step
        assert after["generation_tokens"] - before["generation_tokens"] == 48
        assert after["num_paused"] == 1 and after["kv_blocks_used"] == before["kv_blocks_used"]
    finally:
        stalled.close()
    wait_idle(http)  # the stalled client left: its request ended and its blocks came back
