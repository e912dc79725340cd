"""--kv-dtype: the flag reaches EngineConfig.kv_dtype, a wrong value is refused up front, each name
resolves to what the cache stores, and the pool counts int8's scales in its bytes."""

import argparse

import pytest
import torch

from ember.config import EngineConfig
from ember.engine.attention import KVCache
from ember.engine.pool import resolve_kv_dtype
from ember.server.flags import add_serve_parser, build_config


def _serve_config(*flags: str):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return build_config(parser.parse_args(["serve", *flags]))


def test_the_flag_sets_the_engine_config_and_defaults_to_auto():
    assert _serve_config().engine.kv_dtype == "auto"
    assert _serve_config("--kv-dtype", "int8").engine.kv_dtype == "int8"
    with pytest.raises(SystemExit):
        _serve_config("--kv-dtype", "int4")


def test_an_unknown_kv_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, bfloat16, bf16, float32, fp32, int8"):
        EngineConfig(kv_dtype="float8")


@pytest.mark.parametrize("name, model_dtype, stored", [
    ("auto", torch.bfloat16, torch.bfloat16), ("auto", torch.float32, torch.float32),
    ("bf16", torch.float32, torch.bfloat16), ("bfloat16", torch.float32, torch.bfloat16),
    ("fp32", torch.bfloat16, torch.float32), ("float32", torch.bfloat16, torch.float32),
    ("int8", torch.bfloat16, torch.int8)])
def test_each_name_resolves_to_what_the_cache_stores(name, model_dtype, stored):
    assert resolve_kv_dtype(name, model_dtype) == stored


def test_a_pool_counts_int8_values_and_their_scales():
    # 30 layers, k and v, 16 slots, 3 KV heads: 64 int8 values and a 4-byte scale per row
    assert KVCache.bytes_per_block(30, 16, 3, 64, torch.int8) == 30 * 2 * 16 * 3 * 68
    assert KVCache.bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 30 * 2 * 16 * 3 * 128
    assert KVCache.bytes_per_block(30, 16, 3, 64, torch.float32) == 30 * 2 * 16 * 3 * 256
