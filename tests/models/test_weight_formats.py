"""Linear-layer weight formats (models.weights): dense, oneDNN-packed bfloat16, and ember's 4- and
8-bit blocks (with and without steps) through its CPU kernel; the row plans; whole models in each
format."""

import pytest
import torch
from block_formats import FORMATS, blocks_of_format
from model_builders import build_pair
from reference_attention import ReferenceAttention

from ember import kernels
from ember.models.layers import Linear, MergedLinear, RowPlan, linear, prepare_linears
from ember.models.weights import (BlockWeights, DenseWeights, PackedBF16Weights, QuantBlocks, StackedBlockWeights,
                                  kernel_format, pack_blocks)


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    assert kernels.available(), kernels.status()  # the suite needs a C++ compiler (see README)


def _weights(out=200, width=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out, width, generator=generator) * 0.05


def _block_reference(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """float64: the kernel's arithmetic written out. Activations in blocks of 32: scale = the
    block's largest magnitude / 127, codes rounded to the nearest integer (in float32, as the
    kernel rounds them: the value times the scale's inverse)."""
    rows, width = x.shape
    xb = x.float().view(rows, width // 32, 32)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(xb * inverse).clamp(-127, 127)
    return (codes.double() * scale.double()).view(rows, width) @ blocks.dequantize().double().T


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_blocks_round_trip_within_half_a_step(bits):
    w = _weights()
    blocks = QuantBlocks.quantize(w, bits)
    assert blocks.codes.dtype == torch.uint8 and blocks.scales.shape == (200, 16)
    step = blocks.scales.float().repeat_interleave(32, dim=1)
    assert ((blocks.dequantize() - w).abs() <= 0.5 * step + 1e-6).all()


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernel_computes_the_block_arithmetic(format, dtype):
    blocks = blocks_of_format(_weights(out=200), format)  # 200 rows: a partial last column block
    layer = BlockWeights(blocks, None, dtype)
    assert layer.format == format
    x = torch.randn(9, 512).to(dtype)
    expected = _block_reference(x.float(), blocks)
    got = layer.matmul(x)
    assert got.dtype == dtype and got.shape == (9, 200)
    tolerance = 2e-6 if dtype == torch.float32 else 8e-3
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < tolerance


@pytest.mark.parametrize("bits", [4, 8])
def test_block_partial_products_continued_in_order_give_the_layers_bits(bits):
    """A row-parallel layer's ranks (models.layers.RowParallelLinear): two slices of K at a block
    edge, the second continuing the first's float32 sums, round to the whole layer's bfloat16
    bits; the two slices' products added at once do not, in some outputs."""
    weight = _weights(out=576, width=1536)
    blocks = QuantBlocks.quantize(weight, bits)
    halves = [BlockWeights(QuantBlocks.quantize(weight[:, a:b], bits), None, torch.bfloat16)
              for a, b in ((0, 768), (768, 1536))]
    x = (torch.randn(9, 1536) * 3).to(torch.bfloat16)
    in_order = torch.zeros(9, 576)
    halves[0].accumulate(x[:, :768], in_order)
    halves[1].accumulate(x[:, 768:], in_order)
    at_once = [torch.zeros(9, 576), torch.zeros(9, 576)]
    for half, sums, part in zip(halves, at_once, (x[:, :768], x[:, 768:])):
        half.accumulate(part, sums)
    whole = BlockWeights(blocks, None, torch.bfloat16).matmul(x)
    assert torch.equal(in_order.to(torch.bfloat16), whole)
    assert not torch.equal(sum(at_once), in_order)


@pytest.mark.parametrize("format", FORMATS)
def test_block_kernel_rows_keep_their_bits_in_any_batch(format):
    layer = BlockWeights(blocks_of_format(_weights(out=576, width=1536), format), None, torch.bfloat16)
    x = (torch.randn(70, 1536) * 3).to(torch.bfloat16)
    alone = torch.cat([layer.matmul(x[i:i + 1]) for i in range(70)])
    for size in (2, 3, 4, 5, 8, 33, 70):
        assert torch.equal(torch.cat([layer.matmul(part) for part in x.split(size)]), alone), size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("format", FORMATS)
def test_a_tied_table_is_looked_up_from_its_blocks(format, dtype):
    blocks = blocks_of_format(_weights(out=100), format)
    layer = BlockWeights(blocks, None, dtype)
    ids = torch.tensor([0, 15, 16, 17, 99, 16])
    assert torch.equal(layer.rows(ids), blocks.dequantize()[ids].to(dtype))
    assert layer.rows(ids[:0]).shape == (0, 512)
    with pytest.raises(RuntimeError, match="outside the table"):
        layer.rows(torch.tensor([112]))  # past the last column block's padding


@pytest.mark.parametrize("compact_format, wider_format, compact_bits, wider_bits", [
    (52, 20, 4.625, 5.5), (60, 92, 5.625, 7.5), (120, 88, 6.5625, 7)])
def test_one_scale_per_super_block_is_a_layout_not_a_change_of_bits(compact_format, wider_format, compact_bits,
                                                                     wider_bits):
    """Q4_K's blocks (steps, one scale and minimum per 8 blocks) are held with those once per 8
    (format 52): 4.625 bits a weight against 5.5, and the same bits as format 20 in every path;
    Q5_K's (their codes in 5 bits) likewise in format 60: 5.625 bits against the six-bit
    layout's 7.5; Q6_K's scale in format 120: 6.5625 bits (the file's own) against 7. Blocks whose
    scales differ within a super-block, or a width that does not split into super-blocks, keep
    the wider layout."""
    blocks = blocks_of_format(_weights(out=200, width=768), compact_format)
    compact, wider = BlockWeights(blocks, None, torch.bfloat16), BlockWeights(blocks, None, torch.bfloat16)
    wider.format, wider.packed = wider_format, pack_blocks(blocks, wider_format)
    assert compact.format == compact_format and compact.packed.numel() * 8 / (208 * 768) == compact_bits
    assert wider.packed.numel() * 8 / (208 * 768) == wider_bits
    for rows in (1, 9, 40):  # one row, a few (tiles of rows), many (each column block unpacked once)
        x = (torch.randn(rows, 768) * 3).to(torch.bfloat16)
        assert torch.equal(compact.matmul(x), wider.matmul(x)), rows
    ids = torch.tensor([0, 17, 199])
    assert torch.equal(compact.rows(ids), wider.rows(ids))
    sums = [torch.zeros(9, 200), torch.zeros(9, 200)]
    compact.accumulate(x[:9], sums[0]), wider.accumulate(x[:9], sums[1])
    assert torch.equal(*sums)
    varied = QuantBlocks(blocks.bits, blocks.codes, blocks.scales.clone(), blocks.mins, blocks.steps,
                         blocks.min_steps)
    varied.scales[5, 9] = varied.scales[5, 8] * 2
    assert kernel_format(varied) == wider_format and kernel_format(blocks.narrow_blocks(0, 12)) == wider_format
    assert kernel_format(blocks.narrow_blocks(8, 24)) == compact_format


def test_fused_shards_and_row_selection_keep_every_row():
    a, b = QuantBlocks.quantize(_weights(out=40), 4), QuantBlocks.quantize(_weights(out=24, seed=1), 4)
    both = QuantBlocks.cat([a, b])
    assert torch.equal(both.dequantize(), torch.cat((a.dequantize(), b.dequantize())))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(both.select_rows(order).dequantize(), both.dequantize()[order])


def test_fused_shards_of_several_formats_share_one():
    """A GGUF's projections fused into one layer may come in several formats (Q4_K queries and
    keys beside Q6_K values): blocks of one width join with steps, exactly; 4-bit blocks beside
    8-bit ones go to 8-bit codes with the halves' steps and a minimum (format 40), exactly too."""
    plain4, stepped4 = blocks_of_format(_weights(out=40), 4), blocks_of_format(_weights(out=24, seed=1), 20)
    joined = QuantBlocks.cat([plain4, stepped4])
    assert joined.format == 20
    assert torch.equal(joined.dequantize(), torch.cat((plain4.dequantize(), stepped4.dequantize())))
    plain8, stepped8 = blocks_of_format(_weights(out=40), 8), blocks_of_format(_weights(out=24, seed=1), 24)
    joined = QuantBlocks.cat([plain8, stepped8])
    assert joined.format == 24
    assert torch.equal(joined.dequantize(), torch.cat((plain8.dequantize(), stepped8.dequantize())))
    parts = [blocks_of_format(_weights(out=16 + 8 * i, seed=i), format) for i, format in enumerate(FORMATS)]
    mixed = QuantBlocks.cat(parts)
    assert mixed.format == 40
    assert torch.equal(mixed.dequantize(), torch.cat([part.dequantize() for part in parts]))
    layer = BlockWeights(mixed, None, torch.float32)
    x = torch.randn(3, 512)
    torch.testing.assert_close(layer.matmul(x), _block_reference(x, mixed).float(), rtol=1e-5, atol=1e-5)


def _staged(shards: list[QuantBlocks], quantization: str) -> MergedLinear:
    """A fused layer with the shards staged, given its format by prepare_linears (in a model whose
    LM head is another layer)."""
    layer = MergedLinear(shards[0].shape[1], [shard.shape[0] for shard in shards])
    for index, shard in enumerate(shards):
        layer.stage_blocks(index, shard)
    model = torch.nn.Module()
    model.layer, model.lm_head = layer, Linear(shards[0].shape[1], 16)
    model.lm_head.weight.data.zero_()
    prepare_linears(model, quantization, block_kernels=True)
    return layer


def test_a_files_fused_shards_keep_layouts_of_their_own():
    """A fused projection whose shards a file holds in different types (Q4_K queries and keys
    beside Q6_K values: layouts 52 and 120) keeps each shard's layout, 4.625 and 6.5625 bits a
    weight, where joined they take format 104's 7.75; the layer computes each shard's block
    arithmetic. Shards of one layout join; with --quantization int8 the joined blocks (8-bit
    already) serve; a first shard not a whole number of column blocks of 16 wide joins too."""
    q4k, q6k = blocks_of_format(_weights(out=64, width=512), 52), blocks_of_format(_weights(out=32, width=512), 120)
    parts = [q4k, q4k, q6k]
    layer = _staged(parts, "auto")
    weights = layer.weights
    assert type(weights) is StackedBlockWeights and [part.format for part in weights.parts] == [52, 52, 120]
    assert sum(part.packed.numel() for part in weights.parts) * 8 / (160 * 512) == pytest.approx(
        (128 * 4.625 + 32 * 6.5625) / 160)
    assert kernel_format(QuantBlocks.cat(parts)) == 104
    x = torch.randn(5, 512)
    torch.testing.assert_close(layer(x)[2].float(), _block_reference(x, q6k).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(layer(x), dim=1), _block_reference(x, QuantBlocks.cat(parts)).float(),
                               rtol=1e-5, atol=1e-5)
    sums = torch.randn(5, 160)  # sums continued part by part, each as its own layer continues them
    expected = sums.clone()
    weights.accumulate(x, sums)
    for part, (a, b) in zip(weights.parts, ((0, 64), (64, 128), (128, 160))):
        piece = expected[:, a:b].contiguous()
        part.accumulate(x, piece)
        expected[:, a:b] = piece
    assert torch.equal(sums, expected)
    same = _staged([q4k, q4k], "auto")
    assert type(same.weights) is BlockWeights and same.weights.format == 52
    assert type(_staged(parts, "int8").weights) is BlockWeights
    ragged = _staged([blocks_of_format(_weights(out=40, width=512), 52), q6k], "auto")
    assert type(ragged.weights) is BlockWeights and ragged.weights.format == 104


def test_parts_whose_steps_do_not_fit_format_40_are_quantized_to_8_bits():
    """A block's unsigned step past 127 (not a GGUF file's: theirs have 6 bits) has no signed
    byte in format 40: such a mix is quantized to plain 8-bit blocks, within half a step."""
    wide = blocks_of_format(_weights(out=24, seed=1), 20)
    wide.steps[0, 0] = 200
    values = torch.cat((wide.dequantize(), blocks_of_format(_weights(out=40), 24).dequantize()))
    mixed = QuantBlocks.cat([wide, blocks_of_format(_weights(out=40), 24)])
    assert mixed.format == 24
    step = QuantBlocks.quantize(wide.dequantize(), 8).scales.float().repeat_interleave(32, dim=1)
    assert torch.equal(mixed.dequantize()[24:], values[24:])
    assert ((mixed.dequantize()[:24] - values[:24]).abs() <= 0.5 * step + 1e-7).all()


def test_packed_bfloat16_gives_the_dense_bits_in_calls_of_up_to_32_rows():
    """Past 32 rows in one call, dense F.linear rounds otherwise on an Intel Xeon with AMX (the
    packed path does not): a row plan's 32-row tiles keep the two equal at any size."""
    if not PackedBF16Weights.supported():
        pytest.skip("no oneDNN bfloat16 packing in this torch build or on this processor")
    weight = _weights(out=384, width=1536).to(torch.bfloat16)
    packed, dense = PackedBF16Weights(weight, None), DenseWeights(weight, None)
    x = torch.randn(70, 1536).to(torch.bfloat16)
    for plan, sizes in ((RowPlan(), (1, 2, 5, 31, 32)), (RowPlan(2, 32), (1, 2, 5, 31, 32, 33, 70))):
        for rows in sizes:
            assert torch.equal(linear(x[:rows], packed, plan), linear(x[:rows], dense, plan)), (plan, rows)


def test_a_row_plan_pads_and_tiles_without_changing_what_is_computed():
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, dtype=torch.float64, generator=generator), torch.randn(24, dtype=torch.float64)
    x = torch.randn(70, 16, dtype=torch.float64, generator=generator)
    expected = x @ weight.T + bias
    for plan in (RowPlan(), RowPlan(8), RowPlan(1, 32), RowPlan(8, 32), RowPlan(32, 32)):
        for rows in (1, 7, 32, 33, 70):
            out = linear(x[:rows], DenseWeights(weight, bias), plan)
            assert out.shape == (rows, 24)
            torch.testing.assert_close(out, expected[:rows], rtol=1e-12, atol=1e-12)


def _logits(model, ids):
    attn = ReferenceAttention(model.config.layer_windows)
    attn.set_positions(torch.arange(len(ids)))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), attn))


