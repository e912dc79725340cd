"""CPU tensors moved onto huge pages keep their values, and the engine's block weights and KV pool
live there."""

import re
from types import SimpleNamespace

import pytest
import torch

from ember.engine.attention import KVCache
from ember.engine.host_memory import (HUGE_PAGE, ResidentPages, huge_page_bytes, huge_page_tensor,
                                     move_to_huge_pages)

advisable = pytest.mark.skipif(huge_page_bytes(64) is None, reason="huge pages are asked for on Linux, where granted")


@advisable
def test_a_region_starts_on_a_huge_page_and_is_zeroed():
    region = huge_page_bytes(3 * HUGE_PAGE + 5)
    assert region is not None and region.dtype == torch.uint8 and region.numel() == 3 * HUGE_PAGE + 5
    assert region.data_ptr() % HUGE_PAGE == 0
    assert not region.any()
    region[-1] = 7  # writable to its last byte
    assert region[-1] == 7


@advisable
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_a_tensor_on_huge_pages_has_its_shape_and_dtype_and_reads_zero(dtype):
    tensor = huge_page_tensor((3, 2, 1000, 17), dtype)
    assert tensor.shape == (3, 2, 1000, 17) and tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE == 0 and not tensor.any()
    tensor[-1, -1, -1, -1] = 5
    assert tensor[-1, -1, -1, -1] == 5 and tensor.count_nonzero() == 1
    assert huge_page_tensor((5, 7), dtype, offset=64).data_ptr() % HUGE_PAGE == 64


@advisable
def test_the_kernel_layouts_kv_pool_lies_on_huge_pages_in_groups_of_blocks():
    group = KVCache.GROUP_BLOCKS
    cache = KVCache(4, 2 * group + 8, 16, 2, 64, torch.bfloat16, torch.device("cpu"), kernel_layout=True)
    assert cache.tensor.data_ptr() % HUGE_PAGE == 64  # a cache line in, as torch's allocations start
    assert cache.tensor.shape == (3, 4, 2, 2, group, 16 * 64)  # the blocks in 3 groups
    k, v = cache.layers[1]
    assert k.shape == (3, 2, group, 16 * 64) and not cache.block(0).any()  # the null block reads zero
    data = torch.arange(4 * 2 * 2 * 16 * 64, dtype=torch.float32).view(4, 2, 2, 16 * 64).bfloat16()
    last = 2 * group + 7
    cache.write_block(last, data)
    assert torch.equal(cache.read_block(last), data) and torch.equal(v[2, :, 7], data[1, 1])
    cache.copy_blocks({5: last, last: 6})  # every source read before any is written
    assert torch.equal(cache.read_block(5), data) and not cache.read_block(last).any()
    assert cache.tensor.count_nonzero() == data.count_nonzero()
    cache.populate_ahead(last)  # making pages resident changes no byte
    cache.populate_ahead(0)
    assert torch.equal(cache.read_block(5), data) and cache.tensor.count_nonzero() == data.count_nonzero()


