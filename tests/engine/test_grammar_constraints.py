"""Grammar constraints inside the engine's batched sampling step, on the real default model."""

from __future__ import annotations

import json
import re

import pytest

from ember.grammar.compiler import Grammars
from ember.grammar.constraint import GrammarConstraint
from ember.protocols.structured import choice_spec, json_schema_spec, regex_spec
from ember.types import FinishReason, SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def grammars(llm) -> Grammars:
    return Grammars(llm.tokenizer.hf, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)


def constraint(grammars: Grammars, llm, spec, cls=GrammarConstraint) -> GrammarConstraint:
    return cls(grammars.matcher(grammars.compile(spec)), grammars.vocab_size, llm.tokenizer.token_bytes,
               grammars.stop_token_ids)


def run(llm, requests):
    """Run requests together; (output token ids, (finish reason, error)) by id."""
    outputs = {rid: [] for rid in requests}
    ends = {}
    for rid, (prompt, params, rule) in requests.items():
        llm.engine.add_request(rid, prompt, params, constraint=rule)
    while llm.engine.has_unfinished():
        for step in llm.engine.step():
            outputs[step.request_id] += step.new_token_ids
            if step.finish_reason is not None:
                ends[step.request_id] = (step.finish_reason, step.error)
    return outputs, ends


def prompt_of(llm, text: str) -> list[int]:
    return llm.encode_prompt([{"role": "user", "content": text}])


def test_constrained_and_unconstrained_requests_in_one_batch_equal_their_solo_runs(llm, grammars):
    cases = {
        "json": ("Give me a person as JSON.", lambda: constraint(grammars, llm, json_schema_spec(PERSON, "x"))),
        "regex": ("Give a phone number.", lambda: constraint(grammars, llm, regex_spec(r"\d{3}-\d{4}", "x"))),
        "choice": ("Is the sky blue?", lambda: constraint(grammars, llm, choice_spec(["yes", "no"], "x"))),
        "plain": ("Name three rivers.", lambda: None),
        "plain2": ("Write a haiku.", lambda: None),
    }
    solo = {}
    for rid, (text, make) in cases.items():
        out, ends = run(llm, {rid: (prompt_of(llm, text), GREEDY, make())})
        solo[rid] = out[rid]
        assert ends[rid][0] in (FinishReason.STOP, FinishReason.LENGTH)
    together, ends = run(llm, {rid: (prompt_of(llm, text), GREEDY, make()) for rid, (text, make) in cases.items()})
    assert together == solo
    text = {rid: llm.tokenizer.decode(ids) for rid, ids in together.items()}
    person = json.loads(text["json"])
    assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120
    assert re.fullmatch(r"\d{3}-\d{4}", text["regex"])
    assert text["choice"] in ("yes", "no")
    assert ends["json"][0] == FinishReason.STOP, "the end token came once the value was complete"


def test_a_reply_cut_by_max_tokens_is_length_and_may_be_incomplete(llm, grammars):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    out, ends = run(llm, {"cut": (prompt_of(llm, "Give me a person as JSON."), params,
                                  constraint(grammars, llm, json_schema_spec(PERSON, "x")))})
    assert ends["cut"] == (FinishReason.LENGTH, None)
    assert len(out["cut"]) == 4


def test_the_end_token_is_allowed_only_where_the_grammar_is_complete(llm, grammars):
    eos = sorted(llm.engine.eos_token_ids)
    rule = constraint(grammars, llm, regex_spec("ab?", "x"))
    at_start = rule.allowed_token_ids([])
    assert not set(eos) & set(at_start)
    a = llm.tokenizer.encode("a")
    after_a = rule.allowed_token_ids(a)
    assert set(eos) <= set(after_a)
    assert rule.completed


class UnmaskedGrammar(GrammarConstraint):
    """Follows the grammar but never masks: the model soon writes a token the grammar rejects."""

    def fill_token_bitmask(self, output_token_ids, bitmask, row) -> bool:
        self._catch_up(output_token_ids)
        return False

    def allowed_token_ids(self, output_token_ids):
        self._catch_up(output_token_ids)
        return None


def test_a_grammar_failure_ends_that_request_alone_with_an_error(llm, grammars):
    plain = prompt_of(llm, "Name three rivers.")
    alone, _ = run(llm, {"plain": (plain, GREEDY, None)})
    failing = constraint(grammars, llm, regex_spec("[0-9]{30}", "x"), cls=UnmaskedGrammar)
    out, ends = run(llm, {"plain": (plain, GREEDY, None),
                          "failing": (prompt_of(llm, "Write a poem."), GREEDY, failing)})
    reason, error = ends["failing"]
    assert reason == FinishReason.ERROR and "grammar rejected token" in error
    assert out["plain"] == alone["plain"] and ends["plain"][1] is None
    llm.engine.check_invariants()
