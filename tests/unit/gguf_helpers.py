"""Test helpers: write tiny GGUF files the way llama.cpp's converter does, and quantize to the
K-quant block layouts that the gguf package can only dequantize."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np
import torch


def permute_qk_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation (Hugging Face order -> GGUF order), as its converter writes it;
    ember's loader undoes it (gguf_file.unpermute_qk_rows)."""
    rows = tensor.shape[0]
    head_dim = rows // num_heads
    rest = tensor.shape[1:]
    return (tensor.reshape(num_heads, 2, head_dim // 2, *rest).transpose(1, 2)
            .reshape(rows, *rest).contiguous())


Q = gguf.GGMLQuantizationType
QK_K = 256

_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                      "lm_head": "output"}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def gguf_tensor_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in _HF_TO_GGUF_GLOBAL:
        return f"{_HF_TO_GGUF_GLOBAL[base]}.{kind}"
    _, _, layer, *rest = base.split(".")
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER['.'.join(rest)]}.{kind}"


def byte_level_vocab(size: int, extra_merges: tuple[tuple[str, str], ...] = ()
                     ) -> tuple[list[str], list[int], list[str]]:
    """A tiny GPT-2 style vocabulary of `size` tokens: specials, the 256 byte characters, then
    merged tokens built from a few merges and `extra_merges`. Returns (tokens, token types, merges)."""
    from ember.tokenization.vocab import byte_alphabet
    chars = list(byte_alphabet())
    tokens = SPECIAL_TOKENS + chars
    types = [3] * len(SPECIAL_TOKENS) + [1] * len(chars)
    merges: list[str] = []
    for left, right in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"),
                        ("Ġ", "Ġ"), ("o", "n"), ("Ġ", "w"), *extra_merges]:
        if len(tokens) >= size:
            break
        merges.append(f"{left} {right}")
        tokens.append(left + right)
        types.append(1)
    while len(tokens) < size:  # padding, as llama.cpp writes for a vocabulary smaller than the model
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    return tokens, types, merges


def write_gguf(path: pathlib.Path, arch: str, config: Mapping[str, Any],
               state_dict: Mapping[str, torch.Tensor], *, permute_qk: bool | None = None,
               tensor_type: Q = Q.F32, tensor_types: Mapping[str, Q] | None = None, skip: tuple[str, ...] = (),
               extra_tensors: Mapping[str, np.ndarray] | None = None,
               metadata: Mapping[str, Any] | None = None) -> pathlib.Path:
    """Write an HF state dict as a GGUF file with llama.cpp's names, metadata and (for llama)
    its q/k row permutation. 2-D weights use tensor_type (F32, F16, BF16 or a gguf.quants type),
    or the type of the first part of tensor_types in their GGUF name (".attn_v.": Q6_K, as a
    Q4_K_M file holds some); norms and biases stay F32, as llama.cpp keeps them."""
    permute_qk = arch == "llama" if permute_qk is None else permute_qk
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    tokens, types, merges = byte_level_vocab(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        _add_value(writer, key, value)

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf_name, tensor in state_dict.items():
        if hf_name in skip:
            continue
        name = gguf_tensor_name(hf_name)
        tensor = tensor.detach().float()
        if permute_qk and ".attn_q." in name:
            tensor = permute_qk_rows(tensor, heads)
        elif permute_qk and ".attn_k." in name:
            tensor = permute_qk_rows(tensor, kv_heads)
        array = tensor.numpy()
        kind = next((t for part, t in (tensor_types or {}).items() if part in name), tensor_type)
        if array.ndim == 2 and kind != Q.F32:
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"cannot write {key}={value!r}")


# ---- quantization ------------------------------------------------------------------------------

def quantize(array: np.ndarray, qtype: Q) -> np.ndarray:
    """Rows of float32 -> GGUF bytes of qtype (gguf.quants where it can, K-quants here)."""
    if qtype in _K_QUANTIZERS:
        rows = array.astype(np.float32).reshape(-1, QK_K)
        return _K_QUANTIZERS[qtype](rows).reshape(array.shape[0], -1)
    return gguf.quants.quantize(array.astype(np.float32), qtype)


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """(nb, 256) -> (nb, 210): ql[128] qh[64] int8 scales[16] fp16 d; x = d * scale_j * (q - 32)."""
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 16, 16)
    amax_index = np.abs(sub).argmax(axis=-1)
    amax = np.take_along_axis(sub, amax_index[..., None], axis=-1)[..., 0]  # signed largest
    sub_scale = amax / -32.0  # the largest value maps to q = -32, as ggml does
    d = _fp16(np.abs(sub_scale).max(axis=-1) / 127.0)
    scales = np.clip(np.round(_safe_div(sub_scale, d.astype(np.float32)[:, None])), -128, 127)
    step = d.astype(np.float32)[:, None] * scales
    q = np.clip(np.round(_safe_div(sub, step[..., None])), -32, 31).astype(np.int16) + 32
    q = q.reshape(nb, QK_K).astype(np.uint8)
    low, high = q & 0xF, q >> 4
    low = low.reshape(nb, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    high = high.reshape(nb, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6))
    return np.concatenate([ql, qh.reshape(nb, 64), scales.astype(np.int8).view(np.uint8),
                           d.reshape(nb, 1).view(np.uint8)], axis=1)


def _scales_and_mins(sub: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """For 8 sub-blocks of 32 with x = d*sc*q - dmin*m: the fp16 d and dmin, the 6-bit sc and m,
    and q in [0, levels]."""
    nb = sub.shape[0]
    low = np.minimum(sub.min(axis=-1), 0.0)
    span = sub.max(axis=-1) - low
    sub_scale, sub_min = span / levels, -low
    d = _fp16(sub_scale.max(axis=-1) / 63.0).astype(np.float32)
    dmin = _fp16(sub_min.max(axis=-1) / 63.0).astype(np.float32)
    sc = np.clip(np.round(_safe_div(sub_scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(sub_min, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    offset = dmin[:, None] * mn
    q = np.clip(np.round(_safe_div(sub + offset[..., None], step[..., None])), 0, levels)
    assert q.shape == (nb, 8, 32)
    return d, dmin, sc, mn, q.astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> ggml's 12-byte packing."""
    low_sc = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    low_mn = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    rest = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return np.concatenate([low_sc, low_mn, rest], axis=1).astype(np.uint8)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """(nb, 256) -> (nb, 144): fp16 d, fp16 dmin, scales[12], qs[128]."""
    nb = blocks.shape[0]
    d, dmin, sc, mn, q = _scales_and_mins(blocks.reshape(nb, 8, 32), 15)
    q = q.reshape(nb, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([_fp16(d).reshape(nb, 1).view(np.uint8),
                           _fp16(dmin).reshape(nb, 1).view(np.uint8),
                           _pack_k_scales(sc, mn), qs], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """(nb, 256) -> (nb, 176): fp16 d, fp16 dmin, scales[12], qh[32], qs[128]."""
    nb = blocks.shape[0]
    d, dmin, sc, mn, q = _scales_and_mins(blocks.reshape(nb, 8, 32), 31)
    low = (q & 0xF).reshape(nb, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    high = (q >> 4).astype(np.uint8)  # (nb, 8 sub-blocks, 32): bit j of qh[l] is sub-block j's
    qh = np.zeros((nb, 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([_fp16(d).reshape(nb, 1).view(np.uint8),
                           _fp16(dmin).reshape(nb, 1).view(np.uint8),
                           _pack_k_scales(sc, mn), qh, qs], axis=1)


_K_QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}
