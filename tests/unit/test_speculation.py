"""Speculative decoding's logic at toy sizes: n-gram lookup, draft lengths, and how the scheduler
pays for drafts and rolls back the ones the model rejects (block_size 4, no torch)."""

from __future__ import annotations

import pytest

from ember.config import BATCH_TUNED_DRAFT_TOKENS, MAX_TUNED_DRAFT_TOKENS, SpeculativeConfig
from ember.engine.spec.ngram import LONGEST_MATCH, NgramIndex
from ember.engine.spec.speculator import Lookups, NgramProposer, Speculator
from ember.engine.spec.tuning import DraftingGate, DraftLength, StepCost, best_draft_length
from ember.engine.request import RequestStatus
from tests.unit.test_scheduler import make_request, make_scheduler  # noqa: F401 (fixture)


def test_ngram_lookup_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    # the suffix 1 2 3 last occurred at 5..7, followed by 4 5 6
    assert index.propose(tokens, 3) == ([4, 5, 6], 3)  # and the matched length
    assert index.propose(tokens + [4], 2) == ([5, 6], 4)  # the index grows with the sequence
    assert NgramIndex(2, 4).propose([5, 6, 7, 8], 3) == ([], 0)  # no earlier occurrence
    assert NgramIndex(2, 2).propose([7, 8, 1, 7, 8], 4) == ([1, 7, 8], 2)  # what exists up to the end
    # a longer suffix wins over a more recent shorter one
    assert NgramIndex(1, 3).propose([4, 1, 2, 10, 11, 2, 12, 4, 1, 2], 1) == ([10], 3)


def test_ngram_lookup_takes_the_occurrence_that_matches_furthest_back():
    # "2 3" last occurred before 8, but the earlier one before 7 shares "1" with the suffix too
    assert NgramIndex(1, 2).propose([1, 2, 3, 7, 5, 2, 3, 8, 9, 1, 2, 3], 2) == ([7, 5], 3)
    # a file of repeated lines: the 4-gram recurs everywhere; the line being copied is the one
    # whose earlier lines match, and the match is followed back up to LONGEST_MATCH tokens
    lines = [[10 + i, 1, 2, 3, 4, 5] for i in range(40)]
    text = [t for line in lines for t in line]
    copy = text + [0] + text[:6 * 20]  # the copy has reached line 20
    drafts, matched = NgramIndex(1, 4).propose(copy, 6)
    assert drafts == lines[20] and matched == LONGEST_MATCH


def test_ngram_evidence_keeps_short_matches_apart_and_groups_long_ones():
    proposer = NgramProposer(1, 4)
    assert [proposer._evidence(n) for n in (1, 4, 5, 7, 8, 15, 16, 64)] == [1, 4, 5, 5, 8, 8, 16, 64]
    assert [NgramProposer(1, 8)._evidence(n) for n in (8, 9, 15, 16)] == [8, 9, 9, 16]


def test_a_lone_stream_may_draft_further_than_a_batch():
    class Recording(NgramProposer):
        def propose(self, wants):
            self.asked = [n for _, n in wants]
            return super().propose(wants)

    proposer = Recording(1, 4)
    speculator = Speculator(SpeculativeConfig(mode="ngram"), proposer, max_model_len=4096)
    requests = [make_request(f"r{i}", list(range(100)) * 2, max_tokens=500) for i in range(2)]
    for request in requests:
        request.num_computed_tokens = request.num_tokens - 1
    speculator.propose(requests[:1])
    assert proposer.asked == [MAX_TUNED_DRAFT_TOKENS]
    speculator.propose(requests)
    assert proposer.asked == [BATCH_TUNED_DRAFT_TOKENS] * 2 and BATCH_TUNED_DRAFT_TOKENS < MAX_TUNED_DRAFT_TOKENS


def test_a_tuned_draft_grows_with_what_is_accepted_and_pauses_when_nothing_is():
    length = DraftLength(None)
    first = length.next()
    for _ in range(4):
        drafted = length.next()
        length.record(drafted, drafted)
    assert length.next() > first
    for _ in range(80):  # every draft fails: p falls until drafting no longer pays, then it pauses
        drafted = length.next()
        if not drafted:
            break
        length.record(drafted, 0)
    assert drafted == 0 and length.next() == 0
    fixed = DraftLength(3)
    fixed.record(3, 0)
    assert fixed.next() == 3


