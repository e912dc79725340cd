"""Each architecture at a tiny random config against transformers, in float32: full prefill,
decode steps and chunked prefill give the same logits; bfloat16 rows are batch-invariant."""

from __future__ import annotations

import torch
from model_builders import assert_logits_close, build_pair
from reference_attention import BatchAttention, ReferenceAttention

PROMPT_LEN = 70  # past original_max_position_embeddings (64) of the scaled-rope cases
DECODE_STEPS = 4


def ember_logits(model, attn: ReferenceAttention, ids: torch.Tensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[0])
    attn.set_positions(positions)
    return model.compute_logits(model(ids, positions, attn))


def reference(hf_model, vocab_size: int, length: int, seed: int = 1):
    ids = torch.randint(vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = hf_model(ids[None]).logits[0].float()  # (length, vocab)
    return ids, logits


@torch.inference_mode()
def test_prefill_then_decode_matches_transformers(case, fused):
    hf_model, model, config = build_pair(case, fused=fused)
    ids, ref = reference(hf_model, config.vocab_size, PROMPT_LEN + DECODE_STEPS)
    attn = ReferenceAttention(config.layer_windows)
    logits = ember_logits(model, attn, ids[:PROMPT_LEN], 0)
    assert logits.shape == (PROMPT_LEN, config.vocab_size)
    assert_logits_close(logits, ref[:PROMPT_LEN], case)
    for t in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        step = ember_logits(model, attn, ids[t:t + 1], t)
        assert_logits_close(step, ref[t:t + 1], case)


@torch.inference_mode()
def test_chunked_prefill_matches_transformers(case, fused):
    hf_model, model, config = build_pair(case, fused=fused)
    ids, ref = reference(hf_model, config.vocab_size, PROMPT_LEN, seed=2)
    attn = ReferenceAttention(config.layer_windows)
    for start, end in ((0, 23), (23, 50), (50, PROMPT_LEN)):
        logits = ember_logits(model, attn, ids[start:end], start)
        assert_logits_close(logits, ref[start:end], case)


@torch.inference_mode()
def test_hidden_states_are_final_normed(case):
    hf_model, model, config = build_pair(case)
    ids, _ = reference(hf_model, config.vocab_size, 9)
    attn = ReferenceAttention(config.layer_windows)
    attn.set_positions(torch.arange(9))
    hidden = model(ids, torch.arange(9), attn)
    with torch.no_grad():
        ref = hf_model.model(ids[None]).last_hidden_state[0]
    assert hidden.shape == (9, config.hidden_size)
    torch.testing.assert_close(hidden, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@torch.inference_mode()
def test_bfloat16_rows_do_not_depend_on_the_batch(case, fused):
    """A sequence's rows are bit-identical alone and flattened with another sequence, in prefill
    and in a mixed step (one sequence decoding, the other mid-prefill)."""
    hf_model, model, config = build_pair(case, torch.bfloat16, fused=fused)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(config.vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    a, b = ids[:7], ids[7:]

    alone = ReferenceAttention(config.layer_windows)
    a_prefill = ember_logits(model, alone, a, 0)
    a_step = ember_logits(model, alone, ids[29:30], 7)

    a_attn, b_attn = ReferenceAttention(config.layer_windows), ReferenceAttention(config.layer_windows)
    pos_a, pos_b = torch.arange(7), torch.arange(17)
    both = model(torch.cat((b[:17], a)), torch.cat((pos_b, pos_a)),
                 BatchAttention([(b_attn, pos_b), (a_attn, pos_a)]))
    assert torch.equal(model.compute_logits(both[17:]), a_prefill)

    pos_a, pos_b = torch.tensor([7]), torch.arange(17, 23)
    both = model(torch.cat((ids[29:30], b[17:])), torch.cat((pos_a, pos_b)),
                 BatchAttention([(a_attn, pos_a), (b_attn, pos_b)]))
    assert torch.equal(model.compute_logits(both[:1]), a_step)
