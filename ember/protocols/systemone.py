"""`POST /v1/systemone`: typed decisions about a state (a choice, a score, a yes/no question, which the
wire names `noul`), read zero-shot from the model's next-token probabilities over one label per
allowed answer; no text is generated.

Each question becomes one chat prompt (thinking off). The questions of a request run together as
one batch of prompt-only readings (one step each, the sampled token discarded); ember's batching is
exact, so each answer equals the one read alone.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.errors import OPENAI_ERRORS, GenerationFailed, unsupported
from ember.protocols.fields import Fields, join_path, json_type
from ember.protocols.json_body import parse_body
from ember.protocols.neutral import (
    ChatPrompt, ChoiceResult, Dialect, GenerationRequest, ModelInfo, NeverStreamed, PromptRun, ResponseMeta, RunResult,
)
from ember.protocols.openai_common import check_model
from ember.types import SamplingParams

MAX_QUESTIONS = 64
MAX_OPTIONS = 26
CHOICE, SCORE = "choice", "score"
YES_NO = "noul"  # the wire's name of a yes/no question
KINDS = (CHOICE, SCORE, YES_NO)
LETTERS = string.ascii_uppercase  # labels of choice options and score levels, in order
YES_NO_LABELS = ("Yes", "No")  # labels of a yes/no question's answers, in order
_REQUEST_FIELDS = ("model", "state", "questions")
_QUESTION_FIELDS = ("type", "instructions", "criteria")
_REFUSED = {"assets": "assets are not supported by /v1/systemone",
            "images": "this server takes text only",
            "chat_template_kwargs": "/v1/systemone renders its prompts itself; chat_template_kwargs is not taken"}


# ---- reading the body -------------------------------------------------------------------------------

class NumberText(float):
    """A JSON number with a fraction or exponent, as a float that remembers how the client wrote it
    (echoed in a score's legend; prompts write the canonical form, float's repr)."""

    text: str

    def __new__(cls, text: str) -> "NumberText":
        number = super().__new__(cls, text)
        number.text = text
        return number


class JsonObject(dict):
    """A JSON object that remembers the first key it was sent twice (refused when it is read)."""

    duplicate: str | None = None


def _pairs(pairs: list[tuple[str, Any]]) -> JsonObject:
    obj = JsonObject()
    for key, value in pairs:
        if key in obj and obj.duplicate is None:
            obj.duplicate = key
        obj[key] = value
    return obj


def read_body(body: bytes) -> Any:
    return parse_body(body, object_pairs_hook=_pairs, parse_float=NumberText)


def check_value(value: Any, path: str) -> None:
    """Refuse a duplicate key or a number that is not finite anywhere inside `value`."""
    if isinstance(value, JsonObject):
        if value.duplicate is not None:
            where = join_path(path, value.duplicate)
            raise InvalidRequest(f"{where} appears more than once", param=where)
        for key, item in value.items():
            check_value(item, join_path(path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_value(item, join_path(path, i))
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{path} holds a number too large for a 64-bit float", param=path)


# ---- rendering values into prompts --------------------------------------------------------------------

def prompt_text(value: Any) -> str:
    """A string as written; an object or array as compact JSON (keys in the order received, no
    spaces; an integer exactly, any other number as the shortest decimal that reads back to the same
    64-bit float, positional for exponents -4 to 15, else with a signed two-digit exponent: 1e-05,
    2.0, 1e+16)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dump_json(value: Any) -> str:
    """JSON text of a response; a NumberText keeps the client's own digits."""
    if isinstance(value, NumberText):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k), ensure_ascii=False)}:{dump_json(v)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump_json(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


# ---- the request --------------------------------------------------------------------------------------

@dataclass(slots=True)
class Question:
    name: str
    kind: str  # CHOICE | SCORE | YES_NO
    options: list[str]  # choice: option names; score: level indexes as strings; yes/no: yes, no
    labels: list[str]  # one label per option, in order
    legend: list[Any]  # score: the levels as the request gave them


def parse_systemone(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    check_value(body, "")
    for name, message in _REFUSED.items():
        if name in f.obj:
            raise unsupported(name, message)
    _refuse_unknown(f, _REQUEST_FIELDS)
    check_model(f, model)
    state = f.raw("state")
    if state is None:
        raise InvalidRequest("state is required: a string, an object or an array", param="state")
    _check_text_value(state, "state", allow_null=False)
    questions = f.object("questions")
    if questions is None:
        raise InvalidRequest("questions is required: an object of 1 to 64 named questions", param="questions")
    if not 1 <= len(questions.obj) <= MAX_QUESTIONS:
        raise InvalidRequest(f"questions holds {len(questions.obj)} questions; send 1 to {MAX_QUESTIONS}",
                             param="questions")
    read = [_read_question(Fields(q, questions.path_of(name)), name) for name, q in questions.obj.items()]
    if not model.has_chat_template:
        raise InvalidRequest("the model has no chat template; /v1/systemone needs one", param=None,
                             code="no_chat_template")
    runs = []
    for question, text in read:
        ids = [_label_token(model, label) for label in question.labels]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0, logprob_token_ids=ids)
        prompt = ChatPrompt([{"role": "user", "content": _question_prompt(prompt_text(state), text)}],
                            {"enable_thinking": False})
        runs.append(PromptRun(prompt, params, questions.path_of(question.name)))
    return GenerationRequest(runs[0].prompt, runs[0].params, prompt_param=runs[0].prompt_param, batch=runs,
                             dialect_options=[q for q, _ in read])


def _refuse_unknown(f: Fields, known: tuple[str, ...]) -> None:
    for key in f.obj:
        if key not in known:
            raise InvalidRequest(f"{f.path_of(key)} is not a field of /v1/systemone", param=f.path_of(key))


def _check_text_value(value: Any, path: str, allow_null: bool = True) -> None:
    """A value written into a prompt: a string, an object or an array (or null where allowed)."""
    if value is None and allow_null:
        return
    if not isinstance(value, (str, dict, list)):
        raise InvalidRequest(f"{path} must be a string, an object or an array{' or null' if allow_null else ''}, "
                             f"not {json_type(value)}", param=path)


def _read_question(q: Fields, name: str) -> tuple[Question, str]:
    """The question and its text for the prompt (instructions, options and labels)."""
    _refuse_unknown(q, _QUESTION_FIELDS)
    kind = q.raw("type")
    if kind == "box":
        raise unsupported(q.path_of("type"), "box questions are not supported by this server")
    kind = q.string("type", choices=KINDS)
    if kind is None:
        raise InvalidRequest(f"{q.path_of('type')} is required: choice, score or noul", param=q.path_of("type"))
    instructions = q.obj.get("instructions")
    _check_text_value(instructions, q.path_of("instructions"))
    lines = [f"Question: {prompt_text(instructions)}"] if instructions not in (None, "") else []
    criteria = q.obj.get("criteria")
    path = q.path_of("criteria")
    if kind == CHOICE:
        if not isinstance(criteria, dict):
            raise InvalidRequest(f"{path} must map 1 to {MAX_OPTIONS} option names to descriptions", param=path)
        _check_count(len(criteria), path, "options")
        options = list(criteria)
        for option, description in criteria.items():
            _check_text_value(description, join_path(path, option))
        labels = list(LETTERS[:len(options)])
        lines.append("Options:")
        lines += [f"{label}. {option}" + (f": {prompt_text(d)}" if d not in (None, "") else "")
                  for label, (option, d) in zip(labels, criteria.items())]
        lines.append("Answer with the letter of the best option only.")
        return Question(name, kind, options, labels, []), "\n".join(lines)
    if kind == SCORE:
        if not isinstance(criteria, list):
            raise InvalidRequest(f"{path} must be an array of 1 to {MAX_OPTIONS} levels", param=path)
        _check_count(len(criteria), path, "levels")
        for i, level in enumerate(criteria):
            _check_text_value(level, join_path(path, i), allow_null=False)
        labels = list(LETTERS[:len(criteria)])
        lines.append("Levels, lowest first:")
        lines += [f"{label}. {prompt_text(level)}" for label, level in zip(labels, criteria)]
        lines.append("Answer with the letter of the level that fits best only.")
        return Question(name, kind, [str(i) for i in range(len(criteria))], labels, list(criteria)), "\n".join(lines)
    if criteria is not None:
        c = Fields(criteria, path)
        for key in c.obj:
            if key not in ("true", "false"):
                raise InvalidRequest(f"{c.path_of(key)} is not a {YES_NO} criterion (true, false)",
                                     param=c.path_of(key))
            _check_text_value(c.obj[key], c.path_of(key))
        for key, label in zip(("true", "false"), YES_NO_LABELS):
            if c.obj.get(key) not in (None, ""):
                lines.append(f"{label} means: {prompt_text(c.obj[key])}")
    lines.append("Answer Yes or No only.")
    return Question(name, kind, ["yes", "no"], list(YES_NO_LABELS), []), "\n".join(lines)


def _check_count(count: int, path: str, what: str) -> None:
    if not 1 <= count <= MAX_OPTIONS:
        raise InvalidRequest(f"{path} holds {count} {what}; send 1 to {MAX_OPTIONS}", param=path)


def _question_prompt(state: str, question: str) -> str:
    return f"State:\n{state}\n\n{question}"


def _label_token(model: ModelInfo, label: str) -> int:
    token_id = model.single_token_id(label)
    if token_id is None:
        raise InvalidRequest(f"the model's tokenizer does not write the label {label!r} as one token of its own, "
                             f"so /v1/systemone cannot read it", param=None, code="label_not_one_token")
    return token_id


# ---- the answers ---------------------------------------------------------------------------------------

def label_probabilities(logprobs: list[float]) -> list[float]:
    """A softmax over the labels' log probabilities alone (the same as over their logits)."""
    top = max(logprobs)
    if not math.isfinite(top):
        raise GenerationFailed("the model gave no usable reading for a question")
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def first_best(probabilities: list[float]) -> int:
    """The most likely index; an exact tie goes to the first."""
    best = 0
    for i, p in enumerate(probabilities):
        if p > probabilities[best]:
            best = i
    return best


def choice_confidence(probabilities: list[float]) -> float:
    n = len(probabilities)
    if n == 1:
        return 1.0
    return max(0.0, (probabilities[first_best(probabilities)] - 1 / n) / (1 - 1 / n))


def score_confidence(probabilities: list[float]) -> float:
    """1 minus the mean distance from the most likely level, scaled by n / (n - 1)."""
    n = len(probabilities)
    if n == 1:
        return 1.0
    mode = first_best(probabilities)
    spread = sum(p * abs(i - mode) for i, p in enumerate(probabilities))
    return max(0.0, 1 - spread * n / (n - 1))


def answer(question: Question, probabilities: list[float]) -> dict[str, Any]:
    if question.kind == YES_NO:
        return {"type": YES_NO, YES_NO: probabilities[0]}  # the probability of yes
    by_option = dict(zip(question.options, probabilities))
    if question.kind == CHOICE:
        return {"type": CHOICE, CHOICE: question.options[first_best(probabilities)],
                "probabilities": by_option, "confidence": choice_confidence(probabilities)}
    return {"type": SCORE, SCORE: sum(i * p for i, p in enumerate(probabilities)),
            "legend": dict(zip(question.options, question.legend)), "probabilities": by_option,
            "confidence": score_confidence(probabilities)}


class SystemOneRenderer(NeverStreamed):
    def __init__(self, request: GenerationRequest, result: RunResult, meta: ResponseMeta) -> None:
        self.questions: list[Question] = request.dialect_options
        self.result = result
        self.meta = meta

    def reading(self, choice: ChoiceResult) -> list[float]:
        if not choice.logprobs:
            raise GenerationFailed("the model gave no usable reading for a question")
        return label_probabilities([lp for _, lp in choice.logprobs[0].requested])

    def response(self) -> bytes:
        answers = {q.name: answer(q, self.reading(c)) for q, c in zip(self.questions, self.result.choices)}
        body = {"model": self.meta.model, "answers": answers,
                "usage": {"input_tokens": self.result.num_prompt_tokens, "output_tokens": 0}}
        return dump_json(body).encode()


SYSTEMONE = Dialect(name="systemone", id_prefix="so-", parse=parse_systemone, renderer=SystemOneRenderer,
                    errors=OPENAI_ERRORS, read_body=read_body)