def test_the_draft_length_follows_what_a_row_costs():
    """Rows nearly free (one stream on a CPU): draft long; rows at their share (a big batch):
    only what is nearly sure; a cost fitted from steps of different sizes."""
    assert best_draft_length([0.7] * 8, 1, (1.0, 0.03, 0.0, 0.0), 8) >= 6
    assert best_draft_length([0.7] * 8, 32, (1.0, 0.1, 0.0, 0.0), 8) == 0
    assert best_draft_length([0.97] * 8, 32, (1.0, 0.1, 0.0, 0.0), 8) > 0
    assert best_draft_length([0.0] * 8, 1, (1.0, 0.03, 0.0, 0.0), 8) == 0
    # a draft model's own steps: worth it alone, not beside 8 streams; a round's fixed cost
    # makes longer drafts pay
    assert best_draft_length([0.8] * 8, 1, (1.0, 0.03, 0.0, 0.35), 8) > 0
    assert best_draft_length([0.8] * 8, 8, (1.0, 0.04, 0.0, 0.35), 8) == 0
    assert best_draft_length([0.9] * 8, 1, (1.0, 0.03, 0.5, 0.2), 8) > best_draft_length([0.9] * 8, 1, (1.0, 0.03, 0.0, 0.4), 8)
    cost = StepCost()
    assert cost.coefficients() == (1.0, 0.05, 0.0, 0.0)
    for rows in [1, 3, 1, 5, 9, 1, 2]:
        cost.observe(rows, 0.010 + 0.0005 * rows)
    a, b, _, _ = cost.coefficients()
    assert abs(a - 0.010) < 1e-6 and abs(b - 0.0005) < 1e-7
    steady = StepCost()
    steady.observe(8, 0.014)  # one size only: the slope comes from the prior share
    a, b, _, _ = steady.coefficients()
    assert abs(a + 8 * b - 0.014) < 1e-9 and abs(b / a - 0.05) < 1e-9


def _verify(scheduler, drafts: dict[str, list[int]], sampled: dict[str, list[int]]):
    """One step in which the requests carry drafts; `sampled` are the tokens the model drew."""
    for request in scheduler.running:
        request.draft_token_ids = list(drafts.get(request.request_id, []))
    output = scheduler.schedule()
    accepted = {}
    for entry in output.scheduled:
        tokens, draft = sampled[entry.request.request_id], entry.draft_token_ids
        accepted[entry.request.request_id] = next((i for i, (t, d) in enumerate(zip(tokens, draft)) if t != d),
                                                  min(len(tokens), len(draft)))
    scheduler.update_from_output(output, sampled, accepted)
    return output


def test_rejected_drafts_roll_back_their_kv_and_only_accepted_tokens_are_hashed(make_scheduler):
    scheduler = make_scheduler(num_blocks=16)
    request = make_request("r", [1, 2, 3], max_tokens=20)
    scheduler.add_request(request)
    _verify(scheduler, {}, {"r": [4]})  # the prompt; the first token
    assert (request.num_tokens, request.num_computed_tokens, len(request.block_ids)) == (4, 3, 1)
    # six drafts (positions 4..9, three blocks' worth), the model keeps two and draws its own third
    output = _verify(scheduler, {"r": [5, 6, 7, 8, 9, 10]}, {"r": [5, 6, 70]})
    assert output.scheduled[0].num_new_tokens == 7 and output.num_scheduled_tokens == 7
    assert request.token_ids == [1, 2, 3, 4, 5, 6, 70]
    assert request.num_computed_tokens == 6  # 4's KV and the kept drafts' (5, 6); 70 is next
    assert len(request.block_ids) == 2  # the block only the rejected drafts reached went back
    assert len(request.block_hashes) == 1  # block 0 (1 2 3 4) full and final; block 1 not yet full
    scheduler.kv_cache.check_invariants()
    # all drafts kept: the model's extra token is the bonus
    _verify(scheduler, {"r": [71, 72]}, {"r": [71, 72, 73]})
    assert request.token_ids[-4:] == [70, 71, 72, 73] and request.num_computed_tokens == request.num_tokens - 1
    assert len(request.block_hashes) == 2


