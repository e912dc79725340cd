"""Linear-layer weights, one small object per format: how they are held and applied.

A linear layer (models.layers.Linear) holds one of these and calls `matmul(x)`; models never
branch on a format. Loaders hand over float tensors or `QuantBlocks`; the engine chooses the
format once the checkpoint is loaded (`prepare_linears`).

- DenseWeights: a plain tensor through F.linear (GPUs, float32, the reference).
- PackedBF16Weights: bfloat16 prepacked once into oneDNN's blocked layout (CPU); the same bits as
  dense in calls of up to 32 rows (past that, dense rounds otherwise on an Intel Xeon with AMX),
  without a reorder of the whole weight at every call.
- BlockWeights: ember's block-quantized layouts for its CPU kernel
  (ember.kernels): 4-bit codes with a float16 scale and minimum per 32 weights (GGUF's Q4_0 and
  Q4_1 map onto it exactly), or 8-bit codes with a float16 scale per 32 (Q8_0 exactly).
  Activations are quantized per row in blocks of 32 inside the kernel, so a layer reads 5 or 8.5
  bits per weight instead of 16, and its results are batch-invariant by construction.

Dense and packed results depend on the row plan (models.layers.RowPlan); block formats do not.

`accumulate(x, sums)` adds x W^T (no bias) into float32 sums: a row-parallel layer's partial
product under tensor parallelism (models.layers.RowParallelLinear). Where `continues_sums`, a sum
over K cut between blocks and continued rank after rank gives the bits of one matmul over all of K.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

QBLOCK = 32  # weights per scale, along the input dimension
_NBLOCK = 16  # output rows per packed column block of the kernel


@dataclass
class QuantBlocks:
    """A weight matrix in blocks of 32 along its input dimension, codes unpacked (one byte each).

    4 bits: w = scale * code + min, code in 0..15. 8 bits: w = scale * (code - 128).
    """

    bits: int
    codes: torch.Tensor  # (out, in) uint8
    scales: torch.Tensor  # (out, in // 32) float16
    mins: torch.Tensor | None = None  # (out, in // 32) float16, 4 bits only

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32."""
        out, width = self.codes.shape
        codes = self.codes.view(out, width // QBLOCK, QBLOCK).float()
        scales = self.scales.float()[..., None]
        if self.bits == 4:
            values = codes * scales + self.mins.float()[..., None]
        else:
            values = (codes - 128) * scales
        return values.view(out, width)

    def select_rows(self, index: torch.Tensor) -> "QuantBlocks":
        return QuantBlocks(self.bits, self.codes[index], self.scales[index],
                           None if self.mins is None else self.mins[index])

    @staticmethod
    def cat(parts: list["QuantBlocks"]) -> "QuantBlocks":
        """Stack along the output dimension (fused projections)."""
        bits = {p.bits for p in parts}
        if len(bits) != 1:
            raise ValueError("fused projections must share one block format")
        return QuantBlocks(parts[0].bits, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           None if parts[0].mins is None else torch.cat([p.mins for p in parts]))

    @staticmethod
    def quantize(weight: torch.Tensor, bits: int) -> "QuantBlocks":
        """From float weights (out, in), in must be a multiple of 32: 4 bits with a scale and a
        minimum per block (the block's range in 15 steps), or 8 bits with a scale (its largest
        magnitude in 127 steps)."""
        out, width = weight.shape
        blocks = weight.float().reshape(out, width // QBLOCK, QBLOCK)
        if bits == 4:
            low, high = blocks.amin(-1), blocks.amax(-1)
            scales = ((high - low) / 15).to(torch.float16)
            mins = low.to(torch.float16)
            step = scales.float()[..., None]
            codes = torch.where(step > 0, torch.round((blocks - mins.float()[..., None]) / step), 0).clamp(0, 15)
            return QuantBlocks(4, codes.to(torch.uint8).view(out, width), scales, mins)
        scales = (blocks.abs().amax(-1) / 127).to(torch.float16)
        step = scales.float()[..., None]
        codes = torch.where(step > 0, torch.round(blocks / step), 0).clamp(-127, 127) + 128
        return QuantBlocks(8, codes.to(torch.uint8).view(out, width), scales)


def pack_blocks(blocks: QuantBlocks) -> torch.Tensor:
    """The kernel's layout (see ember/kernels/cpu_kernels.cpp): per column block of 16 output
    rows and k block of 32 inputs, the codes arranged for 4-byte dot products (4 bits: two codes
    a byte), then the 16 scales (and minimums) as float16. (column blocks, k blocks, bytes) uint8."""
    out, width = blocks.shape
    padded = -(-out // _NBLOCK) * _NBLOCK
    pad = lambda t: F.pad(t, (0, 0, 0, padded - out))
    column_blocks, k_blocks = padded // _NBLOCK, width // QBLOCK
    # (column block, row j, k block, group g of 4, byte i) -> (column block, k block, g, j, i)
    codes = pad(blocks.codes).view(column_blocks, _NBLOCK, k_blocks, 8, 4)
    if blocks.bits == 4:
        codes = codes[:, :, :, :4] | (codes[:, :, :, 4:] << 4)  # groups g and g + 4 share a byte
    codes = codes.permute(0, 2, 3, 1, 4).reshape(column_blocks, k_blocks, -1)

    def halves(values: torch.Tensor) -> torch.Tensor:
        return pad(values).view(column_blocks, _NBLOCK, k_blocks).transpose(1, 2).contiguous().view(torch.uint8)

    parts = [codes, halves(blocks.scales)] + ([halves(blocks.mins)] if blocks.bits == 4 else [])
    return torch.cat(parts, dim=-1).contiguous()


class DenseWeights:
    name = "dense"
    invariant_by_construction = False
    continues_sums = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def accumulate(self, x: torch.Tensor, sums: torch.Tensor) -> None:
        sums += F.linear(x, self.weight)


class PackedBF16Weights:
    name = "bfloat16 packed"
    invariant_by_construction = False
    continues_sums = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype

    @staticmethod
    @functools.cache
    def supported() -> bool:
        """Whether this torch build has the packing ops and this processor their bfloat16 path
        (oneDNN refuses it below AVX-512 or AVX-NE-CONVERT: an AVX2-only processor keeps dense)."""
        ops = torch.ops.mkldnn
        if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise")):
            return False
        try:
            ops._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
        except RuntimeError:
            return False
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def accumulate(self, x: torch.Tensor, sums: torch.Tensor) -> None:
        sums += torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class BlockWeights:
    """4- or 8-bit blocks, packed for ember's CPU kernel."""

    invariant_by_construction = True
    continues_sums = True  # the kernel sums K's blocks in order, from zero or from the sums it is given

    def __init__(self, blocks: QuantBlocks, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.bits = blocks.bits
        self.name = f"int{blocks.bits} blocks"
        self.packed = pack_blocks(blocks)
        self.bias = bias
        self.out_features, self.in_features = blocks.shape
        self.dtype = dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.ember.quantized_linear(x.contiguous(), self.packed, self.out_features, self.bits)
        return y if self.bias is None else y + self.bias

    def accumulate(self, x: torch.Tensor, sums: torch.Tensor) -> None:
        # float32 activations quantize to the same blocks as bfloat16 ones (the kernel reads both as floats)
        torch.ops.ember.quantized_linear_accumulate_(x.float().contiguous(), self.packed, self.out_features,
                                                     self.bits, sums)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (T,) of the weight, dequantized to (T, in) in the layer's dtype: embedding
        lookups from a tied head, without a float copy of the table."""
        return torch.ops.ember.block_rows(self.packed, ids, self.in_features, self.bits, self.dtype)