def test_packed_model_logits_are_bit_identical(case):
    _, plain_model, config = build_pair(case, torch.bfloat16)
    _, packed_model, _ = build_pair(case, torch.bfloat16)
    counts = prepare_linears(packed_model, "auto", block_kernels=False)
    if not PackedBF16Weights.supported():
        pytest.skip("no oneDNN bfloat16 packing in this torch build or on this processor")
    assert counts == {"bfloat16 packed": sum(isinstance(m, Linear) for m in packed_model.modules())
                      + (1 if config.tie_word_embeddings else 0)}
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(plain_model, ids), _logits(packed_model, ids))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_block_quantized_models_compute_their_dequantized_weights(case, quantization):
    """Every layer in blocks (the LM head in 8 bits) against the same model with those blocks
    dequantized into dense float32 weights: what is left is the rounding of the activations to
    8-bit blocks, which moves the logits by about a percent and keeps the greedy choices."""
    _, model, config = build_pair(case)
    prepare_linears(model, quantization, block_kernels=True)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.lm_head.weights.name == "int8 blocks"
    assert all(m.weights.name == ("dense" if m.keep_float else f"{quantization} blocks")
               for m in layers if m is not model.lm_head)
    _, twin, _ = build_pair(case)
    for ours, theirs in zip([*layers, model.lm_head], [*(m for m in twin.modules() if isinstance(m, Linear)),
                                                      twin.lm_head]):
        weights = ours.weights
        if not ours.keep_float:
            theirs.weights = DenseWeights(weights.rows(torch.arange(weights.out_features)), ours.bias)
    ids = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    reference, got = _logits(twin, ids), _logits(model, ids)
    # a mixture of experts moves further: a token whose activations round differently may be routed
    # to another expert in a later layer; Gemma's embeddings, scaled by sqrt(hidden), carry the
    # activations' rounding a little further through its extra norms
    tolerance = 0.05 if "moe" in case or "gemma" in case else 0.03
    assert ((got - reference).abs().max() / reference.abs().max()).item() < tolerance
    assert (got.argmax(-1) == reference.argmax(-1)).sum().item() >= 25  # of 30 (random models have near ties)
