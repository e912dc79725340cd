"""Blocks of each of the kernel's formats (models.weights.QuantBlocks) from float weights, for
tests that run every format: 4 and 8 are quantized as ember quantizes; 20, 24 and 28 (with steps,
as GGUF's Q4_K, Q6_K and Q5_K are held) take random integer steps, their scales divided to keep
the weights' size; 52 is 20 with one scale and minimum per super-block of 8 blocks, as a Q4_K
tensor's (its width must be a multiple of 256 for the kernel to take that layout); 40 is 24 with a
minimum and its step as well (fused projections of mixed families); 60 is 28 whose codes fit 5
bits, with one scale and minimum per super-block, as a Q5_K tensor's (its width a multiple of 256
too); 72, 88, 92 and 104 are 8, 24, 28 and 40 whose codes lie within 64 (held in 6 bits), as
Q5_0's, Q6_K's and Q5_1's do; 120 is 88 with one scale per super-block, as a Q6_K tensor's."""

import torch

from ember.models.weights import QuantBlocks

FORMATS = [4, 8, 20, 24, 28, 40, 52, 60, 72, 88, 92, 104, 120]
SUPER_BLOCK_FORMATS = (52, 60, 120)  # their blocks' widths must be whole super-blocks of 256


def blocks_of_format(weight: torch.Tensor, format: int, seed: int = 0) -> QuantBlocks:
    if format == 120:
        blocks = blocks_of_format(weight, 88, seed)
        return QuantBlocks(8, blocks.codes, per_super_block(blocks.scales), None, blocks.steps)
    if format > 64:  # the byte format's codes squeezed into 64, the scales widened to match
        blocks = blocks_of_format(weight, format - 64, seed)
        if format == 92:  # Q8M's unsigned codes, 0..63
            codes, widen = blocks.codes // 2, 2
        else:  # around the zero's 128: 96..159
            codes, widen = (blocks.codes.to(torch.int16) - 128).div(4, rounding_mode="floor").clamp(-32, 31) + 128, 4
        return QuantBlocks(8, codes.to(torch.uint8), (blocks.scales.float() * widen).to(torch.float16),
                           blocks.mins, blocks.steps, blocks.min_steps)
    blocks = QuantBlocks.quantize(weight, 4 if format in (4, 20, 28, 52, 60) else 8)
    if format in (4, 8):
        return blocks
    generator = torch.Generator().manual_seed(seed)
    out, count = blocks.scales.shape
    scales = (blocks.scales.float() / 40).to(torch.float16)
    if format in (20, 28, 52, 60):  # 6-bit steps, as Q4_K's and Q5_K's; a minimum's step of 0 in some blocks
        steps = torch.randint(1, 64, (out, count), generator=generator, dtype=torch.uint8)
        min_steps = torch.randint(0, 64, (out, count), generator=generator, dtype=torch.uint8)
        mins = (blocks.mins.float() / 40).to(torch.float16)
        if format == 28:  # codes in bytes up to the format's 127 (Q5_K's reach 31)
            codes = blocks.codes * 8 + torch.randint(0, 8, blocks.codes.shape, generator=generator, dtype=torch.uint8)
            return QuantBlocks(8, codes, (scales.float() / 8).to(torch.float16), mins, steps, min_steps)
        if format == 60:  # Q5_K's codes, 0..31
            fifth = torch.randint(0, 2, blocks.codes.shape, generator=generator, dtype=torch.uint8)
            codes = blocks.codes * 2 + fifth
            return QuantBlocks(8, codes, per_super_block((scales.float() / 2).to(torch.float16)),
                               per_super_block(mins), steps, min_steps)
        if format == 52:
            scales, mins = per_super_block(scales), per_super_block(mins)
        return QuantBlocks(4, blocks.codes, scales, mins, steps, min_steps)
    steps = torch.randint(-128, 128, (out, 2 * count), generator=generator, dtype=torch.int8)  # signed, as Q6_K's
    if format == 40:
        mins = (scales.float() * torch.randn(out, count, generator=generator) * 100).to(torch.float16)
        min_steps = torch.randint(0, 64, (out, count), generator=generator, dtype=torch.uint8)
        return QuantBlocks(8, blocks.codes, scales, mins, steps, min_steps)
    return QuantBlocks(8, blocks.codes, scales, None, steps)


def per_super_block(values: torch.Tensor) -> torch.Tensor:
    """Each row's first value of every 8 blocks, repeated over the 8."""
    out, count = values.shape
    return values.view(out, count // 8, 8)[..., :1].expand(out, count // 8, 8).reshape(out, count)
