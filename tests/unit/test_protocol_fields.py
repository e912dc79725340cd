"""Fields every dialect shares: spellings of one setting (and their conflicts), the sampling fields
Anthropic and Responses requests now honour, fresh seeds, zero output limits, n, matched_stop.
Pure logic, no model."""

from __future__ import annotations

import pytest

from ember.errors import InvalidRequest
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.protocols.anthropic_messages import parse_messages
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.neutral import ChoiceResult, ModelInfo, resolve_sampling
from ember.protocols.openai_chat import parse_chat
from ember.protocols.openai_completions import parse_completion
from ember.protocols.openai_responses import parse_responses
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.server.response_store import MemoryResponseStore
from ember.server.responses_routes import make_context
from ember.types import FinishReason, SamplingParams

MODEL = ModelInfo(name="served", max_model_len=512, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))
HI = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return parse_chat({"messages": HI, **fields}, MODEL)


def completion(**fields):
    return parse_completion({"prompt": "Once", **fields}, MODEL)


def messages(**fields):
    return parse_messages({"model": "claude", "messages": HI, **fields}, MODEL)


def responses(**fields):
    return parse_responses({"input": "Hi", **fields}, MODEL, make_context(MemoryResponseStore(), ReasoningSeal(b"k" * 32)))


def refused(parse, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    return caught.value


# ---- one setting, several spellings ---------------------------------------------------------------

@pytest.mark.parametrize("parse, names", [
    (chat, ("max_completion_tokens", "max_tokens")),
    (completion, ("max_completion_tokens", "max_tokens")),
    (responses, ("max_output_tokens", "max_tokens", "max_completion_tokens")),
    (messages, ("max_tokens", "max_completion_tokens")),
])
def test_every_spelling_of_the_output_limit_is_read_and_two_that_disagree_are_refused(parse, names):
    for name in names:
        assert parse(**{name: 7}).params.max_tokens == 7
    assert parse(**{names[0]: 7, names[1]: 7}).params.max_tokens == 7  # the same value twice is one setting
    error = refused(parse, **{names[0]: 7, names[-1]: 9})
    assert names[0] in error.message and names[-1] in error.message
    assert error.param == names[-1] and error.code == "conflicting_parameters"


@pytest.mark.parametrize("parse", [chat, completion, responses, messages])
def test_stop_and_stop_sequences_are_one_setting(parse):
    assert parse(stop=["END"]).params.stop == ["END"]
    assert parse(stop_sequences=["END"]).params.stop == ["END"]
    assert parse(stop="END", stop_sequences=["END"]).params.stop == ["END"]  # a string is a list of one
    error = refused(parse, stop=["END"], stop_sequences=["FIN"])
    assert "stop" in error.message and "stop_sequences" in error.message and error.code == "conflicting_parameters"
    assert refused(parse, stop_sequences=[""]).param == "stop_sequences[0]"
    assert refused(parse, stop_sequences=7).param == "stop_sequences"


def test_a_refusal_of_a_spelled_field_names_the_spelling_sent():
    assert refused(responses, max_tokens=-1).param == "max_tokens"
    assert refused(messages, max_completion_tokens="many").param == "max_completion_tokens"
    assert refused(chat, stop_sequences=["x"] * 17).param == "stop_sequences"


# ---- Anthropic Messages: the sampling fields it now honours -----------------------------------------

def test_messages_honour_seed_min_p_and_the_penalties():
    params = messages(max_tokens=8, seed=42, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                      frequency_penalty=-0.5, top_k=5).params
    assert (params.seed, params.min_p, params.repetition_penalty) == (42, 0.1, 1.2)
    assert (params.presence_penalty, params.frequency_penalty, params.top_k) == (0.5, -0.5, 5)
    assert refused(messages, max_tokens=8, min_p=2).param == "min_p"
    assert refused(messages, max_tokens=8, presence_penalty=3).param == "presence_penalty"
    assert refused(messages, max_tokens=8, repetition_penalty=0).param == "repetition_penalty"


# ---- Responses: the chat fields it now honours ------------------------------------------------------

def test_responses_honour_ignore_eos_thinking_budget_and_template_kwargs():
    request = responses(ignore_eos=True, thinking_budget=32, chat_template_kwargs={"custom_flag": True})
    assert request.params.ignore_eos and request.chat.thinking_budget == 32
    assert request.prompt.template_kwargs == {"custom_flag": True}
    assert responses(thinking_budget=0).chat.thinking_budget is None  # 0: the server's default
    assert refused(responses, thinking_budget=-1).param == "thinking_budget"
    assert refused(responses, ignore_eos="yes").param == "ignore_eos"
    assert refused(responses, chat_template_kwargs={"tools": []}).param == "chat_template_kwargs.tools"
    assert refused(responses, chat_template_kwargs={"add_generation_prompt": False}).param == \
        "chat_template_kwargs.add_generation_prompt"


def test_responses_thinking_switch_in_template_kwargs_and_reasoning_effort_agree_or_are_refused():
    off = responses(chat_template_kwargs={"enable_thinking": False})
    assert off.chat.thinking is False and off.prompt.template_kwargs == {"enable_thinking": False}
    on = responses(chat_template_kwargs={"enable_thinking": True}, reasoning={"effort": "high"})
    assert on.prompt.template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    error = refused(responses, chat_template_kwargs={"enable_thinking": False}, reasoning={"effort": "high"})
    assert error.param == "reasoning.effort" and error.code == "conflicting_template_option"


def test_the_response_repeats_the_output_limit_whatever_its_spelling():
    assert responses(max_tokens=12).spec.echo["max_output_tokens"] == 12


# ---- n ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("parse", [responses, messages])
def test_n_is_one_only_on_responses_and_messages(parse):
    assert parse(n=1).n == 1
    error = refused(parse, n=2)
    assert error.param == "n" and error.code == "unsupported_parameter"
    assert refused(parse, n="two").param == "n"


# ---- seeds -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("parse", [chat, completion, responses, messages])
def test_seed_minus_one_or_null_is_the_same_as_no_seed(parse):
    assert parse(seed=-1).params.seed is None
    assert parse(seed=None).params.seed is None
    assert parse(seed=7).params.seed == 7


def test_a_fresh_seed_is_drawn_once_before_the_engine_for_sampled_requests_only():
    sampled = SamplingParams(temperature=0.8, seed=None)
    first, second = sampled.seeded(None), sampled.seeded(None)
    assert isinstance(first.seed, int) and first.seed >= 0 and first.seed != second.seed
    assert SamplingParams(temperature=0.8, seed=5).seeded(None).seed == 5
    assert SamplingParams(temperature=0.0).seeded(None).seed is None  # greedy needs none
    params, _ = resolve_sampling(chat(temperature=1.0), 10, MODEL)
    assert params.seed is not None


def test_the_server_seed_is_the_seed_of_sampled_requests_that_bring_none():
    """`--seed N` (ModelInfo.default_seed): every sampled request without a seed, or with -1, runs
    with N; a request's own seed wins; greedy requests need none."""
    fixed = ModelInfo(name="served", max_model_len=512, vocab_size=1000, default_seed=11)
    assert resolve_sampling(chat(temperature=1.0), 10, fixed)[0].seed == 11
    assert resolve_sampling(chat(temperature=1.0, seed=-1), 10, fixed)[0].seed == 11
    assert resolve_sampling(chat(temperature=1.0, seed=3), 10, fixed)[0].seed == 3
    assert resolve_sampling(chat(temperature=0.0), 10, fixed)[0].seed is None


# ---- zero output limit -----------------------------------------------------------------------------

@pytest.mark.parametrize("parse, name", [(chat, "max_tokens"), (chat, "max_completion_tokens"),
                                         (completion, "max_tokens"), (responses, "max_output_tokens"),
                                         (responses, "max_tokens"), (messages, "max_tokens")])
def test_a_zero_output_limit_is_a_prompt_only_request(parse, name):
    request = parse(**{name: 0})
    params, fit = resolve_sampling(request, 10, MODEL)
    assert params.max_tokens == 0 and fit.max_tokens == 0 and fit.room == MODEL.max_model_len - 10
    assert refused(parse, **{name: -1}).param == name


def test_a_zero_output_limit_refuses_min_tokens():
    assert refused(chat, max_tokens=0, min_tokens=1).param == "min_tokens"


# ---- matched_stop ----------------------------------------------------------------------------------

def test_matched_stop_names_what_ended_the_reply():
    by_string = ChoiceResult(0, token_ids=[5, 6], finish_reason=FinishReason.STOP, stop_reason="END")
    by_token_id = ChoiceResult(0, token_ids=[5, 9], finish_reason=FinishReason.STOP, stop_reason=9)
    by_eos = ChoiceResult(0, token_ids=[5, 2], finish_reason=FinishReason.STOP)
    by_length = ChoiceResult(0, token_ids=[5, 6], finish_reason=FinishReason.LENGTH)
    assert (by_string.matched_stop, by_token_id.matched_stop, by_eos.matched_stop) == ("END", 9, 2)
    assert by_length.matched_stop is None and ChoiceResult(0).matched_stop is None
