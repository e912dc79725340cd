"""The vision tower's bfloat16 attention kernel (ember/kernels/tower_attention.cpp) on random
tensors: as close to float32 attention as torch's bfloat16 attention is, masked keys never count,
and a query row gives the same bits alone or in a piece of any size; the SigLIP tower takes it in
bfloat16 with ember's kernels and stays on torch's attention in float32."""

import pytest
import torch
import torch.nn.functional as F

from ember import kernels
from ember.models.siglip import VisionConfig, VisionTransformer, grid_position_ids

pytestmark = pytest.mark.skipif(not kernels.available() or not hasattr(torch.ops.ember, "tower_attention"),
                                reason="the tower attention kernel needs bfloat16 dot products (AVX-512 BF16)")


def _random(rows, patches, heads, head_dim, masked, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, head_dim, generator=generator).bfloat16()
    k = (torch.randn(patches, heads, head_dim, generator=generator) * 2).bfloat16()  # peaked softmax rows
    v = torch.randn(patches, heads, head_dim, generator=generator).bfloat16()
    mask = torch.rand(patches, generator=generator) > 0.3 if masked else None
    return q, k, v, mask


def _torch_attention(q, k, v, mask, dtype):
    """(rows, heads * head_dim) in float32, torch's attention run in `dtype`."""
    out = F.scaled_dot_product_attention(*(t.to(dtype).transpose(0, 1)[None] for t in (q, k, v)),
                                         attn_mask=None if mask is None else mask[None, :])[0]
    return out.transpose(0, 1).reshape(q.shape[0], -1).float()


def _kernel(q, k, v, mask):
    k_packed, v_packed = torch.ops.ember.tower_pack_kv(k, v)
    return torch.ops.ember.tower_attention(q, k_packed, v_packed, mask, k.shape[0], q.shape[-1] ** -0.5)


def _error(out, reference):
    return ((out.float() - reference).norm() / reference.norm()).item()


# (rows, patches, heads, head_dim, masked): SmolVLM's and Gemma 3's head_dim, patches not a multiple
# of the kernel's 64-key steps, rows not a multiple of its blocks
SHAPES = [(256, 1024, 2, 64, False), (100, 729, 3, 72, True), (37, 200, 2, 72, False), (5, 64, 2, 64, True),
          (19, 130, 2, 128, True), (33, 1, 1, 80, False)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + ("-masked" if s[4] else ""))
def test_as_close_to_float32_attention_as_torch_bfloat16(shape):
    q, k, v, mask = _random(*shape, seed=sum(shape))
    reference = _torch_attention(q, k, v, mask, torch.float32)
    out = _kernel(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and out.shape == (q.shape[0], q.shape[1] * q.shape[2])
    torch_error = _error(_torch_attention(q, k, v, mask, torch.bfloat16), reference)
    assert _error(out, reference) <= 2 * torch_error, (_error(out, reference), torch_error)


def test_masked_keys_never_count():
    q, k, v, mask = _random(40, 300, 2, 72, masked=True, seed=1)
    mask[:64] = False  # a whole step of hidden keys too
    out = _kernel(q, k, v, mask)
    other_k, other_v = k.clone(), v.clone()
    other_k[~mask] = 1000
    other_v[~mask] = -1000
    assert torch.equal(_kernel(q, other_k, other_v, mask), out)
    visible = _torch_attention(q, k[mask], v[mask], None, torch.float32)
    assert _error(out, visible) <= 2 * _error(_torch_attention(q, k[mask], v[mask], None, torch.bfloat16), visible)


@pytest.mark.parametrize("masked", [False, True])
def test_a_row_gives_the_same_bits_alone_or_in_any_piece(masked):
    q, k, v, mask = _random(256, 500, 2, 72, masked, seed=2)
    piece = _kernel(q, k, v, mask)
    k_packed, v_packed = torch.ops.ember.tower_pack_kv(k, v)
    for start, rows in [(0, 1), (3, 1), (255, 1), (5, 2), (7, 3), (10, 5), (31, 2), (100, 37)]:
        alone = torch.ops.ember.tower_attention(q[start:start + rows], k_packed, v_packed, mask, 500, 72 ** -0.5)
        assert torch.equal(alone, piece[start:start + rows]), (start, rows)


def _tower(dtype, fused):
    config = VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                          image_size=160, patch_size=16)
    tower = VisionTransformer(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in tower.named_parameters():
            scale = parameter.shape[-1] ** -0.5 if parameter.dim() > 1 else 0.1
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale + name.endswith("norm.weight"))
    for module in tower.modules():
        if hasattr(module, "fused"):
            module.fused = fused
    return tower.to(dtype).eval()


@pytest.mark.parametrize("padded", [False, True])
def test_the_tower_takes_the_kernel_in_bfloat16_only(padded):
    pixels = torch.randn(3, 160, 160, generator=torch.Generator().manual_seed(4))
    positions = grid_position_ids(100, pixels.device)
    key_mask = (torch.arange(100) % 10 < 7) if padded else None  # 7 of 10 patch columns hold pixels
    reference = _tower(torch.float32, fused=False)(pixels, positions, key_mask)
    assert torch.equal(_tower(torch.float32, fused=True)(pixels, positions, key_mask), reference)
    torch_bf16 = _tower(torch.bfloat16, fused=False)(pixels, positions, key_mask)
    kernel_bf16 = _tower(torch.bfloat16, fused=True)(pixels, positions, key_mask)
    assert not torch.equal(kernel_bf16, torch_bf16)  # a path of its own
    assert _error(kernel_bf16, reference) <= 2 * _error(torch_bf16, reference)
