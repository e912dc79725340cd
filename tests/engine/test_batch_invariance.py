"""Batch invariance on the real default model, at the bit level: a request's tokens and log
probabilities (its chosen tokens' and the top alternatives') are the same alone and inside any
batch; and the startup self-check that decides the promise tells the truth."""

import pytest
import torch

from ember import SamplingParams
from ember.engine import invariance
from ember.models.layers import RowPlan, linear, set_row_plan
from tests.engine.test_generate import _sibling_engine

TARGET = [{"role": "user", "content": "Why is the sky blue?"}]
SHORT = [{"role": "user", "content": "Hi"}]
LONG = [{"role": "user", "content": "Tell me a long story about a dragon who guards gold under a mountain. " * 6}]
MIXED = [[{"role": "user", "content": text}] for text in (
    "List three prime numbers.", "Translate 'good morning' into Spanish.", "Write a haiku about rain.",
    "What is the capital of Peru?", "def fibonacci(n):")]
N = 24

GREEDY = SamplingParams(temperature=0.0, max_tokens=N, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=4242, max_tokens=N, logprobs=3, ignore_eos=True)
PARTNER = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
EARLY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _bits(output):
    """Everything a request's numbers are: tokens, chosen log probabilities, top alternatives."""
    return output.token_ids, [(lp.logprob, lp.top) for lp in output.logprobs]


def _alone(llm, prompt, params):
    llm.engine.kv_manager.reset_prefix_cache()  # every run computes its prompt; none reads another's
    return _bits(llm.generate([prompt], params)[0])


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("partners, partner_params", [
    ([TARGET], PARTNER),  # a copy of itself: the same length
    ([SHORT], PARTNER),
    ([LONG], PARTNER),
    (MIXED, PARTNER),  # six prompts of mixed lengths
    ([LONG, SHORT], EARLY),  # partners that finish after three tokens: the batch shrinks mid-decode
], ids=["copy", "shorter", "longer", "six-mixed", "partners-finish-early"])
def test_a_request_keeps_its_bits_beside_any_partners(llm, params, partners, partner_params):
    alone = _alone(llm, TARGET, params)
    llm.engine.kv_manager.reset_prefix_cache()
    together = llm.generate([TARGET, *partners], [params] + [partner_params] * len(partners))
    assert _bits(together[0]) == alone


def test_a_request_keeps_its_bits_when_others_prefill_while_it_decodes(llm):
    alone = _alone(llm, TARGET, SEEDED)
    engine = llm.engine
    engine.kv_manager.reset_prefix_cache()
    engine.add_request("target", llm.encode_prompt(TARGET), SEEDED)
    tokens, logprobs = [], []

    def step():
        for out in engine.step():
            if out.request_id == "target":
                tokens.extend(out.new_token_ids)
                logprobs.extend((lp.logprob, lp.top) for lp in out.logprobs)

    for _ in range(3):
        step()
    for i, partner in enumerate([LONG, *MIXED[:2]]):
        engine.add_request(f"partner-{i}", llm.encode_prompt(partner), EARLY)
    before = len(tokens)
    step()  # the partners' prompts and the target's next token in one step
    assert len(tokens) == before + 1 and engine.scheduler.num_running == 4
    while engine.has_unfinished():
        step()
    assert (tokens, logprobs) == alone