def test_a_stop_inside_a_round_drops_the_tokens_after_it(make_scheduler):
    scheduler = make_scheduler()
    request = make_request("r", [1, 2, 3], max_tokens=20, eos=(99,))
    scheduler.add_request(request)
    _verify(scheduler, {}, {"r": [4]})
    _verify(scheduler, {"r": [5, 6, 7]}, {"r": [5, 99]})  # the model ends where the draft said 6
    assert request.status is RequestStatus.FINISHED_STOPPED and request.output_token_ids == [4, 5, 99]


def test_drafts_are_paid_from_the_budget_and_never_preempt(make_scheduler):
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=4)  # 3 usable blocks of 4
    request = make_request("r", [1, 2, 3], max_tokens=20)
    scheduler.add_request(request)
    _verify(scheduler, {}, {"r": [4]})
    output = _verify(scheduler, {"r": [5, 6, 7, 8, 9, 10]}, {"r": [5, 6, 7, 8]})
    assert output.scheduled[0].num_new_tokens == 4  # the budget paid for the own token and three drafts
    other = make_request("o", [1, 1, 1, 1, 1], max_tokens=2)
    scheduler.add_request(other)
    _verify(scheduler, {}, {"r": [9], "o": [2]})
    # 2 blocks for r and 2 for o's prompt would need 4: r's drafts are dropped rather than preempting o
    output = _verify(scheduler, {"r": [10, 11, 12, 13]}, {"r": [10], "o": [3]})
    assert all(not entry.draft_token_ids for entry in output.scheduled)
    assert {r.request_id for r in scheduler.running} <= {"r", "o"}
    scheduler.finish_requests(["r", "o"], RequestStatus.FINISHED_ABORTED)


def test_the_speculator_drafts_within_the_reply_limit_and_before_end_tokens():
    speculator = Speculator(SpeculativeConfig(mode="ngram", draft_tokens=8), NgramProposer(1, 2), max_model_len=64)
    request = make_request("r", [5, 6, 7, 99, 8, 5, 6], max_tokens=4, eos=(99,))
    request.num_computed_tokens = request.num_tokens - 1
    speculator.propose([request])
    assert request.draft_token_ids == [7]  # 7 99 8 follows "5 6": cut before the end token 99
    request.token_ids += [1, 5, 6]  # three of four output tokens written
    request.num_computed_tokens = request.num_tokens - 1
    speculator.propose([request])
    assert request.draft_token_ids == []  # one token left: nothing to draft
    serial = make_request("s", [5, 6, 7, 8, 5, 6], max_tokens=9, draft=False)
    serial.num_computed_tokens = serial.num_tokens - 1
    speculator.propose([serial])
    assert serial.draft_token_ids == []


@pytest.mark.parametrize("mode, draft_tokens", [("fast", None), ("ngram", 9), ("ngram", 0)])
def test_bad_speculative_settings_are_refused(mode, draft_tokens):
    with pytest.raises(ValueError):
        SpeculativeConfig(mode=mode, draft_tokens=draft_tokens)


def test_the_gate_drafts_where_drafting_made_more_tokens_per_second():
    gate = DraftingGate()
    choices = []
    for _ in range(40):  # one stream: drafted steps make 3 tokens in 12 ms, plain ones 1 in 10 ms
        drafts = gate.allows(1)
        choices.append(drafts)
        gate.observe(1, drafts, 3 if drafts else 1, 0.012 if drafts else 0.010)
    assert choices[:3] == [True] * 3 and choices[3:6] == [False] * 3  # each way tried first
    assert sum(choices[6:]) >= len(choices[6:]) - 3  # then drafting, with a rare look at the other way
    for _ in range(40):  # eight streams: drafted steps are slower than what they gain
        drafts = gate.allows(8)
        gate.observe(8, drafts, 9 if drafts else 8, 0.030 if drafts else 0.015)
    assert sum(gate.allows(8) for _ in range(32)) <= 2  # the other batch size keeps its own verdict
    assert gate.allows(1)


