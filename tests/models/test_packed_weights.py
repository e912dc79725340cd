"""Prepacked bfloat16 weights (the CPU decode path) give exactly the unpacked results."""

import pytest
import torch

from ember.models.layers import Linear, RowPlan, linear, pack_for_cpu
from tests.models.model_builders import build_pair
from tests.models.reference_attention import ReferenceAttention


@pytest.mark.parametrize("plan", [RowPlan(), RowPlan(2, 32)])
def test_packed_linear_gives_the_unpacked_bits(plan):
    torch.manual_seed(0)
    weight = (torch.randn(384, 1536) * 0.05).to(torch.bfloat16)
    x = torch.randn(70, 1536).to(torch.bfloat16)
    layer = Linear(1536, 384)
    layer.weight.data = weight.clone()
    if not pack_for_cpu(layer):
        pytest.skip("this torch build has no oneDNN packing ops")
    assert layer.weight.numel() == 0  # the packed copy replaced the plain weight
    layer.rows = plan
    for rows in (1, 2, 5, 31, 32, 33, 70):
        assert torch.equal(layer(x[:rows]), linear(x[:rows], weight, rows=plan)), rows


def test_a_row_plan_pads_and_tiles_without_changing_what_is_computed():
    torch.manual_seed(0)
    weight, bias = torch.randn(24, 16, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    x = torch.randn(70, 16, dtype=torch.float64)
    expected = x @ weight.T + bias
    for plan in (RowPlan(), RowPlan(8), RowPlan(1, 32), RowPlan(8, 32), RowPlan(32, 32)):
        for rows in (1, 7, 32, 33, 70):
            out = linear(x[:rows], weight, bias, rows=plan)
            assert out.shape == (rows, 24)
            torch.testing.assert_close(out, expected[:rows], rtol=1e-12, atol=1e-12)


def test_packed_model_logits_are_bit_identical(case):
    _, plain_model, config = build_pair(case, torch.bfloat16)
    _, packed_model, _ = build_pair(case, torch.bfloat16)
    head = packed_model.lm_head if config.tie_word_embeddings else None
    if not pack_for_cpu(packed_model, head=head):
        pytest.skip("this torch build has no oneDNN packing ops")
    ids = torch.randint(0, config.vocab_size, (40,))
    positions = torch.arange(40)
    outputs = []
    for model in (plain_model, packed_model):
        attn = ReferenceAttention()
        attn.set_positions(positions)
        with torch.inference_mode():
            outputs.append(model.compute_logits(model(ids, positions, attn)))
    assert torch.equal(outputs[0], outputs[1])
