"""CPU tensors moved onto huge pages keep their values, and the engine's block weights live there."""

from types import SimpleNamespace

import pytest
import torch

from ember.engine.host_memory import HUGE_PAGE, huge_page_bytes, move_to_huge_pages

advisable = pytest.mark.skipif(huge_page_bytes(64) is None, reason="huge pages are asked for on Linux, where granted")


@advisable
def test_a_region_starts_on_a_huge_page_and_is_zeroed():
    region = huge_page_bytes(3 * HUGE_PAGE + 5)
    assert region is not None and region.dtype == torch.uint8 and region.numel() == 3 * HUGE_PAGE + 5
    assert region.data_ptr() % HUGE_PAGE == 0
    assert not region.any()
    region[-1] = 7  # writable to its last byte
    assert region[-1] == 7


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
def test_the_engine_reads_its_block_weights_from_one_huge_page_region():
    from ember import LLM, SamplingParams, kernels
    from ember.models.layers import block_weights

    if not kernels.available():
        pytest.skip("ember's CPU kernels do not build here")
    llm = LLM(max_model_len=256, kv_cache_tokens=1024)
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

