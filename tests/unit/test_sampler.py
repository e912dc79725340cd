"""The batched sampler on synthetic logits (no model needed)."""

import pytest
import torch

from ember.engine.sampler import Sampler, SamplingRow
from ember.errors import InvalidRequest
from ember.types import SamplingParams

VOCAB = 50


def rows(*params, token_ids=(1, 2, 3), prompt=2, suppressed=frozenset()):
    return [SamplingRow(p, list(token_ids), prompt, suppressed) for p in params]


def logits(n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 3


def test_greedy_and_top_k_1_and_tiny_top_p_pick_the_argmax():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    x = logits(3)
    out = sampler(x, rows(SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)))
    assert out.token_ids == x.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch():
    x = logits(4, seed=3)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(VOCAB, torch.device("cpu"), seed=1)(x[2:3], rows(seeded)).token_ids[0]
    batch = Sampler(VOCAB, torch.device("cpu"), seed=2)(
        x, rows(SamplingParams(), SamplingParams(temperature=0.5), seeded, SamplingParams(top_k=5))).token_ids
    assert batch[2] == alone


def test_sampling_follows_the_distribution():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    x = torch.full((1, VOCAB), -30.0)
    x[0, 7], x[0, 9] = 0.0, torch.log(torch.tensor(3.0))  # p(7) = 0.25, p(9) = 0.75
    counts = {7: 0, 9: 0}
    for i in range(400):
        token = sampler(x, rows(SamplingParams(temperature=1.0, seed=i)))
        counts[token.token_ids[0]] += 1
    assert 60 < counts[7] < 140 and counts[7] + counts[9] == 400


def test_min_p_and_top_k_restrict_the_support():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    x = logits(1, seed=5)
    top3 = set(x[0].topk(3).indices.tolist())
    for i in range(50):
        assert sampler(x, rows(SamplingParams(top_k=3, seed=i))).token_ids[0] in top3
    probs = torch.softmax(x[0], -1)
    allowed = set(torch.nonzero(probs >= probs.max() * 0.5).flatten().tolist())
    for i in range(50):
        assert sampler(x, rows(SamplingParams(min_p=0.5, seed=i))).token_ids[0] in allowed


def test_logit_bias_suppression_and_penalties():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    x = torch.zeros(1, VOCAB)
    x[0, 3] = 5.0
    assert sampler(x, rows(SamplingParams(temperature=0.0, logit_bias={11: 100}))).token_ids == [11]
    assert sampler(x, rows(SamplingParams(temperature=0.0), suppressed=frozenset({3}))).token_ids != [3]
    # token 3 is in the output (ids 3 after a 2-token prompt): frequency penalty pushes it below 0.
    assert sampler(x, rows(SamplingParams(temperature=0.0, frequency_penalty=2.0),
                           token_ids=(1, 2, 3, 3, 3))).token_ids != [3]
    # repetition penalty divides a positive logit: 5 / 10 = 0.5 still beats the zeros.
    assert sampler(x, rows(SamplingParams(temperature=0.0, repetition_penalty=10.0))).token_ids == [3]
    assert sampler(x, rows(SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0,
                                          repetition_penalty=10.0), token_ids=(1, 2, 3, 3))).token_ids != [3]


def test_logprobs_are_the_model_distribution():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    x = logits(2, seed=9)
    out = sampler(x, rows(SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0)))
    expected = torch.log_softmax(x[0], -1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0]
    assert abs(lp.logprob - expected.max().item()) < 1e-6
    assert [t for t, _ in lp.top] == expected.topk(2).indices.tolist()
    assert out.logprobs[1] is None


def test_named_token_ids_report_their_log_probabilities():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    x = logits(2, seed=5)
    named = SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3, logprobs=0,
                           logprob_token_ids=[4, 0, 4, VOCAB + 3])
    out = sampler(x, rows(named, SamplingParams(temperature=0.0, logprobs=1)))
    expected = torch.log_softmax(x[0], dim=-1)  # the model's own, before penalty, top-k and temperature
    assert out.logprobs[0].requested[:3] == [(4, expected[4].item()), (0, expected[0].item()),
                                             (4, expected[4].item())]
    assert out.logprobs[0].requested[3] == (VOCAB + 3, float("-inf"))  # past the vocabulary
    assert out.logprobs[0].top == [] and out.logprobs[1].requested == []


def test_named_token_ids_need_logprobs():
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(logprob_token_ids=[1])
    assert caught.value.param == "logprob_token_ids"


def _hard_rows(width: int) -> torch.Tensor:
    """Rows that test an argmax: ties (the first wins), all -inf, NaN (the first NaN wins), a
    maximum in the last, partial group of sixteen, and plain noise."""
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(7))
    x[0, 3] = x[0, width - 2] = 50.0
    x[1] = float("-inf")
    x[2, width // 2] = x[2, -1] = float("nan")
    x[3, -1] = 60.0
    x[4, 0] = float("inf")
    return x


@pytest.mark.parametrize("width", [1, 17, 49152, 49155])
def test_the_cpu_argmax_kernel_gives_torch_argmax_answers(width):
    from ember import kernels

    assert kernels.available(), kernels.status()  # the suite needs a C++ compiler (see README)
    x = _hard_rows(width) if width > 4 else torch.randn(3, width)
    assert torch.equal(torch.ops.ember.argmax_rows(x), torch.argmax(x, dim=-1))
    padded = torch.cat((x, torch.full((len(x), 5), 99.0)), dim=1)[:, :width]  # rows a stride apart
    assert torch.equal(torch.ops.ember.argmax_rows(padded), torch.argmax(padded, dim=-1))


def test_a_sampler_on_the_cpu_kernel_draws_what_the_torch_sampler_draws():
    x = logits(4, seed=11)
    params = rows(SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(top_k=4, seed=5),
                  SamplingParams(temperature=1.3, top_p=0.9, seed=9))
    with_kernel = Sampler(VOCAB, torch.device("cpu"), cpu_kernel=True)
    plain = Sampler(VOCAB, torch.device("cpu"))
    assert with_kernel(x, params).token_ids == plain(x, params).token_ids
    assert with_kernel.argmax(x) == plain.argmax(x) == x.argmax(-1).tolist()


def test_a_seeded_row_draws_its_noise_once_from_its_own_generator():
    """Only rows without a seed take noise from the sampler's shared generator."""
    sampler = Sampler(VOCAB, torch.device("cpu"))
    before = sampler.generator.get_state()
    sampler(logits(3, seed=4), rows(*[SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]))
    assert torch.equal(sampler.generator.get_state(), before)
    sampler(logits(2, seed=4), rows(SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0)))
    assert not torch.equal(sampler.generator.get_state(), before)
