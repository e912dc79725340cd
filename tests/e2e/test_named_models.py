"""`ember serve NAME`, `ember pull` and `ember models` as a user runs them: a Hugging Face repo id from a
prebuilt cache offline, a download from a local stand-in for the hub (HF_ENDPOINT; the real
huggingface_hub client does the work), an `ollama:` name from an Ollama-style store, and refusals that
end the process with a message instead of a server that never gets ready."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from conftest import ServerProcess, serve_command
from ember import LLM, SamplingParams
from ember.loaders.default_model import default_model_path
from ember.loaders.resolve import resolve_model
from ember.store_cli import human_size
from local_hub import LocalHub
from model_stores import folder_files, tiny_hf_folder, write_hub_repo, write_ollama_model

REPO = "ember-tests/tiny-llama"
SMALL = ["--max-model-len", "128", "--max-num-seqs", "4"]
PROMPT = "The sea is"


def hub_env(cache, *, offline: bool, endpoint: str | None = None) -> dict[str, str]:
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1" if offline else "0", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_TOKEN": ""}
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


def ember(*argv: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def greedy_completion(server: ServerProcess) -> dict:
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    _, folder = tiny_hf_folder(tmp_path_factory.mktemp("tiny"))
    return folder


def test_a_repo_id_served_offline_from_the_cache_gives_the_folders_tokens(tiny_folder, tmp_path):
    cache = tmp_path / "hub"
    write_hub_repo(cache, REPO, folder_files(tiny_folder))
    server = ServerProcess(REPO, *SMALL, env=hub_env(cache, offline=True)).start()
    try:
        models = httpx.get(server.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        served = greedy_completion(server)
    finally:
        server.stop()
    expected = LLM(str(tiny_folder), max_model_len=128).generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert served["choices"][0]["text"] == expected.text
    assert served["usage"]["completion_tokens"] == len(expected.token_ids) == 12
    assert served["model"] == REPO


def test_a_missing_repo_offline_ends_serve_with_a_clear_error(tmp_path):
    done = subprocess.run([*serve_command(), "ember-tests/absent", "--port", "0"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **hub_env(tmp_path, offline=True)})
    assert done.returncode == 1
    assert "ember serve: cannot load ember-tests/absent: ember-tests/absent cannot be served offline" in done.stderr
    assert str(tmp_path) in done.stderr and "HF_HUB_OFFLINE" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_path_ends_serve_instead_of_staying_unavailable(tmp_path):
    done = subprocess.run([*serve_command(), str(tmp_path / "nowhere.gguf"), "--port", "0"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "nowhere.gguf' does not exist" in done.stderr and "Traceback" not in done.stderr


def test_a_download_fetches_only_what_ember_needs_and_a_second_start_uses_the_cache(tiny_folder, tmp_path):
    files = {name: path.read_bytes() for name, path in folder_files(tiny_folder).items()}
    extras = {"pytorch_model.bin": b"pickle", "README.md": b"# tiny", "onnx/model.onnx": b"onnx",
              "original/model.safetensors": b"other", "flax_model.msgpack": b"flax"}
    cache = tmp_path / "hub"
    with LocalHub({REPO: {**files, **extras}}) as hub:
        env = hub_env(cache, offline=False, endpoint=hub.url)
        first = ServerProcess(REPO, *SMALL, env=env).start()
        try:
            assert [m["id"] for m in httpx.get(first.url + "/v1/models", timeout=30).json()["data"]] == [REPO]
            reply = greedy_completion(first)
        finally:
            first.stop()
        assert hub.downloaded(REPO) == set(files)
        snapshot = next((cache / "models--ember-tests--tiny-llama" / "snapshots").iterdir())
        assert {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()} == set(files)

        asked = len(hub.requests)
        second = ServerProcess(REPO, *SMALL, env=env).start()
        try:
            assert greedy_completion(second)["choices"][0]["text"] == reply["choices"][0]["text"]
        finally:
            second.stop()
        assert hub.requests[asked:] == []  # served from the cache, with no call to the hub


def test_pull_after_an_interrupted_download_fetches_only_the_missing_files(tiny_folder, tmp_path):
    files = {name: path.read_bytes() for name, path in folder_files(tiny_folder).items()}
    cache = tmp_path / "hub"
    with LocalHub({REPO: files}) as hub:
        # what a download stopped before the weights leaves: the ref and the smaller files of the snapshot
        kept = {name: data for name, data in files.items() if name != "model.safetensors"}
        write_hub_repo(cache, REPO, kept, commit=hub.commits[REPO])
        done = ember("pull", REPO, env=hub_env(cache, offline=False, endpoint=hub.url))
        assert done.returncode == 0, done.stderr
        assert f"{REPO} is ready at" in done.stderr
        assert hub.downloaded(REPO) == {"model.safetensors"}
    snapshot = cache / "models--ember-tests--tiny-llama" / "snapshots" / hub.commits[REPO]
    assert (snapshot / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_pull_of_a_sharded_repo_fetches_the_shards_its_index_names(tmp_path):
    _, folder = tiny_hf_folder(tmp_path / "sharded", max_shard_size="100KB")
    files = {name: path.read_bytes() for name, path in folder_files(folder).items()}
    assert "model.safetensors.index.json" in files
    cache = tmp_path / "hub"
    with LocalHub({REPO: {**files, "consolidated.safetensors": b"a second copy of the weights"}}) as hub:
        done = ember("pull", REPO, env=hub_env(cache, offline=False, endpoint=hub.url))
        assert done.returncode == 0, done.stderr
        assert hub.downloaded(REPO) == set(files)
    assert resolve_model(REPO, hub_cache=cache, offline=True).path.is_dir()


def test_pull_of_a_gguf_tag_fetches_that_file_and_an_unknown_tag_lists_the_others(tmp_path):
    gguf_repo = "ember-tests/tiny-GGUF"
    repo = {"tiny.Q4_K_M.gguf": b"GGUF-q4km", "tiny.Q8_0.gguf": b"GGUF-q8", "tiny.F16.gguf": b"GGUF-f16",
            "README.md": b"# tiny"}
    cache = tmp_path / "hub"
    with LocalHub({gguf_repo: repo}) as hub:
        env = hub_env(cache, offline=False, endpoint=hub.url)
        done = ember("pull", f"{gguf_repo}:Q8_0", env=env)
        assert done.returncode == 0, done.stderr
        assert hub.downloaded(gguf_repo) == {"tiny.Q8_0.gguf"}
        assert done.stderr.strip().endswith(f"`ember serve {gguf_repo}:Q8_0`")
        unknown = ember("pull", f"{gguf_repo}:Q5_K_M", env=env)
        assert unknown.returncode == 2
        assert "has no GGUF file for the tag 'Q5_K_M'; it has: F16, Q4_K_M, Q8_0" in unknown.stderr
        missing = ember("pull", "ember-tests/absent", env=env)
        assert missing.returncode == 2 and "ember-tests/absent was not found on" in missing.stderr
    listed = ember("models", env={**env, "OLLAMA_MODELS": str(tmp_path / "no-ollama")}).stdout
    assert f"{gguf_repo}:Q8_0" in listed and "gguf" in listed and "huggingface" in listed


def test_an_ollama_name_serves_its_blob(tmp_path):
    store = tmp_path / "ollama"
    blob = write_ollama_model(store, "smollm2", "135m", default_model_path())
    server = ServerProcess("ollama:smollm2:135m", *SMALL, env={"OLLAMA_MODELS": str(store)}).start()
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]] == \
            ["ollama:smollm2:135m"]
        assert greedy_completion(server)["usage"]["completion_tokens"] == 12
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert f'path="{blob.resolve()}"' in metrics  # the blob is a link to the default model's file
    finally:
        server.stop()


def test_ember_models_lists_both_stores_with_sizes(tiny_folder, tmp_path):
    cache, store = tmp_path / "hub", tmp_path / "ollama"
    write_hub_repo(cache, REPO, folder_files(tiny_folder))
    write_ollama_model(store, "smollm2", "135m", default_model_path())
    done = ember("models", env={**hub_env(cache, offline=True), "OLLAMA_MODELS": str(store)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == [f"Hugging Face cache: {cache}", f"Ollama store: {store}"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    folder_size = human_size(sum(p.stat().st_size for p in tiny_folder.iterdir()))
    assert rows[REPO] == [*folder_size.split(), "safetensors", "huggingface"]
    assert rows["ollama:smollm2:135m"] == [*human_size(default_model_path().stat().st_size).split(), "gguf", "ollama"]
