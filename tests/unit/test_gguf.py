"""GGUF reading: dequantization per tensor type, name mapping, the q/k un-permutation, config from
metadata, the conversion cache, and refusals of bad files."""

from __future__ import annotations

import json
import logging
import os
import pathlib

import gguf
import numpy as np
import pytest
import torch

from ember.errors import ModelLoadError
from ember.loaders import load_model_source
from ember.loaders import gguf_file
from ember.loaders.gguf_cache import cache_entry
from ember.loaders.gguf_file import (GGUFModel, hf_tensor_name, llama3_rope_factors,
                                     model_name_from_file, unpermute_qk_rows)
from ember.models.weights import kernel_format
from gguf_helpers import Q, permute_qk_rows, quantize, write_gguf
from gguf_models import default_gguf_model, state_dict_of, tiny_model

# Relative RMS error (||dequantized - original|| / ||original||) allowed per type on N(0, 1) data;
# about 1.5x what each type measures, so a wrong block layout (errors near 100%) cannot pass.
REL_ERROR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 0.01, Q.Q6_K: 0.03, Q.Q5_0: 0.065,
             Q.Q5_1: 0.06, Q.Q5_K: 0.06, Q.Q4_0: 0.13, Q.Q4_1: 0.12, Q.Q4_K: 0.12}
# Quantized by gguf.quants.quantize: F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1. K-quants by the
# test helper's own quantizers (gguf can only dequantize them).


def _big_enough_for_k_quants(model_type: str) -> dict:
    # every 2-D weight's row length must be a multiple of 256 for the K-quant block size
    return dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("qtype", list(REL_ERROR), ids=lambda q: q.name)
def test_dequantized_weights_match_float_originals(tmp_path, qtype):
    model = tiny_model("llama", **_big_enough_for_k_quants("llama"))
    original = state_dict_of(model)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", model.config.to_dict(), original,
                      tensor_type=qtype)
    opened = GGUFModel(path)
    assert opened.tensor_type("blk.0.attn_q.weight") == qtype.name
    loaded = dict(opened.weights(opened.hf_config([2])))
    assert loaded.keys() == original.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32 and tensor.shape == original[name].shape, name
        error = (tensor - original[name]).norm() / original[name].norm()
        bound = REL_ERROR[qtype] if original[name].dim() == 2 else 0.0  # 1-D stays F32
        assert error <= bound, f"{name}: relative error {error:.4f} > {bound}"


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_gguf_dequantizer_agrees_with_transformers_torch_dequantizer(qtype):
    """Two independent implementations of each block layout must agree bit for bit."""
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize
    values = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    blocks = quantize(values, qtype)
    ours = gguf.quants.dequantize(blocks, qtype)
    theirs = torch_dequantize(torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1)), int(qtype))
    np.testing.assert_array_equal(ours.reshape(-1), theirs.numpy())


def test_default_model_tensor_types_dequantize_like_transformers():
    """The real file's Q4_1, Q8_0 and F32 tensors, against transformers' own dequantizer."""
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize
    model = default_gguf_model()
    seen = set()
    for name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight"):
        tensor = model.tensors[name]
        kind = tensor.tensor_type.name
        seen.add(kind)
        ours = model.dequantize(name)
        assert ours.shape == model.torch_shape(name)
        if kind == "F32":
            expected = torch.from_numpy(np.array(tensor.data)).reshape(ours.shape)
        else:
            raw = torch.from_numpy(np.array(tensor.data).reshape(-1))
            expected = torch_dequantize(raw, int(tensor.tensor_type)).reshape(ours.shape)
        assert torch.equal(ours, expected), name
    assert seen == {"Q8_0", "Q4_1", "F32"}
    assert model.torch_shape("token_embd.weight") == (49152, 576)
    assert model.torch_shape("blk.0.ffn_down.weight") == (576, 1536)


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_gguf_reproduces_the_state_dict_exactly(tmp_path, tied):
    model = tiny_model("llama", tie_word_embeddings=tied)
    original = state_dict_of(model)
    path = write_gguf(tmp_path / "tiny-llama.F32.gguf", "llama", model.config.to_dict(), original)
    source = load_model_source(str(path), cache_dir=tmp_path / "cache")
    loaded = dict(source.weights())
    assert loaded.keys() == original.keys()
    for name in original:
        assert torch.equal(loaded[name], original[name]), name
    config = source.hf_config
    assert config["tie_word_embeddings"] is tied
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "max_position_embeddings"):
        assert config[key] == getattr(model.config, key), key
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert source.name == "tiny-llama" and source.format == "gguf"


