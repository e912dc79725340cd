"""Architecture lookup and checkpoint loading: names, shapes, tied heads, errors."""

from __future__ import annotations

import pytest
import torch
from model_builders import build_pair

from ember.config import ModelConfig
from ember.errors import ModelLoadError
from ember.models import SUPPORTED_ARCHITECTURES, get_model_class
from ember.models import llama, qwen2, qwen3, qwen3_moe


def test_get_model_class_finds_each_architecture():
    assert SUPPORTED_ARCHITECTURES == ("gemma3", "gemma3_text", "idefics3", "llama", "mistral", "phi3", "qwen2",
                                       "qwen3", "qwen3_moe")
    assert get_model_class("llama") is llama.Model
    assert issubclass(get_model_class("mistral"), llama.Model)
    assert get_model_class("qwen2") is qwen2.Model
    assert get_model_class("qwen3") is qwen3.Model
    assert get_model_class("qwen3_moe") is qwen3_moe.Model


def test_get_model_class_names_the_unknown_type_and_the_supported_ones():
    with pytest.raises(ModelLoadError) as info:
        get_model_class("gpt2")
    message = str(info.value)
    assert "'gpt2'" in message
    for name in ("llama", "qwen2", "qwen3", "mistral"):
        assert name in message


def checkpoint(case: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    hf_model, _, config = build_pair(case)
    return dict(hf_model.state_dict()), config


def fresh(config: ModelConfig):
    return get_model_class(config.model_type)(config)


def test_unknown_tensor_is_named():
    weights, config = checkpoint("qwen2_bias")
    weights["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(config.hidden_size)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        fresh(config).load_weights(weights.items())


def test_wrong_shape_is_named_with_both_shapes():
    weights, config = checkpoint("llama_llama3")
    name = "model.layers.0.self_attn.k_proj.weight"
    weights[name] = weights[name][:-1]
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight has shape \(31, 64\).*\(32, 64\)"):
        fresh(config).load_weights(weights.items())


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.2.self_attn.v_proj.weight",
                                  "model.layers.0.mlp.up_proj.weight", "lm_head.weight",
                                  "model.layers.1.self_attn.q_norm.weight"])
def test_missing_tensor_is_named(name):
    weights, config = checkpoint("qwen3_yarn")
    del weights[name]
    with pytest.raises(ModelLoadError, match=f"lacks the tensor {name}"):
        fresh(config).load_weights(weights.items())


def test_tensor_given_twice_is_an_error():
    weights, config = checkpoint("llama_yarn")
    items = list(weights.items()) + [("model.norm.weight", weights["model.norm.weight"])]
    with pytest.raises(ModelLoadError, match="model.norm.weight twice"):
        fresh(config).load_weights(items)


def test_rotary_buffers_of_old_checkpoints_are_ignored():
    weights, config = checkpoint("llama_llama3")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    model = fresh(config)
    table = model.model.rotary.cos_sin.clone()
    model.load_weights(weights.items())  # no error for the unknown buffer
    assert torch.equal(model.model.rotary.cos_sin, table)  # and the table is ember's own, not the checkpoint's
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"])


@torch.inference_mode()
def test_tied_head_shares_the_embedding_with_or_without_lm_head_in_the_checkpoint():
    weights, config = checkpoint("llama_tied_bias")
    assert config.tie_word_embeddings
    for items in (weights.items(), [(k, v) for k, v in weights.items() if k != "lm_head.weight"]):
        model = fresh(config)
        model.load_weights(items)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        torch.testing.assert_close(model.lm_head.weight, weights["model.embed_tokens.weight"])
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_fused_shards_land_in_their_slices():
    weights, config = checkpoint("qwen2_bias")
    model = fresh(config)
    model.load_weights(weights.items())
    attn = model.model.layers[1].self_attn
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    for part, start, size in (("q", 0, q_size), ("k", q_size, kv_size), ("v", q_size + kv_size, kv_size)):
        for leaf in ("weight", "bias"):
            expected = weights[f"model.layers.1.self_attn.{part}_proj.{leaf}"]
            assert torch.equal(getattr(attn.qkv_proj, leaf)[start:start + size], expected)
    assert attn.o_proj.bias is None  # Qwen2 has no o_proj bias
    mlp = model.model.layers[1].mlp
    inter = config.intermediate_size
    assert torch.equal(mlp.gate_up_proj.weight[:inter], weights["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight[inter:], weights["model.layers.1.mlp.up_proj.weight"])


def test_weights_are_cast_to_the_parameter_dtype():
    _, model, _ = build_pair("qwen3_qk_norm", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    assert model.model.rotary.cos_sin.dtype == torch.float32
