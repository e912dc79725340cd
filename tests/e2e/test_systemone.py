"""/v1/systemone on a real `ember serve`: answers recomputed from the model's own log probabilities
through `ember.LLM`, batched questions equal to questions asked one at a time, every refusal, and 429."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from ember import LLM, SamplingParams
from ember.protocols.systemone import parse_systemone, read_body
from ember.protocols.neutral import ModelInfo
from tests.e2e.conftest import wait_idle

STATE = {"customer": {"message": "I was charged twice for my order and want one payment back.",
                      "orders": 2, "amount": 19.5, "ratio": 0.00001, "limit": 1e16, "score": 2.0}}
QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team should handle this message?",
             "criteria": {"billing": "payments, refunds and invoices", "shipping": "deliveries and parcels",
                          "technical": "bugs, crashes and login problems"}},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgency": {"type": "score", "instructions": "How urgent is the message?",
                "criteria": ["not urgent", {"level": "somewhat urgent", "weight": 1.50}, "very urgent"]},
}
REQUEST = {"state": STATE, "questions": QUESTIONS}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


def ask(http, body) -> dict:
    reply = http.post("/v1/systemone", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def offline_readings(llm: LLM, body: dict) -> tuple[list[list[float]], int]:
    """Each question's label probabilities from the model's log probabilities, computed here, and the
    prompt tokens in all. The prompts come from the route's own parser; the numbers do not."""
    labels = {label: llm.tokenizer.encode(label) for label in [*"ABCDEFGHIJKLMNOPQRSTUVWXYZ", "Yes", "No"]}
    model = ModelInfo(name="m", max_model_len=1024, vocab_size=llm.tokenizer.vocab_size,
                      single_token_id=lambda label: labels[label][0])
    job = parse_systemone(read_body(json.dumps(body).encode()), model)
    readings, num_tokens = [], 0
    for run in job.batch:
        ids = llm.tokenizer.apply_chat_template(run.prompt.messages, add_generation_prompt=True,
                                                enable_thinking=False)
        num_tokens += len(ids)
        label_ids = run.params.logprob_token_ids
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20,
                                                 logprob_token_ids=label_ids))[0]
        step = out.logprobs[0]
        named = dict(step.requested)
        for token_id, logprob in step.top:  # the named ids read the same numbers as the top list
            if token_id in named:
                assert named[token_id] == logprob
        logprobs = [named[t] for t in label_ids]
        top = max(logprobs)
        weights = [math.exp(lp - top) for lp in logprobs]
        readings.append([w / sum(weights) for w in weights])
    return readings, num_tokens


def test_answers_match_the_models_own_probabilities(http, llm):
    body = ask(http, REQUEST)
    readings, num_tokens = offline_readings(llm, REQUEST)
    answers = body["answers"]
    assert list(answers) == ["team", "angry", "urgency"]
    assert body["usage"] == {"input_tokens": num_tokens, "output_tokens": 0}

    team = answers["team"]
    p = readings[0]
    assert list(team["probabilities"]) == ["billing", "shipping", "technical"]
    assert list(team["probabilities"].values()) == pytest.approx(p, abs=1e-9)
    assert sum(team["probabilities"].values()) == pytest.approx(1.0)
    best = max(range(3), key=lambda i: (p[i], -i))
    assert team["choice"] == ["billing", "shipping", "technical"][best]
    assert team["confidence"] == pytest.approx(max(0.0, (p[best] - 1 / 3) / (1 - 1 / 3)), abs=1e-9)

    assert answers["angry"] == {"type": "noul", "noul": pytest.approx(readings[1][0], abs=1e-9)}

    urgency = answers["urgency"]
    p = readings[2]
    assert list(urgency["probabilities"].values()) == pytest.approx(p, abs=1e-9)
    assert urgency["score"] == pytest.approx(sum(i * q for i, q in enumerate(p)), abs=1e-9)
    mode = max(range(3), key=lambda i: (p[i], -i))
    spread = sum(q * abs(i - mode) for i, q in enumerate(p))
    assert urgency["confidence"] == pytest.approx(max(0.0, 1 - spread * 3 / 2), abs=1e-9)


