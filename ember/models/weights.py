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
  Q4_1 map onto it exactly; Q4_K with integer steps, its scale and minimum once per 256), or 8-bit
  codes with a float16 scale per 32 (Q8_0 and Q5_0 exactly; Q6_K with a step per half block, its
  codes in 6 bits and its scale once per 256; Q5_K and Q5_1 with a minimum and steps, Q5_K's codes
  in 5 bits and its scale and minimum once per 256; a joined layer of mixed parts with both).
  Activations are quantized per row in blocks of 32 inside the kernel, so a layer reads 4.6 to
  9.75 bits per weight instead of 16, and its results are batch-invariant by construction.
- StackedBlockWeights: a fused layer whose parts a file holds in different types, each part in
  its own BlockWeights layout, one kernel call.

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
_SUPER = 8  # blocks per super-block (GGUF's K-quants: 256 weights)


@dataclass
class QuantBlocks:
    """A weight matrix in blocks of 32 along its input dimension, codes unpacked (one byte each).

    4 bits: w = scale * code + min, code in 0..15; with steps (GGUF's Q4_K),
    w = scale * step * code + min * min_step. 8 bits: w = scale * (code - 128); with steps (Q6_K),
    a signed step for each half of 16: w = scale * step_h * (code - 128); or with a minimum and
    steps (Q5_K, Q5_1), w = scale * step * code + min * min_step, code in 0..127; or with both
    (`with_half_steps_and_min`: any of the others), w = scale * step_h * (code - 128) + min * min_step.
    A scale (or minimum) times its integer step is exact in float32: the steps hold a file's
    sub-block scales without a rounding. `format` names the kernel's layout (ember/kernels/linear.cpp).
    """

    bits: int
    codes: torch.Tensor  # (out, in) uint8
    scales: torch.Tensor  # (out, in // 32) float16
    mins: torch.Tensor | None = None  # (out, in // 32) float16: 4 bits, or 8 bits with min_steps
    steps: torch.Tensor | None = None  # (out, in // 32) uint8, or the halves' (out, in // 16) int8 (8 bits)
    min_steps: torch.Tensor | None = None  # (out, in // 32) uint8, where both mins and steps are

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def format(self) -> int:
        """The kernel's format: 4 or 8; 20 or 24 with steps; 28 with steps and a minimum (8 bits);
        40 with the halves' steps and a minimum."""
        if self.steps is None:
            return self.bits
        if self.bits == 4:
            return 20
        if self._half_steps:
            return 24 if self.mins is None else 40
        return 28

    @property
    def _half_steps(self) -> bool:
        return self.steps is not None and self.steps.dtype == torch.int8

    def _parts(self) -> tuple[torch.Tensor | None, ...]:
        return self.scales, self.mins, self.steps, self.min_steps

    def _with_parts(self, codes: torch.Tensor, parts: list[torch.Tensor | None]) -> "QuantBlocks":
        return QuantBlocks(self.bits, codes, *parts)

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32, each weight in one rounding at most (the minimum's add): the
        kernel's lookups (block_rows) give the same bits."""
        out, width = self.codes.shape
        span = QBLOCK // 2 if self._half_steps else QBLOCK  # the codes one scale covers
        codes = self.codes.view(out, width // span, span).float()
        scales = self.scales.float().repeat_interleave(QBLOCK // span, dim=1)
        if self.steps is not None:
            scales = scales * self.steps.float()
        if self.bits == 8 and (self.mins is None or self._half_steps):
            codes = codes - 128
        if self.mins is None:
            return (codes * scales[..., None]).view(out, width)
        mins = self.mins.float() if self.min_steps is None else self.mins.float() * self.min_steps.float()
        return (codes * scales[..., None] + mins.repeat_interleave(QBLOCK // span, dim=1)[..., None]).view(out, width)

    def select_rows(self, index: torch.Tensor | slice) -> "QuantBlocks":
        return self._with_parts(self.codes[index], [None if p is None else p[index] for p in self._parts()])

    def narrow_blocks(self, first: int, stop: int) -> "QuantBlocks":
        """Blocks [first, stop) of every row: a slice of the input dimension between blocks."""
        def cut(part: torch.Tensor | None) -> torch.Tensor | None:
            if part is None:
                return None
            per_block = part.shape[1] * QBLOCK // self.codes.shape[1]
            return part[:, first * per_block:stop * per_block].contiguous()
        return self._with_parts(self.codes[:, first * QBLOCK:stop * QBLOCK].contiguous(),
                                [cut(p) for p in self._parts()])

    def with_steps(self) -> "QuantBlocks":
        """The same weights with steps of 1 where they had none (exact)."""
        if self.steps is not None:
            return self
        out, blocks = self.scales.shape
        if self.bits == 4:
            ones = torch.ones(out, blocks, dtype=torch.uint8)
            return QuantBlocks(4, self.codes, self.scales, self.mins, ones, ones.clone())
        return QuantBlocks(8, self.codes, self.scales, None, torch.ones(out, 2 * blocks, dtype=torch.int8))

    def with_half_steps_and_min(self) -> "QuantBlocks | None":
        """The same weights in format 40 (8-bit codes, a signed step for each half, a minimum with
        its step), exactly; None where a step does not fit a signed byte."""
        if self.format == 40:
            return self
        out, blocks = self.scales.shape
        if self._half_steps:
            steps = self.steps
        else:  # a step for the block, unsigned: both its halves take it
            steps = torch.ones(out, blocks, dtype=torch.uint8) if self.steps is None else self.steps
            if steps.max() > 127:
                return None
            steps = steps.to(torch.int8).repeat_interleave(2, dim=1)
        offset = self.bits == 4 or self.mins is not None  # codes without 128 added
        codes = (self.codes.to(torch.int16) + 128).to(torch.uint8) if offset else self.codes
        if self.mins is None:
            mins, min_steps = torch.zeros_like(self.scales), torch.zeros(out, blocks, dtype=torch.uint8)
        else:
            mins = self.mins
            min_steps = torch.ones(out, blocks, dtype=torch.uint8) if self.min_steps is None else self.min_steps
        return QuantBlocks(8, codes, self.scales, mins, steps, min_steps)

    @staticmethod
    def cat(parts: list["QuantBlocks"]) -> "QuantBlocks":
        """Stack along the output dimension (fused projections). Plain parts beside stepped ones of
        their family (4 and 20; 8 and 24) take steps of 1, exactly; parts of formats that share no
        family all go to format 40, exactly, or where a step does not fit it, are quantized to 8
        bits again."""
        formats = {p.format for p in parts}
        if len(formats) > 1 and not (formats <= {4, 20} or formats <= {8, 24}):
            joined = [p.with_half_steps_and_min() for p in parts]
            if all(p is not None for p in joined):
                parts = joined
            else:
                parts = [p if p.format in (8, 24) else QuantBlocks.quantize(p.dequantize(), 8) for p in parts]
        if len({p.format for p in parts}) > 1:
            parts = [p.with_steps() for p in parts]
        stacked = [None if parts[0]._parts()[i] is None else torch.cat([p._parts()[i] for p in parts])
                   for i in range(4)]
        return parts[0]._with_parts(torch.cat([p.codes for p in parts]), stacked)

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


_SIX_BITS = 64  # a six-bit layout's format: its byte format's + 64


def _code_base(format: int) -> int:
    """A byte format's lowest code a six-bit layout holds (the codes b - base in 0..63): 96 around
    the signed formats' zero of 128, 0 for Q8M's unsigned codes."""
    return 0 if format % _SIX_BITS == 28 else 96


def kernel_format(blocks: QuantBlocks) -> int:
    """The layout the kernel gets: the blocks' format; or, where the scale (and minimum) stay the
    same over each super-block of 8 blocks along every row, held once for the 8: 52 for 4-bit
    blocks with steps (a Q4_K tensor's), 60 for format 28 whose codes fit 5 bits (a Q5_K
    tensor's), 120 for format 24 whose codes fit 6 bits (a Q6_K tensor's); or, for other 8-bit
    blocks whose codes all lie in the 64 from `_code_base` (Q5_0's, Q5_1's, a mixed q/k/v's of
    Q4_K and Q6_K), their format + 64: the same arithmetic on codes held in 6 bits."""
    per_super = (blocks.format in (20, 24, 28) and _per_super_block(blocks.scales)
                 and (blocks.mins is None or _per_super_block(blocks.mins)))
    if blocks.format == 28 and per_super and int(blocks.codes.max()) < 32:
        return 60
    if blocks.bits == 8:
        base = _code_base(blocks.format)
        if not (int(blocks.codes.min()) >= base and int(blocks.codes.max()) < base + 64):
            return blocks.format
        return 120 if blocks.format == 24 and per_super else blocks.format + _SIX_BITS
    return 52 if blocks.format == 20 and per_super else blocks.format


def _per_super_block(values: torch.Tensor) -> bool:
    """Each row's values the same over each super-block of 8 blocks, bit for bit (-0.0 is not 0.0
    here), and the blocks whole super-blocks."""
    if values.shape[1] % _SUPER:
        return False
    bits = values.view(torch.int16).view(values.shape[0], -1, _SUPER)
    return bool((bits == bits[..., :1]).all())


def pack_blocks(blocks: QuantBlocks, format: int | None = None) -> torch.Tensor:
    """The kernel's layout (see ember/kernels/linear.cpp): per column block of 16 output
    rows and k block of 32 inputs, the codes arranged for 4-byte dot products (4 bits: two codes
    a byte), then the 16 scales (and minimums) as float16, then any steps, a byte each.
    (column blocks, k blocks, bytes) uint8. The six-bit formats (`kernel_format`): the codes less
    their base, the low 4 bits as 4-bit nibbles, then their high 2 bits (128 bytes), then the rest
    as in their byte format. Formats 52, 60 and 120: per column block and super-block, its 16
    scales (and minimums), then its 8 blocks' codes and steps: (column blocks, super-blocks,
    bytes); 60's codes are their low 4 bits as 4-bit nibbles, then their fifth bits (64 bytes:
    group g's at 8 g, a bit for each of its 64 codes in the nibbles' order); 120's, six-bit."""
    format = blocks.format if format is None else format
    out, width = blocks.shape
    padded = -(-out // _NBLOCK) * _NBLOCK
    pad = lambda t: F.pad(t, (0, 0, 0, padded - out))
    column_blocks, k_blocks = padded // _NBLOCK, width // QBLOCK
    # (column block, row j, k block, group g of 4, byte i) -> (column block, k block, g, j, i)
    six_bits, five_bits = format > _SIX_BITS, format == 60  # 120: six-bit codes
    codes = pad(blocks.codes - _code_base(format) if six_bits else blocks.codes)
    codes = codes.view(column_blocks, _NBLOCK, k_blocks, 8, 4)
    if blocks.bits == 4 or six_bits or five_bits:  # groups g and g + 4 share a byte
        nibbles = (codes[:, :, :, :4] & 15) | ((codes[:, :, :, 4:] & 15) << 4)
        if six_bits:  # then the high 2 bits, a byte k of two groups' pairs holding those of groups
            high = codes >> 4  # 2k, 2k + 4, 2k + 1 and 2k + 5 from its low end
            nibbles = torch.cat([nibbles, torch.stack([
                high[:, :, :, 2 * k] | high[:, :, :, 2 * k + 4] << 2 | high[:, :, :, 2 * k + 1] << 4
                | high[:, :, :, 2 * k + 5] << 6 for k in (0, 1)], dim=3)], dim=3)
        codes = nibbles
    codes = codes.permute(0, 2, 3, 1, 4).reshape(column_blocks, k_blocks, -1)
    if five_bits:  # (column block, k block, group, j * 4 + i) fifth bits, eight to a byte
        fifth = (pad(blocks.codes) >> 4).view(column_blocks, _NBLOCK, k_blocks, 8, 4).permute(0, 2, 3, 1, 4)
        weights = 1 << torch.arange(8, dtype=torch.uint8)
        plane = (fifth.reshape(column_blocks, k_blocks, 8, 8, 8) * weights).sum(-1, dtype=torch.uint8)
        codes = torch.cat([codes, plane.reshape(column_blocks, k_blocks, 64)], dim=-1)

    def halves(values: torch.Tensor) -> torch.Tensor:
        return pad(values).view(column_blocks, _NBLOCK, -1).transpose(1, 2).contiguous().view(torch.uint8)

    def steps(values: torch.Tensor, per_block: int) -> torch.Tensor:  # (out, blocks * per_block) bytes
        return (pad(values).view(column_blocks, _NBLOCK, k_blocks, per_block).permute(0, 2, 3, 1)
                .contiguous().view(torch.uint8).reshape(column_blocks, k_blocks, -1))

    if format in (52, 60, 120):
        shape = (column_blocks, k_blocks // _SUPER, -1)
        block_steps = ([steps(blocks.steps, 2)] if format == 120  # the halves' steps
                       else [steps(blocks.steps, 1), steps(blocks.min_steps, 1)])
        core = torch.cat([codes, *block_steps], dim=-1).reshape(shape)
        header = [halves(v[:, ::_SUPER]).reshape(shape) for v in (blocks.scales, blocks.mins) if v is not None]
        return torch.cat([*header, core], dim=-1).contiguous()
    parts = [codes, halves(blocks.scales)] + ([halves(blocks.mins)] if blocks.mins is not None else [])
    if blocks.steps is not None:  # the halves': each column's first halves, then its second halves
        parts.append(steps(blocks.steps, 2 if blocks.steps.dtype == torch.int8 else 1))
    if blocks.min_steps is not None:
        parts.append(steps(blocks.min_steps, 1))
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
        self.bits, self.format = blocks.bits, kernel_format(blocks)
        self.name = f"int{blocks.bits} blocks" + (" with steps" if blocks.steps is not None else "")
        self.packed = pack_blocks(blocks, self.format)
        self.bias = bias
        self.out_features, self.in_features = blocks.shape
        self.dtype = dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.ember.quantized_linear(x.contiguous(), self.packed, self.out_features, self.format)
        return y if self.bias is None else y + self.bias

    def accumulate(self, x: torch.Tensor, sums: torch.Tensor) -> None:
        # float32 activations quantize to the same blocks as bfloat16 ones (the kernel reads both as floats)
        torch.ops.ember.quantized_linear_accumulate_(x.float().contiguous(), self.packed, self.out_features,
                                                     self.format, sums)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (T,) of the weight, dequantized to (T, in) in the layer's dtype: embedding
        lookups from a tied head, without a float copy of the table."""
        return torch.ops.ember.block_rows(self.packed, ids, self.in_features, self.format, self.dtype)


class StackedBlockWeights:
    """A fused projection whose parts (q, k and v; gate and up) are blocks of layouts of their own,
    stacked along the output: one kernel call that quantizes x once and computes each part's
    columns in its layout. A file's Q4_K queries beside Q6_K values (a Q4_K_M file's) then read
    4.625 and 6.5625 bits a weight where joined (QuantBlocks.cat) they read 7.75; each part's
    columns are the bits its own BlockWeights gives."""

    name = "int blocks in parts"
    invariant_by_construction = True
    continues_sums = True

    def __init__(self, parts: list[QuantBlocks], bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.parts = [BlockWeights(part, None, dtype) for part in parts]
        self.bias = bias
        self.out_features, self.in_features = sum(p.out_features for p in self.parts), self.parts[0].in_features
        self.dtype = dtype

    @staticmethod
    def fits(parts: list[QuantBlocks]) -> bool:
        """Whether the parts keep smaller layouts apart than joined: their layouts differ (joining
        widens some) and each part but the last fills whole column blocks of 16 outputs."""
        return (len({kernel_format(part) for part in parts}) > 1
                and all(part.shape[0] % _NBLOCK == 0 for part in parts[:-1]))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.parts
        y = torch.ops.ember.quantized_linear_parts(x.contiguous(), [p.packed for p in parts],
                                                   [p.out_features for p in parts], [p.format for p in parts])
        return y if self.bias is None else y + self.bias

    def accumulate(self, x: torch.Tensor, sums: torch.Tensor) -> None:
        first = 0
        for part in self.parts:
            columns = sums[:, first:first + part.out_features]
            part_sums = columns.contiguous()
            part.accumulate(x, part_sums)
            columns.copy_(part_sums)
            first += part.out_features

