"""Prepacked bfloat16 weights (the CPU decode path) give exactly the unpacked results."""

import pytest
import torch

from ember.models.layers import Linear, pack_for_cpu, set_batch_invariant
from tests.models.model_builders import build_pair
from tests.models.reference_attention import ReferenceAttention


@pytest.fixture(autouse=True)
def _row_tiles():
    set_batch_invariant(True)
    yield
    set_batch_invariant(False)


def test_packed_linear_rows_equal_lone_unpacked_rows():
    torch.manual_seed(0)
    weight = (torch.randn(384, 256) * 0.05).to(torch.bfloat16)
    x = torch.randn(70, 256).to(torch.bfloat16)
    plain = torch.cat([torch.nn.functional.linear(x[r:r + 1], weight) for r in range(70)])
    layer = Linear(256, 384)
    layer.weight.data = weight.clone()
    if not pack_for_cpu(layer):
        pytest.skip("this torch build has no oneDNN packing ops")
    assert layer.weight.numel() == 0  # the packed copy replaced the plain weight
    for rows in (1, 2, 5, 31, 32, 33, 70):
        assert torch.equal(layer(x[:rows]), plain[:rows]), rows


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