def test_the_gate_looks_at_a_losing_way_ever_more_rarely_and_notices_when_it_starts_winning():
    gate = DraftingGate()
    drafted_steps = 0
    for _ in range(2000):  # a draft model beside a full batch: a drafted step costs three plain ones
        drafts = gate.allows(8)
        drafted_steps += drafts
        gate.observe(8, drafts, 10 if drafts else 8, 0.045 if drafts else 0.015)
    # 3 first steps, then looks after 16, 32, 64, 128 and every 256 steps: about 1% of the steps
    assert drafted_steps <= 14
    choices = []
    for _ in range(600):  # the text turns repetitive: drafted steps now make twice the tokens per second
        drafts = gate.allows(8)
        choices.append(drafts)
        gate.observe(8, drafts, 24 if drafts else 8, 0.020 if drafts else 0.015)
    assert sum(choices[-100:]) >= 97  # noticed at the next look, and kept (with its own rare looks back)


def test_each_draft_position_is_learnt_apart_since_copies_run_on_or_break_at_once():
    length = DraftLength(None)
    for round_index in range(40):  # half the rounds keep all 8 drafts, half break at the first
        length.record(8, 8 if round_index % 2 else 0)
    holds = length.holds()
    assert 0.4 < holds[0] < 0.6 and min(holds[1:8]) > 0.9
    assert holds[8] > 0.9  # not reached yet: as likely as the position before it
    # a geometric guess (p = 8 / 9 per token) would draft long as well; a round that reached 8
    # tokens every time it started is worth a long draft even at one chance in two to start
    assert best_draft_length(holds, 1, (1.0, 0.05, 0.0, 0.0), 16) >= 8


def test_a_position_not_reached_for_a_while_forgets_an_old_miss():
    length = DraftLength(None)
    length.record(8, 3)  # an early round breaks at its fourth draft...
    early = length.holds()[3]
    for _ in range(30):  # ...then rounds of three drafts hold every time, never reaching the fourth
        length.record(3, 3)
    holds = length.holds()
    assert early < 0.6 and holds[3] > 0.9  # the old miss has faded: as likely as the position before
    assert best_draft_length(holds, 1, (1.0, 0.05, 0.0, 0.0), 16) > 3


def test_a_lookup_teaches_how_far_it_held_past_what_was_drafted():
    estimate = DraftLength(None)
    lookups = Lookups()
    tokens = [1, 2, 3]
    lookups.add(len(tokens), [4, 5, 6, 7, 8, 9], estimate)  # drafted from or not, it is judged alike
    before = estimate.holds()
    tokens += [4, 5, 6]
    lookups.settle(tokens)
    part = estimate.holds()
    assert part[0] > before[0] and min(part[:3]) > 0.6  # three have come and held: learnt at once
    tokens += [7, 8, 9]
    lookups.settle(tokens)
    held_all = estimate.holds()
    assert held_all[:3] == part[:3]  # learnt once, not again when the rest come
    assert min(held_all[:6]) > 0.6  # every position held
    whole = DraftLength(None)
    whole.record(6, 6)
    assert held_all == whole.holds()  # in parts as in one round
    lookups.add(len(tokens), [1, 2, 3, 4], estimate)
    tokens += [1, 2, 0]  # breaks at its third token, before its fourth has come
    lookups.settle(tokens)
    assert estimate.holds()[2] < held_all[2]
    lookups.add(len(tokens), [5, 6, 7], estimate)
    tokens += [5]
    lookups.settle(tokens, ended=True)  # the request ended: held as far as it went
    settled = estimate.holds()
    assert settled[0] > 0.6
    lookups.settle(tokens + [6, 7], ended=True)
    assert estimate.holds() == settled  # each lookup is counted once


def test_a_new_evidence_drafts_long_within_steps_of_a_long_copy():
    """A copy's first lookups on a new evidence are drafted short (the prior); once a few of their
    tokens have held, the next step drafts long, without waiting for the whole lookup to come."""
    estimate = DraftLength(None)
    lookups = Lookups()
    copy = list(range(100, 132))
    tokens = [1, 2, 3]
    cost = (1.0, 0.1, 0.0, 0.0)
    first = estimate.next(1, cost)
    lookups.add(len(tokens), copy, estimate)
    tokens += copy[:first + 1]  # the round's drafts held, and the step's own token too
    lookups.settle(tokens)
    lookups.add(len(tokens), copy[first + 1:], estimate)
    assert estimate.next(1, cost) > 2 * first
