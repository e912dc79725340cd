"""Qwen3-MoE GGUF files: experts stored stacked (ffn_gate_exps, ffn_up_exps, ffn_down_exps) and the
router (ffn_gate_inp) load into ember's Qwen3-MoE model, which then computes transformers' logits."""

from __future__ import annotations

import pytest
import torch
import transformers

from ember import LLM, SamplingParams
from ember.errors import ModelLoadError
from ember.loaders import load_model_source
from gguf_helpers import Q, write_gguf
from gguf_models import TINY

EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
               head_dim=16)


def _tiny_moe() -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY, **EXPERTS}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    return model.eval()


def _gguf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' fused gate_up stack split into the gate and up stacks llama.cpp writes."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            state[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            state[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            state[name + ".weight"] = tensor
        else:
            state[name] = tensor
    return state


def _metadata() -> dict:
    return {"qwen3moe.expert_count": EXPERTS["num_experts"],
            "qwen3moe.expert_used_count": EXPERTS["num_experts_per_tok"],
            "qwen3moe.expert_feed_forward_length": EXPERTS["moe_intermediate_size"]}


def _transformers_twin(hf_config: dict, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' Qwen3-MoE holding exactly the weights ember read from the file (dequantized)."""
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf_config)).eval()
    state = {}
    for name, tensor in weights.items():
        if name.endswith("experts.gate_proj.weight"):
            up = weights[name.replace("gate_proj", "up_proj")]
            state[name.replace("gate_proj.weight", "gate_up_proj")] = torch.cat((tensor, up), dim=1)
        elif name.endswith("experts.down_proj.weight"):
            state[name.removesuffix(".weight")] = tensor
        elif not name.endswith("experts.up_proj.weight"):
            state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


@pytest.mark.parametrize("tensor_type", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_a_qwen3_moe_gguf_loads_its_stacked_experts_and_matches_transformers(tmp_path, tensor_type):
    """Greedy tokens and log probabilities through the paged engine, against transformers holding
    the same (dequantized) weights."""
    reference = _tiny_moe()
    config = reference.config.to_dict()
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", config, _gguf_state_dict(reference),
                      metadata=_metadata(), tensor_type=tensor_type)
    llm = LLM(str(path), cache_dir=tmp_path / "cache", dtype="float32", quantization="none",
              max_model_len=128, kv_cache_tokens=1024, max_num_batched_tokens=16)
    hf = llm.source.hf_config
    assert hf["model_type"] == "qwen3_moe"
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == (4, 2, 64)
    assert hf["norm_topk_prob"] is True
    twin = _transformers_twin(hf, dict(llm.source.weights()))
    if tensor_type == Q.F32:
        for name, tensor in reference.state_dict().items():
            assert torch.equal(twin.state_dict()[name], tensor), name

    prompts = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = torch.log_softmax(twin(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            expected = ref[len(prompt) - 1 + step]
            assert token == int(expected.argmax())
            assert lp.logprob == pytest.approx(float(expected[token]), rel=1e-4, abs=1e-4)
    llm.engine.check_invariants()


def test_a_qwen3_moe_gguf_without_its_expert_tensors_is_refused(tmp_path):
    reference = _tiny_moe()
    config = reference.config.to_dict()
    state = _gguf_state_dict(reference)
    state.pop("model.layers.0.mlp.experts.up_proj.weight")
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", config, state, metadata=_metadata())
    with pytest.raises(ModelLoadError, match="blk.0.ffn_up_exps.weight"):
        load_model_source(str(path), cache_dir=tmp_path / "cache")
