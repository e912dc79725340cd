"""A GGUF file's quantized tensors as QuantBlocks (models.weights), read from the file itself.

Q4_0, Q4_1 and Q8_0 map onto ember's blocks exactly (the same codes and float16 scales, no float
round trip). Other quantized types are dequantized and quantized again in their precision
class: 4 bits for the 2-, 3- and 4-bit types, 8 bits for the 5-, 6- and 8-bit ones. Float
tensors (F32, F16, BF16) are not blocks; they come from the float weights.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ember.loaders.gguf_file import GGUFFile, GGUFModel, hf_tensor_name, unpermute_qk_rows
from ember.models.weights import QBLOCK, QuantBlocks

_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
_EIGHT_BIT_CLASS = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_1", "Q8_K"}


def read_blocks(path: pathlib.Path, hf_config: dict[str, Any]) -> Iterator[tuple[str, QuantBlocks]]:
    """(HF name, QuantBlocks) for every quantized 2-D weight of the file, q/k rows in HF order."""
    model = GGUFModel(path)
    num_layers = hf_config["num_hidden_layers"]
    heads = {".attn_q.": hf_config["num_attention_heads"], ".attn_k.": hf_config["num_key_value_heads"]}
    for name in model.tensors:
        hf_name = hf_tensor_name(name, num_layers, model.arch)
        blocks = tensor_blocks(model, name) if hf_name is not None else None
        if blocks is None:
            continue
        if model.arch == "llama":
            for part, count in heads.items():
                if part in name:
                    order = unpermute_qk_rows(torch.arange(blocks.shape[0])[:, None], count, name)[:, 0]
                    blocks = blocks.select_rows(order)
        yield hf_name, blocks


def tensor_blocks(file: GGUFFile, name: str) -> QuantBlocks | None:
    """A quantized 2-D tensor of the file as QuantBlocks; None for a float tensor, or one whose rows
    do not split into blocks."""
    tensor = file.tensors[name]
    kind = tensor.tensor_type.name
    shape = file.torch_shape(name)
    if kind in _FLOAT_TYPES or len(shape) != 2 or shape[1] % QBLOCK:
        return None
    blocks = _exact_blocks(kind, np.asarray(tensor.data), shape)
    if blocks is None:
        blocks = QuantBlocks.quantize(file.dequantize(name), 8 if kind in _EIGHT_BIT_CLASS else 4)
    return blocks


def _exact_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantBlocks | None:
    """Q4_0 (d, 16 bytes of nibbles), Q4_1 (d, m, nibbles) and Q8_0 (d, 32 signed bytes) blocks;
    a nibble byte j holds element j in its low half and element j + 16 in its high half."""
    rows, width = shape
    layout = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}.get(kind)
    if layout is None:
        return None
    data = torch.from_numpy(np.array(raw, copy=True).view(np.uint8).reshape(rows, width // QBLOCK, layout))
    scales = data[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if kind == "Q8_0":
        codes = (data[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return QuantBlocks(8, codes.reshape(rows, width), scales)
    nibbles = data[..., 4:] if kind == "Q4_1" else data[..., 2:]
    codes = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(rows, width)
    mins = data[..., 2:4].contiguous().view(torch.float16)[..., 0] if kind == "Q4_1" else scales * -8
    return QuantBlocks(4, codes, scales, mins)