def test_tiny_llama_gguf_gives_the_same_logits(tmp_path):
    """The loaded config and weights rebuild a model with bit-identical outputs."""
    import transformers
    model = tiny_model("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", model.config.to_dict(), state_dict_of(model))
    source = load_model_source(str(path), cache_dir=tmp_path / "cache")
    rebuilt = transformers.LlamaForCausalLM(transformers.LlamaConfig(**source.hf_config)).eval()
    rebuilt.load_state_dict(dict(source.weights()), strict=False)
    rebuilt.tie_weights()
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, model(ids).logits)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_tiny_qwen_gguf_reproduces_the_state_dict_exactly(tmp_path, model_type):
    overrides = {"head_dim": 32} if model_type == "qwen3" else {}
    model = tiny_model(model_type, tie_word_embeddings=False, **overrides)
    original = state_dict_of(model)
    assert any(name.endswith("q_proj.bias") or name.endswith("q_norm.weight") for name in original)
    path = write_gguf(tmp_path / f"{model_type}.gguf", model_type, model.config.to_dict(), original)
    source = load_model_source(str(path), cache_dir=tmp_path / "cache")
    loaded = dict(source.weights())
    assert loaded.keys() == original.keys()
    for name in original:
        assert torch.equal(loaded[name], original[name]), name
    assert source.hf_config["model_type"] == model_type
    head_dim = getattr(model.config, "head_dim", None) or 64 // 4
    assert source.hf_config["head_dim"] == head_dim
    assert source.hf_config["attention_bias"] is (model_type == "qwen2")


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.arange(8 * 64 * 3, dtype=torch.float32).reshape(8 * 64, 3)
    permuted = permute_qk_rows(weight, 8)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk_rows(permuted, 8), weight)
    # one head of 4 rows: HF halves (0 1 | 2 3) become interleaved pairs (0 2 1 3)
    assert permute_qk_rows(torch.arange(4.0), 1).tolist() == [0.0, 2.0, 1.0, 3.0]


def test_tensor_names_map_to_hf_names():
    assert hf_tensor_name("token_embd.weight", 2) == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight", 2) == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight", 2) == "model.norm.weight"
    assert hf_tensor_name("blk.1.attn_output.weight", 2) == "model.layers.1.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias", 2) == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.0.attn_q_norm.weight", 2) == "model.layers.0.self_attn.q_norm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", 2) == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.attn_q.weight", 2) is None  # past the last layer
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight", 2) == "model.layers.0.mlp.experts.gate_proj.weight"
    assert hf_tensor_name("blk.0.ffn_gate_inp.weight", 2) == "model.layers.0.mlp.gate.weight"
    assert hf_tensor_name("blk.0.ffn_unheard_of.weight", 2) is None


@pytest.mark.parametrize("file_name, name", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Qwen3-0.6B-Q8_0.gguf", "Qwen3-0.6B"),
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
    ("mistral-7b.f16.gguf", "mistral-7b"),
    ("model.gguf", "model"),
])
def test_model_name_from_file(file_name, name):
    assert model_name_from_file(pathlib.Path(file_name)) == name


def _tiny_llama_file(tmp_path, name="m.gguf", **kwargs):
    model = tiny_model("llama")
    return write_gguf(tmp_path / name, "llama", model.config.to_dict(), state_dict_of(model),
                      **kwargs)


