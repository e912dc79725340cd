"""/v1/systemone validation, prompt rendering and the answer arithmetic: pure logic."""

from __future__ import annotations

import json
import math

import pytest

from ember.errors import InvalidRequest
from ember.protocols import systemone
from ember.protocols.neutral import ModelInfo
from ember.protocols.systemone import (
    choice_confidence, dump_json, first_best, label_probabilities, parse_systemone, prompt_text, read_body,
    score_confidence,
)

LABELS = {label: 100 + i for i, label in enumerate([*systemone.LETTERS, "Yes", "No"])}
MODEL = ModelInfo(name="served", max_model_len=1000, vocab_size=1000, single_token_id=LABELS.get)
QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": None}},
    "angry": {"type": "noul", "instructions": "Angry?", "criteria": {"true": "shouting"}},
    "urgency": {"type": "score", "criteria": ["low", {"level": 1.50}, ["high"]]},
}


def parse(body: dict | str):
    text = body if isinstance(body, str) else json.dumps(body)
    return parse_systemone(read_body(text.encode()), MODEL)


def refused(body: dict | str, model: ModelInfo = MODEL) -> InvalidRequest:
    text = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(InvalidRequest) as caught:
        parse_systemone(read_body(text.encode()), model)
    return caught.value


def test_one_prompt_per_question_reading_its_labels():
    job = parse({"state": "s", "questions": QUESTIONS})
    runs = job.batch
    assert [q.name for q in job.dialect_options] == ["team", "angry", "urgency"]
    assert [r.params.logprob_token_ids for r in runs] == [[100, 101], [LABELS["Yes"], LABELS["No"]], [100, 101, 102]]
    assert all(r.params.max_tokens == 1 and r.params.temperature == 0 and r.params.logprobs == 0 for r in runs)
    assert [r.prompt_param for r in runs] == ["questions.team", "questions.angry", "questions.urgency"]
    content = runs[0].prompt.messages[0]["content"]
    assert content.startswith("State:\ns\n\nQuestion: Which team?\nOptions:\nA. billing: money\nB. tech\n")
    assert runs[0].prompt.template_kwargs == {"enable_thinking": False}
    assert "Yes means: shouting" in runs[1].prompt.messages[0]["content"]
    assert 'B. {"level":1.5}' in runs[2].prompt.messages[0]["content"]


def test_compact_json_with_canonical_numbers():
    body = read_body(b'{"a": {"b": [0.00001, 2.0, 1e16, 1E2, 12345678901234567890123, -0.5e-3]}, "c": "x"}')
    assert prompt_text(body) == '{"a":{"b":[1e-05,2.0,1e+16,100.0,12345678901234567890123,-0.0005]},"c":"x"}'
    assert prompt_text(read_body(b'[1e15, 0.0001, true, null]')) == "[1000000000000000.0,0.0001,true,null]"
    assert prompt_text("as written, {not json}") == "as written, {not json}"


def test_legend_echoes_the_clients_digits():
    levels = read_body(b'[{"v": 1.50}, 1e-05, 7]')
    assert dump_json({"legend": {"0": levels[0], "1": levels[1], "2": levels[2]}, "p": 0.25}) == \
        '{"legend":{"0":{"v":1.50},"1":1e-05,"2":7},"p":0.25}'


def test_the_answer_arithmetic():
    probabilities = label_probabilities([math.log(0.2), math.log(0.6), math.log(0.2)])
    assert sum(probabilities) == pytest.approx(1.0) and probabilities[1] == pytest.approx(0.6)
    # the softmax is over the labels alone: shifting every log probability changes nothing
    assert label_probabilities([-9.0, -8.0]) == pytest.approx(label_probabilities([-1.0, 0.0]))
    assert first_best([0.4, 0.4, 0.2]) == 0  # a tie goes to the first option
    assert choice_confidence([0.5, 0.25, 0.25]) == pytest.approx((0.5 - 1 / 3) / (2 / 3))
    assert choice_confidence([0.3, 0.35, 0.35]) == pytest.approx((0.35 - 1 / 3) / (2 / 3))
    assert choice_confidence([0.1, 0.9]) == pytest.approx(0.8) and choice_confidence([1.0]) == 1.0
    assert choice_confidence([0.34, 0.33, 0.33]) == pytest.approx(0.01)
    # the example of document 004: levels 0.914, 0.062, 0.024 give 0.8354653250426054
    levels = [0.9140376448631287, 0.06223498284816742, 0.023727400228381157]
    assert score_confidence(levels) == pytest.approx(0.8354653250426054, abs=1e-15)
    assert score_confidence([0.5, 0.0, 0.5]) == 0.0 and score_confidence([1.0]) == 1.0


