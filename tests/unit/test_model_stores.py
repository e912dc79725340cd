"""Named models resolved from stores on disk: a Hugging Face cache and an Ollama store built by the test,
offline (nothing here reaches a network)."""

from __future__ import annotations

import json

import pytest

from ember.errors import ModelLoadError
from ember.loaders.default_model import default_model_path
from ember.loaders.hub import list_hub_models
from ember.loaders.ollama import list_ollama_models
from ember.loaders.resolve import resolve_model
from model_stores import folder_files, tiny_hf_folder, write_hub_repo, write_ollama_model

REPO = "ember-tests/tiny-llama"
GGUF_REPO = "ember-tests/tiny-GGUF"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache with a safetensors repo (the tiny folder) and a GGUF repo of two quantizations."""
    root = tmp_path_factory.mktemp("hub")
    _, folder = tiny_hf_folder(root)
    cache = root / "cache"
    write_hub_repo(cache, REPO, folder_files(folder))
    write_hub_repo(cache, GGUF_REPO, {"tiny.Q4_1.gguf": default_model_path(), "tiny.Q8_0.gguf": b"GGUF" + b"\0" * 60,
                                      "README.md": b"# tiny"})
    return cache, folder


def test_a_cached_repo_resolves_offline_to_its_snapshot(hub_cache):
    cache, folder = hub_cache
    resolved = resolve_model(REPO, hub_cache=cache, offline=True)
    assert resolved.path.is_dir() and resolved.name.text == REPO
    assert sorted(p.name for p in resolved.path.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert (resolved.path / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_a_quantization_tag_picks_the_cached_file(hub_cache):
    cache, _ = hub_cache
    assert resolve_model(f"{GGUF_REPO}:Q8_0", hub_cache=cache, offline=True).path.name == "tiny.Q8_0.gguf"
    chosen = resolve_model(f"{GGUF_REPO}:q4_1", hub_cache=cache, offline=True).path
    assert chosen.name == "tiny.Q4_1.gguf" and chosen.resolve() == default_model_path().resolve()
    # no tag and no Q4_K_M: the smallest 4-bit file
    assert resolve_model(GGUF_REPO, hub_cache=cache, offline=True).path.name == "tiny.Q4_1.gguf"


def test_an_unknown_tag_offline_lists_the_cached_ones(hub_cache):
    cache, _ = hub_cache
    with pytest.raises(ModelLoadError) as caught:
        resolve_model(f"{GGUF_REPO}:Q5_K_M", hub_cache=cache, offline=True)
    assert "no GGUF file for the tag 'Q5_K_M'; it has: Q4_1, Q8_0" in caught.value.message
    assert str(cache) in caught.value.message


def test_a_missing_repo_offline_names_the_repo_and_the_cache(tmp_path):
    with pytest.raises(ModelLoadError) as caught:
        resolve_model("ember-tests/absent", hub_cache=tmp_path, offline=True)
    message = caught.value.message
    assert message.startswith("ember-tests/absent cannot be served offline: the Hugging Face cache")
    assert str(tmp_path) in message and "HF_HUB_OFFLINE" in message and "ember pull ember-tests/absent" in message
    assert caught.value.param == "model" and caught.value.code == "model_not_found"


def test_a_missing_revision_offline_is_named(hub_cache):
    cache, _ = hub_cache
    with pytest.raises(ModelLoadError, match=r"ember-tests/tiny-llama \(revision v2\) cannot be served offline"):
        resolve_model(REPO, revision="v2", hub_cache=cache, offline=True)


def test_a_snapshot_without_weights_is_not_served_offline(tmp_path):
    write_hub_repo(tmp_path, "ember-tests/partial", {"config.json": b'{"model_type": "llama"}'})
    with pytest.raises(ModelLoadError, match=r"the cached copy cannot serve it \(.*no \*\.safetensors weights"):
        resolve_model("ember-tests/partial", hub_cache=tmp_path, offline=True)


def test_the_hub_cache_lists_what_ember_can_serve(hub_cache):
    cache, folder = hub_cache
    listed = {model.name: model for model in list_hub_models(cache)}
    assert sorted(listed) == [f"{GGUF_REPO}:Q4_1", f"{GGUF_REPO}:Q8_0", REPO]
    assert listed[f"{GGUF_REPO}:Q4_1"].size_bytes == default_model_path().stat().st_size
    assert listed[REPO].format == "safetensors" and listed[REPO].store == "huggingface"
    assert listed[REPO].size_bytes == sum(p.stat().st_size for p in folder.iterdir())


# ---- Ollama ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ollama_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("ollama")
    blob = write_ollama_model(store, "smollm2", "135m", default_model_path())
    write_ollama_model(store, "smollm2", "latest", default_model_path())
    return store, blob


def test_an_ollama_name_resolves_its_manifest_to_the_model_blob(ollama_store):
    store, blob = ollama_store
    resolved = resolve_model("ollama:smollm2:135m", ollama_models=store)
    assert resolved.path == blob and resolved.path.name.startswith("sha256-")
    assert resolve_model("ollama:smollm2", ollama_models=store).path == blob  # the tag defaults to latest


def test_an_unknown_ollama_name_lists_the_store(ollama_store):
    store, _ = ollama_store
    with pytest.raises(ModelLoadError) as caught:
        resolve_model("ollama:qwen3:0.6b", ollama_models=store)
    message = caught.value.message
    assert message.startswith(f"ollama:qwen3:0.6b is not in Ollama's store {store}")
    assert "it has: ollama:smollm2:135m, ollama:smollm2:latest" in message and "ollama pull qwen3:0.6b" in message


def test_an_ollama_model_with_an_adapter_is_refused(tmp_path):
    write_ollama_model(tmp_path, "tuned", "latest", default_model_path())
    manifest = tmp_path / "manifests" / "registry.ollama.ai" / "library" / "tuned" / "latest"
    body = json.loads(manifest.read_text())
    body["layers"].append({"mediaType": "application/vnd.ollama.image.adapter", "digest": "sha256:00", "size": 1})
    manifest.write_text(json.dumps(body))
    with pytest.raises(ModelLoadError, match="adapter layer"):
        resolve_model("ollama:tuned", ollama_models=tmp_path)
    assert list_ollama_models(tmp_path) == []


def test_the_ollama_store_lists_its_models_with_sizes(ollama_store):
    store, blob = ollama_store
    listed = list_ollama_models(store)
    assert [model.name for model in listed] == ["ollama:smollm2:135m", "ollama:smollm2:latest"]
    assert all(m.size_bytes == default_model_path().stat().st_size and m.path == str(blob) for m in listed)


def test_a_cached_gguf_without_a_tag_is_listed_by_its_path(tmp_path):
    snapshot = write_hub_repo(tmp_path, "ember-tests/plain", {"model.gguf": b"GGUF" + b"\0" * 12})
    [listed] = list_hub_models(tmp_path)
    assert listed.name == str(snapshot / "model.gguf") and listed.size_bytes == 16
    assert resolve_model("ember-tests/plain", hub_cache=tmp_path, offline=True).path == snapshot / "model.gguf"
