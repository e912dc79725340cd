"""Tensor-parallel shards (models.sharding), the loaders' slices and the flags, without a model."""

import argparse

import pytest
import torch

from ember.config import EngineConfig, ModelConfig
from ember.errors import ModelLoadError
from ember.loaders.hf_folder import read_safetensors
from ember.models.sharding import Cut, cut_for, cut_tensor, local_config, plan_shards
from ember.models.weights import QuantBlocks
from ember.server.flags import add_serve_parser, parallel_flags

# the default model's shape (SmolLM2-135M)
SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      tie_word_embeddings=True)


def heads(plans):
    return [(p.q_start, p.q_stop, p.kv_start, p.kv_stop) for p in plans]


def test_uneven_kv_groups_at_two_ranks():
    plans = plan_shards(SMOLLM2, 2)
    assert heads(plans) == [(0, 6, 0, 2), (6, 9, 2, 3)]  # 6 + 3 query heads, 2 + 1 KV heads
    assert [(p.mlp_start, p.mlp_stop) for p in plans] == [(0, 768), (768, 1536)]
    assert [(p.vocab_start, p.vocab_stop) for p in plans] == [(0, 24576), (24576, 49152)]
    local = local_config(SMOLLM2, plans[1])
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (3, 1, 768)


def test_kv_heads_replicated_past_their_count():
    plans = plan_shards(SMOLLM2, 4)  # 3 KV heads over 4 ranks: KV head 0 on two of them
    assert heads(plans) == [(0, 2, 0, 1), (2, 3, 0, 1), (3, 6, 1, 2), (6, 9, 2, 3)]
    assert sum(p.mlp_stop - p.mlp_start for p in plans) == 1536
    assert all((p.mlp_stop - p.mlp_start) % 32 == 0 for p in plans)  # row-parallel cuts between blocks
    with pytest.raises(ModelLoadError, match="10 is more than the model's 9 attention heads"):
        plan_shards(SMOLLM2, 10)


def test_cuts_of_checkpoint_names():
    plan = plan_shards(SMOLLM2, 2)[1]
    assert cut_for("model.layers.3.self_attn.q_proj.weight", SMOLLM2, plan) == Cut(0, 384, 576)
    assert cut_for("model.layers.3.self_attn.k_proj.bias", SMOLLM2, plan) == Cut(0, 128, 192)
    assert cut_for("model.layers.3.self_attn.o_proj.weight", SMOLLM2, plan) == Cut(1, 384, 576)
    assert cut_for("model.layers.3.mlp.down_proj.weight", SMOLLM2, plan) == Cut(1, 768, 1536)
    assert cut_for("model.layers.3.mlp.up_proj.weight", SMOLLM2, plan) == Cut(0, 768, 1536)
    assert cut_for("model.embed_tokens.weight", SMOLLM2, plan) == Cut(0, 24576, 49152)
    assert cut_for("model.layers.3.input_layernorm.weight", SMOLLM2, plan) is None
    assert cut_for("model.norm.weight", SMOLLM2, plan) is None


def test_quantized_blocks_cut_by_rows_and_whole_input_blocks():
    weight = torch.randn(48, 128)
    blocks = QuantBlocks.quantize(weight, 8)
    rows = cut_tensor("w", blocks, Cut(0, 16, 40))
    assert torch.equal(rows.dequantize(), blocks.dequantize()[16:40])
    columns = cut_tensor("w", blocks, Cut(1, 32, 96))
    assert torch.equal(columns.dequantize(), blocks.dequantize()[:, 32:96])
    with pytest.raises(ModelLoadError, match="cuts through a block of 32"):
        cut_tensor("model.layers.0.mlp.down_proj.weight", blocks, Cut(1, 0, 48))
    assert torch.equal(cut_tensor("w", weight, Cut(1, 3, 7)), weight[:, 3:7])


def test_safetensors_read_only_the_slice(tmp_path):
    from safetensors.torch import save_file

    tensors = {"model.layers.0.self_attn.o_proj.weight": torch.randn(576, 576),
               "model.norm.weight": torch.randn(576)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    plan = plan_shards(SMOLLM2, 2)[0]
    read = dict(read_safetensors([tmp_path / "model.safetensors"], cut=lambda name: cut_for(name, SMOLLM2, plan)))
    assert torch.equal(read["model.layers.0.self_attn.o_proj.weight"],
                       tensors["model.layers.0.self_attn.o_proj.weight"][:, :384])
    assert torch.equal(read["model.norm.weight"], tensors["model.norm.weight"])


def test_engine_config_checks_the_parallel_settings():
    EngineConfig(tensor_parallel_size=4, nnodes=2, dist_init_addr="10.0.0.1:29500")
    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="need dist_init_addr"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="HOST:PORT"):
        EngineConfig(tensor_parallel_size=2, dist_init_addr="nohost")


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *flags])


def test_flags_and_torchrun_environment():
    flags = parallel_flags(_args("--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
                                 "--dist-init-addr", "10.0.0.1:29500"), {})
    assert flags == {"tensor_parallel_size": 4, "nnodes": 2, "node_rank": 1, "dist_init_addr": "10.0.0.1:29500",
                     "local_rank": 0}
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "1"}
    assert parallel_flags(_args(), torchrun) == {"tensor_parallel_size": 4, "nnodes": 4, "node_rank": 3,
                                                 "dist_init_addr": "10.0.0.1:29500", "local_rank": 1}
    with pytest.raises(ValueError, match="--node-rank must be between 0 and"):
        parallel_flags(_args("--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"), {})


def test_one_rank_never_imports_the_parallel_modules():
    import subprocess
    import sys

    code = ("import sys, ember.engine.core, ember.engine.worker, ember.llm, ember.server.cli; "
            "print(sorted(m for m in sys.modules if m in ('ember.engine.parallel', 'ember.engine.ranks')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
