"""Tensor parallel across two "nodes" on loopback: two launches of `ember serve --nnodes 2`, node 0
serving HTTP and rank 0, node 1 running rank 1 only. On the default model as it comes (4-bit
blocks, bfloat16) they give one process's tokens, bit for bit (the token_sha of each reply); a
rank that dies takes the group down, node 1 exits, and once node 1 is launched again the group
serves again; when node 0 stops, node 1 exits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import httpx
import openai
import pytest
from conftest import ServerProcess, serve_command

FLAGS = ["--max-model-len", "512"]
PROMPTS = ["The capital of France is", "def add(a, b):", "Three colors of the rainbow are", "Dogs and cats"]
MODEL = "SmolLM2-135M-Instruct"
DEADLINE_S = 300  # liveness only: how long a launch may take to load or to notice the group is down


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def completions(server: ServerProcess) -> list[tuple[str, str]]:
    """(text, token_sha) of a greedy completion of each prompt."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    replies = []
    for prompt in PROMPTS:
        choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0]
        replies.append((choice.text, choice.model_extra["token_sha"]))
    return replies


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def one_rank():
    server = ServerProcess(*FLAGS).start()
    try:
        yield completions(server)
    finally:
        server.stop()


def test_two_nodes_on_loopback(one_rank):
    address = f"127.0.0.1:{free_port()}"
    # each launch's rank takes a launch's cores, as on a machine of its own; here both share this
    # one's, so each computes with one thread (two ranks of two spinning threads on two cores
    # crawled at half a second a token)
    parallel = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", address, "--threads", "1"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}

    def launch_node_1() -> subprocess.Popen:
        return subprocess.Popen([*serve_command(), *FLAGS, *parallel, "--node-rank", "1"], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    node_1 = launch_node_1()
    node_0 = None
    try:
        node_0 = ServerProcess(*FLAGS, *parallel, "--node-rank", "0").start()
        assert completions(node_0) == one_rank
        health = httpx.get(node_0.url + "/health", timeout=30).json()
        assert health["batch_invariant_reason"] == ("not checked under tensor parallelism (the startup check runs "
                                                    "on one process)")
        assert health["tensor_parallel_size"] == 2

        # rank 1 dies: node 1's launch exits, node 0's supervisor starts rank 0 again, which waits
        (rank_1,) = children(node_1.pid)
        os.kill(rank_1, 9)
        wait_until(lambda: node_1.poll() is not None, "node 1 exits")
        wait_until(lambda: httpx.get(node_0.url + "/health", timeout=30).json()["worker_restarts"] == 1,
                   "node 0 restarts its engine worker")
        assert any("the tensor-parallel group is down" in line for line in node_0.lines)
        node_1 = launch_node_1()
        wait_until(lambda: httpx.get(node_0.url + "/health", timeout=30).status_code == 200, "the group is back")
        assert completions(node_0) == one_rank

        node_0.stop()
        wait_until(lambda: node_1.poll() is not None, "node 1 exits after node 0 stopped")
    finally:
        if node_0 is not None:
            node_0.stop()
        if node_1.poll() is None:
            node_1.kill()
            node_1.wait()