def test_the_legend_echoes_levels_as_sent(http):
    text = json.dumps(REQUEST).replace('"weight": 1.5', '"weight": 1.50')
    reply = http.post("/v1/systemone", content=text, headers={"Content-Type": "application/json"})
    assert reply.status_code == 200
    assert '"legend":{"0":"not urgent","1":{"level":"somewhat urgent","weight":1.50},"2":"very urgent"}' in reply.text


def test_numbers_are_written_in_one_canonical_form(http):
    """The same numbers spelled otherwise make the same prompts: the same answers and token counts."""
    canonical = ask(http, REQUEST)
    text = json.dumps(REQUEST).replace('"ratio": 1e-05', '"ratio": 0.00001').replace(
        '"limit": 1e+16', '"limit": 10000000000000000.0').replace('"score": 2.0', '"score": 2.000')
    assert "0.00001" in text and "10000000000000000.0" in text and "2.000" in text
    reply = http.post("/v1/systemone", content=text, headers={"Content-Type": "application/json"})
    assert reply.json() == canonical


def test_batched_questions_equal_questions_asked_alone(http):
    together = ask(http, REQUEST)["answers"]
    for name, question in QUESTIONS.items():
        alone = ask(http, {"state": STATE, "questions": {name: question}})["answers"][name]
        assert alone == together[name]


def test_a_one_option_question_is_certain(http):
    body = ask(http, {"state": "s", "questions": {"only": {"type": "choice", "criteria": {"x": None}},
                                                   "one": {"type": "score", "criteria": ["a"]}}})
    assert body["answers"]["only"] == {"type": "choice", "choice": "x", "probabilities": {"x": 1.0},
                                       "confidence": 1.0}
    assert body["answers"]["one"]["score"] == 0.0 and body["answers"]["one"]["confidence"] == 1.0


@pytest.mark.parametrize("body, param", [
    ({"questions": QUESTIONS}, "state"),
    ({**REQUEST, "unknown": 1}, "unknown"),
    ({**REQUEST, "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ({**REQUEST, "images": ["x"]}, "images"),
    ({**REQUEST, "assets": ["x"]}, "assets"),
    ({"state": "s", "questions": {"q": {"type": "box", "criteria": {}}}}, "questions.q.type"),
    ({"state": "s", "questions": {"q": {"type": "noul", "extra": True}}}, "questions.q.extra"),
    ({"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, "questions"),
    ({"state": "s", "questions": {"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(27)}}}},
     "questions.q.criteria"),
    ({"state": "s", "questions": {"q": {"type": "score", "criteria": ["x"] * 27}}}, "questions.q.criteria"),
    ({"state": "word " * 1100, "questions": {"a": {"type": "noul"}, "b": {"type": "noul"}}}, "questions.a"),
])
def test_refusals_name_the_field(http, body, param):
    reply = http.post("/v1/systemone", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_duplicate_key_is_refused(http):
    text = '{"state": "s", "questions": {"q": {"type": "noul", "type": "noul"}}}'
    reply = http.post("/v1/systemone", content=text, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "questions.q.type"


def test_a_refused_question_runs_none_of_the_others(http):
    wait_idle(http)
    before = http.get("/health").json()["engine"]
    body = {"state": "s", "questions": {"fine": {"type": "noul"}, "bad": {"type": "score", "criteria": []}}}
    assert http.post("/v1/systemone", json=body).status_code == 400
    after = http.get("/health").json()["engine"]
    assert {k: after[k] for k in after if "prompt" in k} == {k: before[k] for k in before if "prompt" in k}


@pytest.fixture(scope="module")
def one_slot(one_slot_server):
    return one_slot_server


def test_a_full_queue_refuses_the_whole_request(one_slot):
    hold = {"text": "Count:", "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with httpx.Client(base_url=one_slot.url, timeout=120) as session:
        with session.stream("POST", "/generate", json=hold) as stream:
            lines = stream.iter_lines()  # kept: a dropped line iterator closes the stream
            next(line for line in lines if line.startswith("data: "))  # admitted and running
            full = session.post("/v1/systemone", json=REQUEST)
        assert full.status_code == 429, full.text
        assert full.json()["error"]["code"] == "server_overloaded"
        wait_idle(session)
        assert session.post("/v1/systemone", json=REQUEST).status_code == 200
