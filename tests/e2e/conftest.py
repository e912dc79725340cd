"""Real `ember serve` processes on the default model, and clients for them.

`server` is the main one (default limits, shared by most tests); `thinking_server` and
`thinking_xml_server` (reasoning templates with hermes and Qwen3 XML tool calls),
`one_slot_server` (one seat, no queue) and `vision_server` (a tiny SmolVLM with image limits and
URL fetching) are shared by the modules that need them.
Tests that need other limits (auth, CORS, 413/429/503) start their own instance with `ServerProcess`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

MAIN_FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "24", "--log-level", "info"]
TEMPLATES = Path(__file__).parent / "templates"
THINKING_BUDGET = 12  # thinking_server's --default-thinking-budget
START_TIMEOUT_S = 300


def serve_command() -> list[str]:
    return [sys.executable, "-m", "ember.cli", "serve"]


class ServerProcess:
    """One `ember serve` subprocess on `port` (0: a free one); its stderr is kept for the log tests.
    Each has a state folder of its own (its Responses store), unless `env` names one."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, port: int = 0) -> None:
        self.flags = list(flags)
        state = tempfile.mkdtemp(prefix="server-", dir=os.environ["EMBER_STATE_DIR"])
        self.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "EMBER_STATE_DIR": state, **(env or {})}
        self.requested_port = port
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.health_seen: list[tuple[int, dict]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen([*serve_command(), "--port", str(self.requested_port), *self.flags], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=self.env)
        listening = threading.Event()

        def drain() -> None:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                found = re.search(r"listening on http://[^:]+:(\d+)", line)
                if found:
                    self.port = int(found.group(1))
                    listening.set()
            listening.set()

        threading.Thread(target=drain, daemon=True).start()
        if not listening.wait(START_TIMEOUT_S) or self.port is None:
            self.stop()
            raise RuntimeError("ember serve did not start:\n" + "\n".join(self.lines[-30:]))
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # a server that never became ready is not left running
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("ember serve exited:\n" + "\n".join(self.lines[-30:]))
            try:
                reply = httpx.get(self.url + "/health", timeout=5)
                self.health_seen.append((reply.status_code, reply.json()))
                if reply.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("ember serve never became healthy:\n" + "\n".join(self.lines[-30:]))

    def log_since(self, mark: int) -> list[str]:
        return self.lines[mark:]

    def interrupt(self, timeout: float = 60) -> int:
        """Ctrl-C; returns the exit code."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def server():
    process = ServerProcess(*MAIN_FLAGS).start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def thinking_server():
    """The main flags behind a reasoning template (think_hermes.jinja: <think> blocks, hermes tool
    calls), a default thinking budget, and a Responses store of 3 records in 0.05 MiB."""
    process = ServerProcess(*MAIN_FLAGS, "--chat-template", str(TEMPLATES / "think_hermes.jinja"),
                            "--default-thinking-budget", str(THINKING_BUDGET), "--response-store-max-records", "3",
                            "--response-store-max-mb", "0.05").start()
    process.template = "think_hermes"
    yield process
    process.stop()


@pytest.fixture(scope="session")
def thinking_xml_server():
    """The main flags behind think_xml.jinja (<think> blocks, Qwen3 XML tool calls: raw parameter values)
    and a default thinking budget."""
    process = ServerProcess(*MAIN_FLAGS, "--chat-template", str(TEMPLATES / "think_xml.jinja"),
                            "--default-thinking-budget", str(THINKING_BUDGET)).start()
    process.template = "think_xml"
    yield process
    process.stop()


@pytest.fixture(scope="session")
def one_slot_server():
    """One seat and no queue, so a second request is refused at once; with the chat page."""
    process = ServerProcess("--ui", "--max-model-len", "1024", "--max-num-seqs", "1", "--max-pending", "0").start()
    yield process
    process.stop()


VISION_MODEL = "tiny-smolvlm"  # vision_server's model, as its folder is named
VISION_MAX_IMAGE_MB = 0.1


@pytest.fixture(scope="session")
def smolvlm(tmp_path_factory):
    """A tiny SmolVLM folder with random weights (tests/vision_fixtures.py)."""
    from vision_fixtures import add_random_weights, write_smolvlm_folder
    return add_random_weights(write_smolvlm_folder(tmp_path_factory.mktemp("smolvlm") / VISION_MODEL))


@pytest.fixture(scope="session")
def vision_server(smolvlm):
    """The tiny SmolVLM with the chat page: at most 2 images of 0.1 MiB a request within 0.5 MiB,
    and images by URL fetched within 1 s."""
    process = ServerProcess(str(smolvlm), "--ui", "--max-model-len", "1024", "--max-images", "2",
                            "--max-image-mb", str(VISION_MAX_IMAGE_MB), "--media-budget-mb", "0.5",
                            "--image-urls", "--image-fetch-timeout", "1").start()
    yield process
    process.stop()


POOL_MODELS = ("smol", "tiny", "tiny-llama", "broken")  # pool_server's models, the first the default


@pytest.fixture(scope="session")
def pool_server(tmp_path_factory):
    """Several models behind one server (--models-config): the default GGUF as `smol` (alias
    `default`), tiny random Qwen3 (`tiny`, alias `small`) and Llama (`tiny-llama`) folders, and
    `broken`, a folder that cannot load; at most two loaded at once, with the chat page. Tests
    that share it must not count on which models are loaded when they start."""
    from ember.loaders.default_model import default_model_path
    from model_stores import tiny_hf_folder

    folder = tmp_path_factory.mktemp("pool")
    tiny_qwen = tiny_hf_folder(folder, "qwen3")[1]
    tiny_llama = tiny_hf_folder(folder, "llama")[1]
    broken = folder / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    config = folder / "models.toml"
    config.write_text(f"""
[models.smol]
model = "{default_model_path()}"
aliases = ["default"]

[models.tiny]
model = "{tiny_qwen}"
aliases = ["small"]
max_model_len = 256
quantization = "none"

[models.tiny-llama]
model = "{tiny_llama}"
max_model_len = 256

[models.broken]
model = "{broken}"
""")
    process = ServerProcess("--models-config", str(config), "--max-loaded-models", "2", "--max-model-len", "1024",
                            "--max-num-seqs", "8", "--ui", "--log-level", "info").start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="not-checked", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as session:
        yield session


@pytest.fixture(scope="session")
def model_id(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def wait_idle(http: httpx.Client, timeout: float = 60) -> dict:
    """Poll /health until no request runs and the engine holds no KV blocks; return its body.

    A liveness wait, not a timing check: the deadline is only there so a leak fails the test."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = http.get("/health").json()
        engine = body.get("engine", {})
        if (body.get("requests_running") == 0 and engine.get("num_running") == 0
                and engine.get("num_waiting") == 0 and engine.get("kv_blocks_used") == 0):
            return body
        time.sleep(0.1)
    raise AssertionError(f"the server did not become idle: {body}")
