"""How the kernels are built: the linear kernel's vector path (AVX-512 VNNI, with AMX tiles for
32 rows and more where the processor has them, or AVX2) gives the bits of its plain C++ path (a
second copy of the kernel is built without vector instructions, under its own op namespace, and
both copies run the same products), in every block format and for rows of any width; on a
processor with AVX-512, an AVX2 copy gives them too, and so does one with AVX-VNNI where the
processor has it; on all, sums over K cut between blocks and
continued give one call's bits; SiLU and the rotary embedding give the AVX2 build's bits on
AVX-512; a build killed midway does not stall the next one; EMBER_KERNEL_TARGET picks the build's instructions and
EMBER_ATTENTION_TILES whether bfloat16 attention takes AMX tiles."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from block_formats import FORMATS, SUPER_BLOCK_FORMATS, blocks_of_format

from ember import kernels
from ember.models.weights import BlockWeights


@pytest.fixture(scope="module")
def copies() -> dict:
    """The second builds this module holds the processor's own to: the plain linear kernel wherever
    there is a vector path, and on AVX-512 the AVX2 linear kernel and row ops. Built side by side:
    each is one compiler process, so on two cores together they take about half as long."""
    assert kernels.available(), kernels.status()  # the suite needs a C++ compiler (see README)
    bits = torch.ops.ember.vector_bits()
    builds = {}
    if bits:
        builds["plain"] = kernels.plain_linear_copy
    if bits == 512:
        folder = Path(kernels.__file__).parent
        builds["avx2"] = kernels.avx2_linear_copy
        builds["avx2 row ops"] = lambda: kernels.kernel_copy(folder / "layer_ops.cpp", "ember_avx2_row_ops", "avx2")
        if "avx_vnni" in kernels.processor_flags():
            builds["avx-vnni"] = lambda: kernels.kernel_copy(folder / "linear.cpp", "ember_avx_vnni_copy", "avx-vnni")
    with ThreadPoolExecutor(max(len(builds), 1)) as pool:
        started = {name: pool.submit(build) for name, build in builds.items()}
        return {name: future.result() for name, future in started.items()}


@pytest.fixture(scope="module")
def plain_ops(copies):
    if "plain" not in copies:
        pytest.skip("this processor has no vector path: the kernels are plain C++ already")
    assert copies["plain"].vector_bits() == 0
    return copies["plain"]


@pytest.fixture(scope="module")
def avx2_ops(copies):
    if "avx2" not in copies:
        pytest.skip("this processor's own build takes the AVX2 path (or none): the test above tries it")
    assert copies["avx2"].vector_bits() == 256
    return copies["avx2"]


def check_vector_against_plain(vector_ops, plain_ops, format, dtype):
    generator = torch.Generator().manual_seed(format)
    # 200 outputs: a partial last column block; 13 column blocks: an odd one out of the pairs
    weight = torch.randn(200, 512, generator=generator) * 0.05
    weight[3, :32] = 0  # an all-zero block: scale 0
    layer = BlockWeights(blocks_of_format(weight, format), None, dtype)
    assert layer.format == format
    x = torch.randn(50, 512, generator=generator) * 3
    x[1, 32:64] = 0  # an all-zero activation block
    x[2, :32] *= 100  # codes at the int8 limits
    x = x.to(dtype)
    # every tile shape and mix of them; past 12 or 24 rows, six-bit and Q4_K blocks unpacked once;
    # from 32 rows, tiles of 16 on AMX where the processor has them and the rest on the vector tiles
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 25, 32, 50):
        vector = vector_ops.quantized_linear(x[:rows], layer.packed, 200, format)
        plain = plain_ops.quantized_linear(x[:rows], layer.packed, 200, format)
        assert torch.equal(vector, plain), rows
    ids = torch.tensor([0, 3, 15, 16, 199])
    assert torch.equal(vector_ops.block_rows(layer.packed, ids, 512, format, dtype),
                       plain_ops.block_rows(layer.packed, ids, 512, format, dtype))


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vector_linear_gives_the_plain_bits(plain_ops, format, dtype):
    check_vector_against_plain(torch.ops.ember, plain_ops, format, dtype)


@pytest.mark.parametrize("format", FORMATS)
def test_the_avx2_path_gives_the_plain_bits_too(avx2_ops, plain_ops, format):
    check_vector_against_plain(avx2_ops, plain_ops, format, torch.bfloat16)


@pytest.mark.parametrize("format", FORMATS)
def test_the_avx2_path_with_avx_vnni_gives_the_plain_bits_too(copies, plain_ops, format):
    """AVX2 with AVX-VNNI (Intel's processors since Alder Lake without AVX-512) sums a block's
    byte products with dpbusd instead of maddubs and madd: the same exact integer sums."""
    if "avx-vnni" not in copies:
        pytest.skip("no AVX-VNNI here beside AVX-512 (an AVX2 processor with it checks it as its own path)")
    assert copies["avx-vnni"].avx_vnni() and not torch.ops.ember.avx_vnni()  # the AVX-512 build's path is its own
    check_vector_against_plain(copies["avx-vnni"], plain_ops, format, torch.bfloat16)


@pytest.mark.parametrize("format", [4, 24])  # sums of whole blocks; of half blocks too
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_any_width_quantize_as_the_plain_path_does(plain_ops, format, dtype):
    """The vector path quantizes a row's activation blocks sixteen at a time: a row of 1, 3, 16,
    17 or 21 blocks (a last group short, odd or even) gives the plain path's bits, with all-zero
    blocks (scale 0), blocks at the int8 limits and values of every size among them."""
    generator = torch.Generator().manual_seed(7)
    for blocks in (1, 3, 16, 17, 21):
        K = 32 * blocks
        layer = BlockWeights(blocks_of_format(torch.randn(40, K, generator=generator) * 0.05, format), None, dtype)
        x = torch.randn(9, K, generator=generator) * torch.logspace(-3, 3, K).flip(0)
        x[1, :32] = 0
        x[2, -32:] = 0
        x[3, 5::32] *= 1e4  # one value far above the rest of each block
        x = x.to(dtype)
        vector = torch.ops.ember.quantized_linear(x, layer.packed, 40, format)
        plain = plain_ops.quantized_linear(x, layer.packed, 40, format)
        assert torch.equal(vector, plain), blocks


def test_silu_and_rotary_give_the_avx2_paths_bits(copies):
    """SiLU times up and the rotary embedding go lane by lane (the same exp polynomial, IEEE
    divisions and roundings on both paths): on a processor with AVX-512 its 16-lane loops, masked
    over a row's last lanes, give the AVX2 build's bits, zeros, infinities and NaN included."""
    if "avx2 row ops" not in copies:
        pytest.skip("this processor's own build takes the AVX2 path (or none)")
    layer_ops = copies["avx2 row ops"]
    generator = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -100.0, 100.0])
    for dtype in (torch.bfloat16, torch.float32):
        for rows, inner in ((1, 1536), (9, 1000), (5, 7)):  # a whole last vector, a partial one, less than one
            gate_up = torch.randn(rows, 2 * inner, generator=generator) * 4
            gate_up.view(-1)[:8] = special
            gate_up = gate_up.to(dtype)
            assert torch.equal(torch.ops.ember.silu_mul(gate_up).view(torch.uint8),
                               layer_ops.silu_mul(gate_up).view(torch.uint8)), (dtype, rows, inner)
        angles = torch.rand(9, 32, generator=generator) * 6.3
        q = torch.randn(9, 12, 64, generator=generator)
        q.view(-1)[:8] = special
        q, cos, sin = q.to(dtype), angles.cos().to(dtype), angles.sin().to(dtype)
        ours, theirs = q.clone(), q.clone()
        torch.ops.ember.rotary_(ours, cos, sin)
        layer_ops.rotary_(theirs, cos, sin)
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), dtype


@pytest.mark.parametrize("format", FORMATS)
def test_sums_continued_across_block_edges_give_one_calls_bits(plain_ops, format):
    """Tensor parallelism's row-parallel layers: consecutive slices of K, the first summed from
    zero and each next one continuing the sums, against one call over all of K."""
    generator = torch.Generator().manual_seed(format)
    blocks = blocks_of_format(torch.randn(200, 768, generator=generator) * 0.05, format)
    x = torch.randn(50, 768, generator=generator) * 3
    # slices of 2, 1 and 21 blocks; of whole super-blocks where the format has them
    cuts = [0, 256, 512, 768] if format in SUPER_BLOCK_FORMATS else [0, 64, 96, 768]
    slices = [BlockWeights(blocks.narrow_blocks(a // 32, b // 32), None, torch.float32)
              for a, b in zip(cuts, cuts[1:])]
    whole = BlockWeights(blocks, None, torch.float32)
    assert {part.format for part in slices} == {whole.format} == {format}
    assert torch.equal(torch.cat([part.packed for part in slices], dim=1), whole.packed)
    for ops in (torch.ops.ember, plain_ops):
        for rows in (1, 3, 5, 6, 14, 30, 50):  # 50: AMX tiles where the processor has them
            sums = torch.zeros(rows, 200)
            for (a, b), part in zip(zip(cuts, cuts[1:]), slices):
                ops.quantized_linear_accumulate_(x[:rows, a:b].contiguous(), part.packed, 200, format, sums)
            assert torch.equal(sums, ops.quantized_linear(x[:rows], whole.packed, 200, format)), (ops, rows)


@pytest.mark.parametrize("formats", [(52, 52, 120), (72, 72, 8), (4, 20)], ids=["q4k-q6k", "q5_0-q8_0", "4-20"])
def test_parts_in_layouts_of_their_own_give_each_parts_bits(plain_ops, request, formats):
    """A fused projection's parts each in its own layout, one call (quantized_linear_parts): each
    part's columns are the bits of its own call, on the vector, AVX2 and plain paths, at every
    tile shape and past the rows where blocks are unpacked; the last part may end in a partial
    column block (200 wide)."""
    generator = torch.Generator().manual_seed(len(formats))
    widths = (512, 256, 200)[:len(formats)]
    parts = [BlockWeights(blocks_of_format(torch.randn(width, 512, generator=generator) * 0.05, format, seed=i),
                          None, torch.bfloat16) for i, (format, width) in enumerate(zip(formats, widths))]
    assert [part.format for part in parts] == list(formats)
    x = (torch.randn(32, 512, generator=generator) * 3).bfloat16()
    arguments = [part.packed for part in parts], list(widths), list(formats)
    paths = [torch.ops.ember, plain_ops]
    if torch.ops.ember.vector_bits() == 512:
        paths.append(request.getfixturevalue("avx2_ops"))
    for ops in paths:
        for rows in (1, 2, 5, 9, 14, 25, 32):
            alone = torch.cat([ops.quantized_linear(x[:rows], part.packed, width, format)
                               for part, width, format in zip(parts, widths, formats)], dim=1)
            assert torch.equal(ops.quantized_linear_parts(x[:rows], *arguments), alone), (ops, rows)
    with pytest.raises(RuntimeError, match="a multiple of 16"):
        torch.ops.ember.quantized_linear_parts(x, [parts[0].packed, parts[1].packed], [504, 256], list(formats[:2]))


def test_a_lock_left_by_a_killed_build_is_cleared_and_builders_take_turns(tmp_path):
    (tmp_path / "lock").write_text("")  # torch's marker of a build in progress, its builder gone
    take = "import fcntl, sys; fcntl.flock(open(sys.argv[1], 'w'), fcntl.LOCK_EX | fcntl.LOCK_NB)"
    ours = str(tmp_path / "ember-build.lock")
    with kernels._sole_builder(tmp_path):
        assert not (tmp_path / "lock").exists()
        assert subprocess.run([sys.executable, "-c", take, ours], capture_output=True).returncode != 0
    assert subprocess.run([sys.executable, "-c", take, ours], capture_output=True).returncode == 0


def test_the_build_target_is_chosen_by_name_and_a_wrong_name_is_refused(monkeypatch):
    monkeypatch.delenv("EMBER_KERNEL_TARGET", raising=False)
    assert "-march=native" in kernels.build_flags()
    monkeypatch.setenv("EMBER_KERNEL_TARGET", "avx2")
    flags = kernels.build_flags()
    assert "-mavx2" in flags and "-march=native" not in flags and "-fopenmp" in flags
    monkeypatch.setenv("EMBER_KERNEL_TARGET", "icelake")
    assert "-march=icelake-server" in kernels.build_flags()
    monkeypatch.setenv("EMBER_KERNEL_TARGET", "no-amx")
    assert {"-march=native", "-mno-amx-tile"} <= set(kernels.build_flags())
    assert "-march=icelake-server" in kernels.build_flags("icelake")  # a target named outright wins
    monkeypatch.setenv("EMBER_KERNEL_TARGET", "avx512")
    with pytest.raises(ValueError, match="EMBER_KERNEL_TARGET='avx512'"):
        kernels.build_flags()


def _load_kernels_with(tiles: str) -> subprocess.CompletedProcess:
    script = ("import torch; from ember import kernels; assert kernels.available(), kernels.status(); "
              "print(torch.ops.ember.attention_tiles(), kernels.status())")
    env = {**os.environ, "EMBER_ATTENTION_TILES": tiles}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_attention_tiles_are_turned_off_by_name_and_a_wrong_value_is_refused():
    assert kernels.available(), kernels.status()
    off = _load_kernels_with("0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.startswith("False") and "AMX tiles for bfloat16 attention" not in off.stdout
    on = _load_kernels_with("1")
    assert on.returncode == 0, on.stderr
    has_tiles = torch.ops.ember.attention_tiles()  # this process's: the default, on where they are there
    assert on.stdout.startswith(str(has_tiles)) and ("AMX tiles for bfloat16 attention" in on.stdout) == has_tiles
    wrong = _load_kernels_with("yes")
    assert wrong.returncode != 0 and "EMBER_ATTENTION_TILES='yes'" in wrong.stderr