def test_a_prompt_keeps_its_bits_however_it_is_chunked(llm):
    prompt = llm.encode_prompt(LONG)
    assert len(prompt) > 100
    whole = _alone(llm, LONG, GREEDY)
    small_budget = _sibling_engine(llm.engine, max_num_batched_tokens=48, attention_cost_tokens=0,
                                   enable_prefix_caching=False)
    small_budget.add_request("chunked", prompt, GREEDY)
    tokens, logprobs, steps = [], [], 0
    while small_budget.has_unfinished():
        steps += 1
        for out in small_budget.step():
            tokens += out.new_token_ids
            logprobs += [(lp.logprob, lp.top) for lp in out.logprobs]
    assert steps == -(-len(prompt) // 48) + N - 1  # the prompt went in several chunks, then the decodes
    assert (tokens, logprobs) == whole
    small_budget.check_invariants()


def test_the_self_check_holds_on_this_processor_and_says_how(llm):
    report = llm.engine.invariance
    assert report.holds, report.reason
    assert report.reason == f"checked on this processor: linear rows in {report.rows.describe()}"
    assert report.rows in invariance.CANDIDATE_PLANS and report.seconds > 0
    model = llm.engine.runner.model
    for layer in (m for m in model.modules() if hasattr(m, "rows")):
        assert layer.rows == (RowPlan() if layer.weights.invariant_by_construction else report.rows)


def test_the_default_model_runs_its_layers_in_one_kernel_call(llm):
    """So every bit these tests check comes from that call (tests/models/test_layer_stack.py holds
    it to the Python loop); where the kernels cannot run here, the loop serves."""
    stack = llm.engine.runner.model.model._layer_stack()
    assert (stack is not None) == llm.engine.uses_cpu_kernels


def test_turned_off_the_promise_is_not_made_and_the_model_is_left_alone(llm):
    plans = lambda: [m.rows for m in llm.engine.runner.model.modules() if hasattr(m, "rows")]
    before = plans()
    off = _sibling_engine(llm.engine, batch_invariant=False)
    assert not off.invariance.holds and off.invariance.reason == "turned off (--no-batch-invariant)"
    assert not off.runner.exact
    assert plans() == before  # the shared model keeps its plans


def _rows_move(weights, plan: RowPlan, sizes=(2, 3, 5, 8, 33, 100)) -> bool:
    """Measured directly, without the probe: does any row's result move between a lone call and a batch?"""
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(100, weights.in_features, generator=generator) * 3).to(weights.dtype)
    alone = torch.cat([linear(x[i:i + 1], weights, plan) for i in range(len(x))])
    return any(not torch.equal(torch.cat([linear(part, weights, plan) for part in x.split(size)]), alone)
               for size in sizes)


def test_the_linear_probe_rejects_only_plans_that_really_break(llm_fp32):
    """float32 matmuls (MKL) round a row differently by how many rows share the call; the probe's
    verdict on each candidate plan must agree with a direct measurement on the real weights."""
    model = llm_fp32.engine.runner.model
    report = llm_fp32.engine.invariance
    assert report.holds, report.reason
    for layer in (model.model.layers[0].mlp.down_proj, model.model.layers[-1].self_attn.qkv_proj):
        assert not _rows_move(layer.weights, report.rows)
    modules = dict(model.named_modules())
    for plan in invariance.CANDIDATE_PLANS[:invariance.CANDIDATE_PLANS.index(report.rows)]:
        verdict, broken = invariance.choose_row_plan(model, 128, 64, candidates=(plan,))
        assert verdict is None  # the chosen plan is the first that passes
        layer = model.lm_head if broken == "lm_head" else modules[broken]
        assert _rows_move(layer.weights, plan), (plan, broken)


def test_the_engine_probe_catches_a_plan_that_breaks(llm_fp32):
    engine = llm_fp32.engine
    model = engine.runner.model
    whole, _ = invariance.choose_row_plan(model, 128, 64, candidates=(RowPlan(),))
    if whole is not None:
        pytest.skip("on this processor float32 rows keep their bits in whole batches: nothing to catch")
    try:
        set_row_plan(model, RowPlan())
        assert invariance.engine_probe(engine) is not None
    finally:
        set_row_plan(model, engine.invariance.rows)
    assert invariance.engine_probe(engine) is None
    engine.check_invariants()


def test_a_request_keeps_its_bits_through_a_preemption(llm):
    """The attention kernel computes a row the same way decoded or recomputed in a prefill, so a
    request preempted (its blocks freed, its tokens recomputed later) keeps its log probabilities."""
    assert llm.engine.runner.cache.kernel_layout
    prompts = [llm.encode_prompt(chat) for chat in [TARGET, LONG, *MIXED[:3]]]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0, ignore_eos=True)
    tight = _sibling_engine(llm.engine, kv_cache_tokens=320, enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        tight.add_request(f"tight-{i}", prompt, params)
    got = {f"tight-{i}": [] for i in range(len(prompts))}
    while tight.has_unfinished():
        for out in tight.step():
            got[out.request_id] += [(lp.token_id, lp.logprob) for lp in out.logprobs or ()]
    assert tight.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        llm.engine.kv_manager.reset_prefix_cache()
        alone = llm.generate([prompt], params)[0]
        assert got[f"tight-{i}"] == [(lp.token_id, lp.logprob) for lp in alone.logprobs], i
    tight.check_invariants()
