"""`ember serve --device cuda`: the engine worker loads the default model on the GPU and answers
one chat request over HTTP."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx


def _server_process_class():
    """tests/e2e's ServerProcess, loaded from its file under a name of its own: "conftest" in
    sys.modules is whichever folder's conftest pytest imported last."""
    spec = importlib.util.spec_from_file_location("e2e_servers", Path(__file__).parents[1] / "e2e" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ServerProcess


def test_ember_serve_on_cuda_answers_a_chat_request():
    server = _server_process_class()("--device", "cuda", "--max-model-len", "1024").start()
    try:
        health = httpx.get(server.url + "/health", timeout=30).json()
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": health["model"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()