def test_rope_scaling_from_metadata(tmp_path):
    yarn = _tiny_llama_file(tmp_path, "yarn.gguf", metadata={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 32768})
    assert GGUFModel(yarn).hf_config([2])["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    linear = _tiny_llama_file(tmp_path, "linear.gguf", metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    assert GGUFModel(linear).hf_config([2])["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert GGUFModel(_tiny_llama_file(tmp_path)).hf_config([2])["rope_scaling"] is None


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    factors = llama3_rope_factors(500000.0, 16, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    assert factors.min() == 1.0 and factors.max() == 8.0 and len(set(factors.tolist())) > 2
    path = _tiny_llama_file(tmp_path, extra_tensors={"rope_freqs.weight": factors},
                            metadata={"llama.rope.freq_base": 500000.0})
    config = GGUFModel(path).hf_config([2])
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    source = load_model_source(str(path), cache_dir=tmp_path / "cache")
    assert not any("rope_freqs" in name for name, _ in source.weights())


def test_sampling_defaults_from_metadata(tmp_path):
    path = _tiny_llama_file(tmp_path, metadata={"general.sampling.temp": 0.6,
                                                "general.sampling.top_p": 0.95,
                                                "general.sampling.top_k": 20})
    config = GGUFModel(path).generation_config([2])
    assert config == {"eos_token_id": [2], "bos_token_id": 1, "temperature": 0.6, "top_p": 0.95,
                      "top_k": 20}


# ---- the conversion cache --------------------------------------------------------------------

def _count_dequantize(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = gguf_file.dequantize_tensor

    def counting(model, name):
        calls.append(name)
        return real(model, name)
    monkeypatch.setattr(gguf_file, "dequantize_tensor", counting)
    return calls


def test_second_load_comes_from_the_cache(tmp_path, monkeypatch, caplog):
    path = _tiny_llama_file(tmp_path)
    calls = _count_dequantize(monkeypatch)
    caplog.set_level(logging.INFO, logger="ember.loaders")
    first = load_model_source(str(path), cache_dir=tmp_path / "cache")
    assert not first.from_cache and calls
    entry = pathlib.Path(first.cache_path)
    assert entry == cache_entry(path.resolve(), tmp_path / "cache")
    assert {p.name for p in entry.iterdir()} >= {"model.safetensors", "config.json",
                                                  "generation_config.json", "tokenizer",
                                                  "source.json"}
    assert str(entry) in caplog.text
    calls.clear()
    second = load_model_source(str(path), cache_dir=tmp_path / "cache")
    assert second.from_cache and calls == []
    assert second.hf_config == first.hf_config
    assert second.generation_config == first.generation_config
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert second.tokenizer.encode("the weather") == first.tokenizer.encode("the weather")
    for (name_a, a), (name_b, b) in zip(first.weights(), second.weights()):
        assert name_a == name_b and torch.equal(a, b)


@pytest.mark.parametrize("damage", ["truncate_weights", "garbage_marker", "drop_tokenizer"])
def test_a_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch, damage):
    path = _tiny_llama_file(tmp_path)
    entry = pathlib.Path(load_model_source(str(path), cache_dir=tmp_path / "cache").cache_path)
    if damage == "truncate_weights":
        with open(entry / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif damage == "garbage_marker":
        (entry / "source.json").write_text("{not json")
    else:
        for file in (entry / "tokenizer").iterdir():
            file.unlink()
    calls = _count_dequantize(monkeypatch)
    source = load_model_source(str(path), cache_dir=tmp_path / "cache")
    assert not source.from_cache and calls
    assert load_model_source(str(path), cache_dir=tmp_path / "cache").from_cache
    assert len(dict(source.weights())) == len(calls)


def test_a_changed_file_gets_a_new_entry_and_the_old_one_goes(tmp_path):
    path = _tiny_llama_file(tmp_path)
    old = pathlib.Path(load_model_source(str(path), cache_dir=tmp_path / "cache").cache_path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    new = load_model_source(str(path), cache_dir=tmp_path / "cache")
    assert not new.from_cache and pathlib.Path(new.cache_path) != old and not old.exists()


def test_an_unwritable_cache_still_loads(tmp_path):
    path = _tiny_llama_file(tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder should be")
    source = load_model_source(str(path), cache_dir=blocker)
    assert source.cache_path is None and not source.from_cache
    assert len(dict(source.weights())) == len(state_dict_of(tiny_model("llama")))


# ---- refusals ----------------------------------------------------------------------------------

def test_refuses_a_text_file_named_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are my notes, not a model\n")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_model_source(str(path), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("keep", [0.3, 0.97])
def test_refuses_a_truncated_gguf(tmp_path, keep):
    path = _tiny_llama_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model_source(str(path), cache_dir=tmp_path / "cache")


def test_refuses_a_gguf_missing_tensors(tmp_path):
    path = _tiny_llama_file(tmp_path, skip=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ModelLoadError, match=r"missing tensors \(blk\.1\.ffn_up\.weight\)"):
        load_model_source(str(path), cache_dir=tmp_path / "cache")


def test_refuses_an_unsupported_architecture(tmp_path):
    model = tiny_model("llama")
    path = write_gguf(tmp_path / "g.gguf", "gemma2", model.config.to_dict(), state_dict_of(model))
    with pytest.raises(ModelLoadError) as caught:
        load_model_source(str(path), cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert "'gemma2' is not supported" in message
    assert "supported: gemma3, gemma3_text, idefics3, llama, mistral, phi3, qwen2, qwen3, qwen3_moe, smolvlm" in message
    assert "\n" not in message


def test_refuses_an_unknown_tensor(tmp_path):
    path = _tiny_llama_file(tmp_path, extra_tensors={
        "blk.0.ffn_gate_exps.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        load_model_source(str(path), cache_dir=tmp_path / "cache")


def test_cache_marker_records_the_source(tmp_path):
    path = _tiny_llama_file(tmp_path)
    entry = pathlib.Path(load_model_source(str(path), cache_dir=tmp_path / "cache").cache_path)
    marker = json.loads((entry / "source.json").read_text())
    assert marker["source"] == str(path.resolve()) and marker["size"] == path.stat().st_size


EXACT_BLOCKS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8, Q.Q5_0: 8, Q.Q4_K: 20, Q.Q6_K: 24,  # type -> ember's format
                Q.Q5_1: 28, Q.Q5_K: 28}
# the kernel's layout of each (models.weights.kernel_format): the K-quants' scales once per
# super-block, codes of 5 or 6 bits held in as many
KERNEL_LAYOUTS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8, Q.Q5_0: 72, Q.Q4_K: 52, Q.Q6_K: 120, Q.Q5_1: 92, Q.Q5_K: 60}


@pytest.mark.parametrize("qtype", [*EXACT_BLOCKS, Q.TQ2_0], ids=lambda q: q.name)
def test_quantized_tensors_come_as_blocks_that_dequantize_like_the_float_path(tmp_path, qtype, caplog):
    """Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K map onto ember's blocks exactly: their
    dequantized values are the float loader's, bit for bit (q/k rows un-permuted alike). Another
    type (TQ2_0 here; Q2_K, Q3_K and the IQ types alike) is quantized again to 4 bits, within
    half a step of its own values, and a warning names it."""
    model = tiny_model("llama", **_big_enough_for_k_quants("llama"))
    path = write_gguf(tmp_path / "tiny.gguf", "llama", model.config.to_dict(), state_dict_of(model),
                      tensor_type=qtype)
    source = load_model_source(str(path), cache_dir=tmp_path / "cache")
    floats = dict(source.weights())
    with caplog.at_level("WARNING", logger="ember.loaders"):
        mixed = dict(source.weights(blocks=True))
    assert mixed.keys() == floats.keys()
    blocks = {name: value for name, value in mixed.items() if not isinstance(value, torch.Tensor)}
    assert set(blocks) == {name for name, t in floats.items() if t.dim() == 2}  # every 2-D weight, norms apart
    for name, value in blocks.items():
        assert value.format == EXACT_BLOCKS.get(qtype, 4) and value.shape == tuple(floats[name].shape), name
        if qtype in EXACT_BLOCKS:
            assert torch.equal(value.dequantize(), floats[name]), name
            assert kernel_format(value) == KERNEL_LAYOUTS[qtype], name
        else:
            step = value.scales.float().repeat_interleave(32, dim=1)
            assert ((value.dequantize() - floats[name]).abs() <= 0.5 * step + 1e-6).all(), name
    warned = [r.getMessage() for r in caplog.records if "quantized again" in r.getMessage()]
    assert (f"{qtype.name} (" in warned[0]) if qtype not in EXACT_BLOCKS else not warned


def test_a_q4_k_m_shaped_file_is_held_in_its_own_weights(tmp_path):
    """Q4_K projections with Q6_K values and down projections (as a Q4_K_M file mixes them): each
    layer runs in a format that holds its file's weights exactly, looked up bit for bit: Q4_K in
    the layout with one scale and minimum per super-block, Q6_K in 6-bit codes with the halves'
    steps and one scale per super-block, and the fused q/k/v, Q4_K queries and keys beside Q6_K
    values, each part in its own of those layouts (StackedBlockWeights).
    (tests/models/test_gemma3_real_weights.py holds a real Q4_K_M file's outputs to transformers'.)"""
    from ember import LLM
    from ember.models.layers import block_weights

    model = tiny_model("llama", **{**_big_enough_for_k_quants("llama"), "num_hidden_layers": 2})
    path = write_gguf(tmp_path / "tiny-Q4_K_M.gguf", "llama", model.config.to_dict(), state_dict_of(model),
                      tensor_type=Q.Q4_K, tensor_types={".attn_v.": Q.Q6_K, ".ffn_down.": Q.Q6_K})
    llm = LLM(str(path), cache_dir=tmp_path / "cache", dtype="float32", max_model_len=128)
    floats = dict(llm.source.weights())
    for index, layer in enumerate(llm.engine.runner.model.model.layers):
        held = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
                "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
        layouts = {name: [part.format for part in getattr(linear.weights, "parts", [linear.weights])]
                   for name, linear in held.items()}
        assert layouts == {"qkv_proj": [52, 52, 120], "o_proj": [52], "gate_up_proj": [52], "down_proj": [120]}
        prefix = f"model.layers.{index}."
        expected = {"qkv_proj": torch.cat([floats[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
                    "o_proj": floats[prefix + "self_attn.o_proj.weight"],
                    "gate_up_proj": torch.cat((floats[prefix + "mlp.gate_proj.weight"],
                                               floats[prefix + "mlp.up_proj.weight"])),
                    "down_proj": floats[prefix + "mlp.down_proj.weight"]}
        for name, weight in expected.items():
            parts = getattr(held[name].weights, "parts", [held[name].weights])
            held_rows = torch.cat([part.rows(torch.arange(part.out_features)) for part in parts])
            assert torch.equal(held_rows, weight), (index, name)
    assert len(block_weights(llm.engine.runner.model)) == (4 + 2) * 2 + 1  # a stacked layer's parts, the LM head
    llm.close()