def _resident_bytes_of_mapping(address: int) -> int:
    """The Rss of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the address")


@advisable
@pytest.mark.parametrize("threads", [1, 2])
def test_resident_pages_are_made_resident_without_changing_a_byte(threads):
    tensor = huge_page_tensor((8 * HUGE_PAGE,), torch.uint8, offset=64)
    tensor[100] = 7
    tensor[-1] = 9
    assert _resident_bytes_of_mapping(tensor.data_ptr()) < 3 * HUGE_PAGE
    pages = ResidentPages(tensor)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pages.populate(HUGE_PAGE, 5 * HUGE_PAGE)  # runs shared out between the threads
    finally:
        torch.set_num_threads(before)
    if not pages.refused:  # Linux before 5.14 refuses the advice: then nothing is made resident
        assert _resident_bytes_of_mapping(tensor.data_ptr()) >= 5 * HUGE_PAGE
    assert tensor[100] == 7 and tensor[-1] == 9 and tensor.count_nonzero() == 2


@advisable
def test_the_pool_is_made_resident_group_by_group_a_few_pages_ahead_each_step():
    group = KVCache.GROUP_BLOCKS
    cache = KVCache(30, 3 * group, 16, 3, 64, torch.bfloat16, torch.device("cpu"), kernel_layout=True)
    group_bytes = cache.tensor[0].numel() * cache.tensor.element_size()  # 23.6 MB
    piece = KVCache.POPULATE_PAGES * torch.get_num_threads() * HUGE_PAGE
    resident = lambda: _resident_bytes_of_mapping(cache.tensor.data_ptr())  # noqa: E731
    cache.populate_ahead(3)  # the step writes into group 0: all of it now
    if cache._pages.refused:
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE")
    assert group_bytes <= resident() < group_bytes + 2 * HUGE_PAGE
    cache.populate_ahead(group // 2 - 1)  # short of the middle: nothing more
    assert resident() < group_bytes + 2 * HUGE_PAGE
    cache.populate_ahead(group // 2)  # past it: group 1 a piece at a time
    assert group_bytes + piece <= resident() < group_bytes + piece + 2 * HUGE_PAGE
    for _ in range(group_bytes // piece + 1):
        cache.populate_ahead(group - 1)
    assert 2 * group_bytes <= resident() < 2 * group_bytes + 2 * HUGE_PAGE  # never past the next group
    cache.populate_ahead(2 * group)  # a step that writes into group 2 has all of it at once
    assert resident() >= 3 * group_bytes and not cache.tensor.any()


def test_nothing_to_allocate_gives_none():
    assert huge_page_bytes(0) is None


@advisable
def test_moved_tensors_keep_values_shapes_and_dtypes_side_by_side_in_one_region():
    generator = torch.Generator().manual_seed(0)
    originals = [torch.randint(0, 256, (300, 18, 5), dtype=torch.uint8, generator=generator),
                 torch.randn(7, 3, generator=generator, dtype=torch.float32),
                 torch.randn(11, generator=generator).to(torch.bfloat16)]
    owners = [SimpleNamespace(packed=t.clone()) for t in originals]
    assert move_to_huge_pages(owners, "packed")
    for owner, original in zip(owners, originals):
        assert owner.packed.dtype == original.dtype and owner.packed.shape == original.shape
        assert torch.equal(owner.packed, original)
        assert owner.packed.is_contiguous() and owner.packed.data_ptr() % 64 == 0
    assert owners[0].packed.data_ptr() % HUGE_PAGE == 0
    starts = [owner.packed.data_ptr() for owner in owners]
    assert starts == sorted(starts) and starts[-1] - starts[0] < HUGE_PAGE  # one region, in order
    owners[1].packed.add_(1)  # writable, and only its own bytes change
    assert torch.equal(owners[1].packed, originals[1] + 1) and torch.equal(owners[2].packed, originals[2])


def test_a_strided_tensor_is_left_where_it_is():
    strided = torch.arange(20, dtype=torch.float32).view(4, 5).t()
    owners = [SimpleNamespace(packed=strided)]
    assert not move_to_huge_pages(owners, "packed")
    assert owners[0].packed is strided


@advisable
def test_the_engine_reads_its_block_weights_from_one_huge_page_region_and_keeps_its_kv_pool_on_them():
    from ember import LLM, SamplingParams, kernels
    from ember.models.layers import block_weights

    if not kernels.available():
        pytest.skip("ember's CPU kernels do not build here")
    llm = LLM(max_model_len=256, kv_cache_tokens=1024)
    assert llm.engine.runner.cache.tensor.data_ptr() % HUGE_PAGE == 64  # and its KV pool
    weights = block_weights(llm.engine.runner.model)
    starts = [w.packed.data_ptr() for w in weights]
    assert len(weights) > 1 and starts[0] % HUGE_PAGE == 0 and starts == sorted(starts)
    end = starts[-1] + weights[-1].packed.numel()
    assert end - starts[0] < sum(w.packed.numel() + 64 for w in weights)
    prompt = llm.encode_prompt([{"role": "user", "content": "Name three rivers."}])
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    on_huge_pages = llm.generate([prompt], greedy)[0].token_ids
    for w in weights:  # the same bytes in ordinary allocations
        w.packed = w.packed.clone()
    assert llm.generate([prompt], greedy)[0].token_ids == on_huge_pages
    assert len(on_huge_pages) == 24
    llm.close()