def test_answers_in_their_shapes():
    job = parse({"state": "s", "questions": QUESTIONS})
    team, angry, urgency = job.dialect_options
    assert systemone.answer(angry, [0.75, 0.25]) == {"type": "noul", "noul": 0.75}
    chosen = systemone.answer(team, [0.25, 0.75])
    assert chosen["choice"] == "tech" and chosen["probabilities"] == {"billing": 0.25, "tech": 0.75}
    scored = systemone.answer(urgency, [0.5, 0.25, 0.25])
    assert scored["score"] == pytest.approx(0.75) and list(scored["legend"]) == ["0", "1", "2"]
    assert scored["legend"]["2"] == ["high"]


def test_no_usable_reading_fails():
    with pytest.raises(Exception) as caught:
        label_probabilities([float("-inf"), float("-inf")])
    assert caught.value.status == 500


@pytest.mark.parametrize("body, param", [
    ({"questions": QUESTIONS}, "state"),
    ({"state": 5, "questions": QUESTIONS}, "state"),
    ({"state": "s"}, "questions"),
    ({"state": "s", "questions": {}}, "questions"),
    ({"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, "questions"),
    ({"state": "s", "questions": QUESTIONS, "stream": True}, "stream"),
    ({"state": "s", "questions": QUESTIONS, "assets": []}, "assets"),
    ({"state": "s", "questions": QUESTIONS, "images": []}, "images"),
    ({"state": "s", "questions": QUESTIONS, "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ({"state": "s", "questions": {"q": {"type": "box", "criteria": {}}}}, "questions.q.type"),
    ({"state": "s", "questions": {"q": {"type": "pick"}}}, "questions.q.type"),
    ({"state": "s", "questions": {"q": {"criteria": {"a": "b"}}}}, "questions.q.type"),
    ({"state": "s", "questions": {"q": {"type": "noul", "hint": 1}}}, "questions.q.hint"),
    ({"state": "s", "questions": {"q": {"type": "noul", "instructions": 3}}}, "questions.q.instructions"),
    ({"state": "s", "questions": {"q": {"type": "noul", "criteria": {"maybe": "x"}}}}, "questions.q.criteria.maybe"),
    ({"state": "s", "questions": {"q": {"type": "choice"}}}, "questions.q.criteria"),
    ({"state": "s", "questions": {"q": {"type": "choice", "criteria": {}}}}, "questions.q.criteria"),
    ({"state": "s", "questions": {"q": {"type": "choice", "criteria": {f"o{i}": "" for i in range(27)}}}},
     "questions.q.criteria"),
    ({"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": 1}}}}, "questions.q.criteria.a"),
    ({"state": "s", "questions": {"q": {"type": "score", "criteria": ["x"] * 27}}}, "questions.q.criteria"),
    ({"state": "s", "questions": {"q": {"type": "score", "criteria": ["x", None]}}}, "questions.q.criteria[1]"),
    ({"state": "s", "questions": {"q": {"type": "score", "criteria": {"a": "b"}}}}, "questions.q.criteria"),
])
def test_refusals_name_the_field(body, param):
    assert refused(body).param == param


@pytest.mark.parametrize("text, param", [
    ('{"state": "s", "state": "t", "questions": {"q": {"type": "noul"}}}', "state"),
    ('{"state": {"a": 1, "a": 2}, "questions": {"q": {"type": "noul"}}}', "state.a"),
    ('{"state": "s", "questions": {"q": {"type": "noul"}, "q": {"type": "noul"}}}', "questions.q"),
    ('{"state": [1e400], "questions": {"q": {"type": "noul"}}}', "state[0]"),
])
def test_duplicate_keys_and_huge_numbers_are_refused(text, param):
    assert refused(text).param == param


def test_model_refusals_carry_no_param():
    no_template = ModelInfo(name="served", max_model_len=1000, vocab_size=1000, single_token_id=LABELS.get,
                            has_chat_template=False)
    error = refused({"state": "s", "questions": QUESTIONS}, no_template)
    assert error.param is None and "chat template" in error.message
    no_yes = ModelInfo(name="served", max_model_len=1000, vocab_size=1000,
                       single_token_id=lambda label: None if label == "Yes" else LABELS[label])
    error = refused({"state": "s", "questions": QUESTIONS}, no_yes)
    assert error.param is None and "'Yes'" in error.message
    with pytest.raises(InvalidRequest) as caught:
        read_body(b'{"state": NaN}')
    assert caught.value.code == "invalid_json"
