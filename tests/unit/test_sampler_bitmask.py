"""The sampler's bitmask path: masking constraints fill one packed bitmask, applied to all rows at once."""

from __future__ import annotations

import pytest
import torch

from ember.engine import sampler as sampler_module
from ember.engine.sampler import Sampler, SamplingRow
from ember.grammar.bitmask import unpack_bitmask
from ember.types import ConstraintFailed, SamplingParams

VOCAB = 100


class AllowIds:
    """A masking constraint that allows a fixed set of ids."""

    def __init__(self, ids) -> None:
        self.ids = list(ids)
        self.calls = 0

    def fill_token_bitmask(self, output_token_ids, bitmask, row) -> bool:
        self.calls += 1
        bitmask[row] = 0
        for token_id in self.ids:
            bitmask[row, token_id // 32] |= _bit(token_id % 32)
        return True

    def allowed_token_ids(self, output_token_ids):
        return self.ids


class Failing:
    def fill_token_bitmask(self, output_token_ids, bitmask, row) -> bool:
        raise ConstraintFailed("the grammar rejected token 5")

    def allowed_token_ids(self, output_token_ids):
        raise AssertionError("not asked after a failure")


def _bit(j: int) -> int:
    return (1 << j) - (1 << 32) if j == 31 else 1 << j  # int32 two's complement for bit 31


def row(constraint=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**{"temperature": 0.0, **params}), [1, 2, 3], 3, frozenset(), constraint)


@pytest.fixture(params=["kernel", "torch"])
def kernel(request, monkeypatch):
    """Both ways of applying the bitmask: xgrammar's kernel and the plain torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(sampler_module, "_bitmask_kernel", lambda: None)
    return request.param


def test_rows_are_masked_to_their_own_bitmask(kernel):
    logits = torch.randn(3, VOCAB)
    logits[:, 50] = 100.0  # the unconstrained favourite
    sampler = Sampler(VOCAB, torch.device("cpu"))
    out = sampler(logits, [row(AllowIds([3, 7])), row(), row(AllowIds([31, 63, 64]))])
    assert out.token_ids[0] == (3 if logits[0, 3] > logits[0, 7] else 7)
    assert out.token_ids[1] == 50
    assert out.token_ids[2] == max((31, 63, 64), key=lambda t: logits[2, t].item())
    assert not out.failed


def test_sampled_rows_draw_only_allowed_ids(kernel):
    sampler = Sampler(VOCAB, torch.device("cpu"))
    draws = {sampler(torch.zeros(1, VOCAB), [row(AllowIds([2, 40, 99]), temperature=1.0, seed=s)]).token_ids[0]
             for s in range(40)}
    assert draws <= {2, 40, 99} and len(draws) > 1


def test_a_constraint_wins_over_min_tokens_suppression(kernel):
    logits = torch.randn(1, VOCAB)
    suppressed = SamplingRow(SamplingParams(temperature=0.0), [1], 1, frozenset({9}), AllowIds([9]))
    out = Sampler(VOCAB, torch.device("cpu"))(logits, [suppressed])
    assert out.token_ids == [9]


def test_a_failed_constraint_is_reported_for_its_row_only(kernel):
    logits = torch.randn(2, VOCAB)
    out = Sampler(VOCAB, torch.device("cpu"))(logits, [row(Failing()), row(AllowIds([4]))])
    assert out.failed == {0: "the grammar rejected token 5"}
    assert out.token_ids[1] == 4


def test_unpack_bitmask_reads_xgrammar_layout():
    bitmask = torch.zeros(1, 4, dtype=torch.int32)
    for token_id in (0, 31, 32, 97):
        bitmask[0, token_id // 32] |= _bit(token_id % 32)
    assert unpack_bitmask(bitmask, VOCAB)[0].nonzero().flatten().tolist() == [0, 31, 32, 97]
