"""A GGUF file's quantized tensors as QuantBlocks (models.weights), read from the file itself.

Kept exactly, the file's own codes and scales in ember's blocks of 32: Q4_0, Q4_1 (4-bit blocks),
Q8_0 and Q5_0 (8-bit blocks), Q4_K (4-bit blocks with steps: a sub-block's 6-bit scale and
minimum are the steps of its super-block's d and dmin), Q6_K (8-bit blocks with a step for each
half: its sub-blocks of 16), Q5_K and Q5_1 (8-bit blocks with a minimum and steps, as Q4_K's).
Every other quantized type (Q2_K, Q3_K, the IQ types) is dequantized and quantized again to 4
bits, which changes its weights: a warning names them. Float tensors (F32, F16, BF16) are not
blocks; they come from the float weights.
"""

from __future__ import annotations

import logging
import pathlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ember.loaders.gguf_file import GGUFFile, GGUFModel, hf_tensor_name, unpermute_qk_rows
from ember.models.weights import QBLOCK, QuantBlocks

logger = logging.getLogger("ember.loaders")

_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
_EXACT_TYPES = {"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
_EIGHT_BIT_CLASS = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}


def read_blocks(path: pathlib.Path, hf_config: dict[str, Any]) -> Iterator[tuple[str, QuantBlocks]]:
    """(HF name, QuantBlocks) for every quantized 2-D weight of the file, q/k rows in HF order."""
    model = GGUFModel(path)
    num_layers = hf_config["num_hidden_layers"]
    heads = {".attn_q.": hf_config["num_attention_heads"], ".attn_k.": hf_config["num_key_value_heads"]}
    requantized = Counter()
    for name in model.tensors:
        hf_name = hf_tensor_name(name, num_layers, model.arch)
        blocks = tensor_blocks(model, name) if hf_name is not None else None
        if blocks is None:
            continue
        kind = model.tensors[name].tensor_type.name
        if kind not in _EXACT_TYPES:
            requantized[kind] += 1
        if model.arch == "llama":
            for part, count in heads.items():
                if part in name:
                    order = unpermute_qk_rows(torch.arange(blocks.shape[0])[:, None], count, name)[:, 0]
                    blocks = blocks.select_rows(order)
        yield hf_name, blocks
    if requantized:
        logger.warning("%s: ember's kernels do not compute %s blocks in their own format; those tensors were "
                       "dequantized and quantized again (4 bits, or 8 for the 8-bit types), so their weights "
                       "differ slightly from the file's (--quantization none keeps them exact, in floats)",
                       path.name, ", ".join(f"{kind} ({count} tensors)" for kind, count in sorted(requantized.items())))


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


_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_SUPER = 256  # the K types' elements per block


def _exact_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantBlocks | None:
    """The file's blocks of a type in _EXACT_TYPES as ember's, else None."""
    rows, width = shape
    layout = _BLOCK_BYTES.get(kind)
    span = _SUPER if kind.endswith("_K") else QBLOCK
    if layout is None or width % span:
        return None
    data = np.array(raw, copy=True).view(np.uint8).reshape(rows, width // span, layout)
    if kind in ("Q4_K", "Q5_K"):
        return _q4_k_or_q5_k(data, rows, width, five_bits=kind == "Q5_K")
    if kind == "Q6_K":
        return _q6_k(data, rows, width)
    data = torch.from_numpy(data)
    scales = _float16_at(data, 0)
    if kind == "Q8_0":
        codes = (data[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return QuantBlocks(8, codes.reshape(rows, width), scales)
    if kind in ("Q5_0", "Q5_1"):  # d (and m), 32 high bits, nibbles: w = d * (q - 16), or d * q + m
        at = 2 if kind == "Q5_0" else 4
        high = data[..., at:at + 4].contiguous().view(torch.int32)  # bit i: element i's fifth bit
        fifth = ((high >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)
        nibbles = data[..., at + 4:]
        codes = (torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1) | (fifth << 4)).reshape(rows, width)
        if kind == "Q5_0":
            return QuantBlocks(8, codes + 112, scales)
        ones = torch.ones(scales.shape, dtype=torch.uint8)
        return QuantBlocks(8, codes, scales, _float16_at(data, 2), ones, ones.clone())
    # Q4_0 (d, 16 bytes of nibbles), Q4_1 (d, m, nibbles): a nibble byte j holds element j in its
    # low half and element j + 16 in its high half
    nibbles = data[..., 4:] if kind == "Q4_1" else data[..., 2:]
    codes = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(rows, width)
    mins = _float16_at(data, 2) if kind == "Q4_1" else scales * -8
    return QuantBlocks(4, codes, scales, mins)


def _float16_at(data: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block."""
    return data[..., at:at + 2].contiguous().view(torch.float16)[..., 0]


def _q4_k_or_q5_k(data: np.ndarray, rows: int, width: int, five_bits: bool) -> QuantBlocks:
    """Q4_K: d, dmin (float16), 12 bytes of eight 6-bit scales and minimums, then 128 bytes whose
    32-byte run i holds sub-block 2i in its low nibbles and 2i + 1 in its high ones. Q5_K puts 32
    bytes before those, bit s of byte j being element j of sub-block s's fifth bit. A sub-block of
    32 is w = d * scale * q - dmin * min: one of ember's 4-bit (8-bit) blocks with steps."""
    import gguf.quants

    supers = width // _SUPER
    flat = data.reshape(-1, data.shape[-1])
    step, min_step = gguf.quants.Q4_K.get_scale_min(flat[:, 4:16])
    nibbles = flat[:, 48:] if five_bits else flat[:, 16:]
    runs = nibbles.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (runs & 0x0F).reshape(-1, 8, 32)
    if five_bits:
        q = q | (((flat[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4)
    codes = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, width))
    per_block = lambda values: torch.from_numpy(np.ascontiguousarray(values)).reshape(rows, supers * 8)
    d = torch.from_numpy(flat[:, 0:2].copy().view(np.float16)).reshape(rows, supers, 1)
    dmin = torch.from_numpy(flat[:, 2:4].copy().view(np.float16)).reshape(rows, supers, 1)
    return QuantBlocks(8 if five_bits else 4, codes, d.expand(rows, supers, 8).reshape(rows, -1),
                       (-dmin).expand(rows, supers, 8).reshape(rows, -1), per_block(step), per_block(min_step))


def _q6_k(data: np.ndarray, rows: int, width: int) -> QuantBlocks:
    """Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales, d (float16). A
    sub-block of 16 is w = d * scale * (q - 32), q of 6 bits: the half of one of ember's 8-bit
    blocks with steps (its code b = q + 96, as b - 128 = q - 32)."""
    supers = width // _SUPER
    flat = data.reshape(-1, data.shape[-1])
    low = (flat[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (flat[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = low.reshape(-1, _SUPER) | (high.reshape(-1, _SUPER) << 4)
    codes = torch.from_numpy(q + np.uint8(96)).reshape(rows, width)
    steps = torch.from_numpy(flat[:, 192:208].copy().view(np.int8)).reshape(rows, supers * 16)
    d = torch.from_numpy(flat[:, 208:210].copy().view(np.float16)).reshape(rows, supers, 1)
    return QuantBlocks(8, codes, d.expand(rows, supers, 8).reshape(rows, -1), None, steps)
