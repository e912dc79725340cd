"""The rules every dialect shares about what a request may leave out or add: unknown top-level
fields (ignored and reported, or refused with --strict-fields), the server's sampling defaults,
thinking defaults, reasoning efforts the template offers, and preserve_thinking. Pure logic."""

from __future__ import annotations

import argparse
import logging

import pytest

from ember.errors import InvalidRequest
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.protocols.anthropic_messages import parse_count_tokens, parse_messages
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.native_generate import parse_generate
from ember.protocols.native_tokens import parse_detokenize, parse_tokenize
from ember.protocols.neutral import ModelInfo
from ember.protocols.openai_chat import parse_chat
from ember.protocols.openai_completions import parse_completion
from ember.protocols.openai_responses import parse_responses
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.protocols.unknown_fields import MAX_HEADER_NAMES, FieldReport, watch_fields
from ember.server.flags import add_serve_parser, build_config
from ember.server.response_store import MemoryResponseStore
from ember.server.responses_routes import make_context
from ember.server.sampling_defaults import check_override, sampling_defaults
from ember.tokenization.chat_prompt import drop_closed_reasoning

FEATURES = ChatFeatures(ThinkMarkers(), HERMES)
MODEL = ModelInfo(name="served", max_model_len=512, vocab_size=1000, chat=FEATURES)
USER = [{"role": "user", "content": "Hi"}]
CONTEXT = make_context(MemoryResponseStore(), ReasoningSeal(b"k" * 32))


def model_with(**features) -> ModelInfo:
    return ModelInfo(name="served", max_model_len=512, vocab_size=1000,
                     chat=ChatFeatures(ThinkMarkers(), HERMES, **features))


def responses(body, model=MODEL):
    return parse_responses(body, model, CONTEXT)


# One body per route with every field ember documents for it (none is unknown).
FULL_BODIES = [
    (parse_chat, {"model": "served", "messages": USER, "max_tokens": 4, "max_completion_tokens": 4, "temperature": 0.5,
                  "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.1, "frequency_penalty": 0.1,
                  "repetition_penalty": 1.1, "logit_bias": {"1": 1}, "seed": 3, "stop": ["x"], "stop_token_ids": [2],
                  "ignore_eos": False, "min_tokens": 1, "n": 1, "logprobs": True, "top_logprobs": 2, "stream": True,
                  "stream_options": {"include_usage": True}, "return_token_ids": True, "skip_special_tokens": True,
                  "return_progress": True, "timings_per_token": True, "chat_template_kwargs": {},
                  "add_generation_prompt": True, "continue_final_message": False, "user": "u", "metadata": {},
                  "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "enable_thinking": True,
                  "reasoning_effort": "low", "thinking_budget": 8, "preserve_thinking": True,
                  "response_format": {"type": "text"}}),
    (parse_completion, {"model": "served", "prompt": "Hi", "max_tokens": 4, "echo": False, "logprobs": 1, "n": 1,
                        "best_of": 1, "suffix": "", "temperature": 0, "stream": False, "user": "u"}),
    (parse_messages, {"model": "m", "messages": USER, "max_tokens": 4, "system": "s", "temperature": 0, "top_k": 3,
                      "top_p": 0.9, "stop_sequences": ["x"], "stream": False, "metadata": {}, "service_tier": "auto",
                      "thinking": {"type": "disabled"}, "tools": [], "tool_choice": {"type": "auto"},
                      "output_config": {"effort": "low"}, "context_management": {"edits": []}, "seed": 1,
                      "preserve_thinking": False}),
    (parse_count_tokens, {"model": "m", "messages": USER, "system": "s", "tools": [], "thinking": {"type": "disabled"}}),
    (responses, {"model": "served", "input": "Hi", "instructions": "i", "store": False, "max_output_tokens": 4,
                 "temperature": 0, "top_p": 1, "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}},
                 "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "metadata": {}, "user": "u",
                 "include": ["reasoning.encrypted_content"], "stream": False, "truncation": "disabled",
                 "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s", "max_tool_calls": 2,
                 "background": False, "top_logprobs": 0, "preserve_thinking": True, "chat_template_kwargs": {}}),
    (parse_generate, {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "stream": False, "rid": "r",
                      "return_logprob": False, "top_logprobs_num": 0, "return_text_in_logprobs": False}),
    (parse_tokenize, {"model": "served", "prompt": "Hi", "add_special_tokens": True, "return_token_strs": True}),
    (parse_detokenize, {"model": "served", "tokens": [1, 2]}),
]


@pytest.mark.parametrize("parse, body", FULL_BODIES, ids=lambda v: getattr(v, "__name__", ""))
def test_every_documented_field_is_known_and_a_stray_one_is_reported(parse, body):
    with watch_fields(strict=False) as report:
        parse(body, MODEL)
    assert report.ignored == []
    with watch_fields(strict=False) as report:
        parse({**body, "x_new_field": 1, "other": {"a": 1}, "unset": None}, MODEL)
    assert report.ignored == ["x_new_field", "other"]  # null means not given: not reported
    with watch_fields(strict=True), pytest.raises(InvalidRequest) as refused:
        parse({**body, "x_new_field": 1}, MODEL)
    assert (refused.value.param, refused.value.code) == ("x_new_field", "unknown_parameter")


def test_a_known_field_ember_cannot_honour_is_refused_by_name_whatever_the_setting():
    for strict in (False, True):
        with watch_fields(strict), pytest.raises(InvalidRequest) as refused:
            parse_chat({"messages": USER, "functions": [{"name": "f"}], "x_new_field": 1}, MODEL)
        assert refused.value.param == "functions" and refused.value.code == "unsupported_parameter"


def test_unknown_names_are_logged_once_per_process_and_headers_stay_latin1(caplog):
    with caplog.at_level(logging.INFO, logger="ember.server"):
        for _ in range(3):
            with watch_fields(strict=False):
                parse_chat({"messages": USER, "x_logged_once": 1}, MODEL)
    assert sum("x_logged_once" in record.getMessage() for record in caplog.records) == 1
    report = FieldReport(ignored=["plain_name", "caf\u00e9,x", "\n", " ", ""])
    assert report.header_value() == 'plain_name, caf%C3%A9%2Cx, %0A, %20, ""'  # found by the foreign-spec fuzz
    many = FieldReport(ignored=[f"f{i}" for i in range(MAX_HEADER_NAMES + 5)])
    assert many.header_value().endswith(f"f{MAX_HEADER_NAMES - 1}, ...5 more")
    many.header_value().encode("latin-1")


# ---- sampling defaults ------------------------------------------------------------------------------------

def test_flags_win_over_the_override_which_wins_over_the_generation_config():
    generation_config = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True, "max_new_tokens": 9}
    merged = sampling_defaults(generation_config, {"top_p": 0.95, "min_p": 0.05}, {"temperature": 0.0})
    assert merged == {"temperature": 0.0, "top_p": 0.95, "top_k": 20, "min_p": 0.05}
    request = parse_chat({"messages": USER, "temperature": 1.0},
                         ModelInfo(name="served", max_model_len=512, vocab_size=1000, sampling_defaults=merged))
    assert (request.params.temperature, request.params.top_p, request.params.top_k) == (1.0, 0.95, 20)


def serve_config(*flags: str):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return build_config(parser.parse_args(["serve", *flags]))


def test_the_sampling_flags_are_checked_at_the_start():
    config = serve_config("--greedy", "--top-k", "5", "--override-generation-config", '{"top_p": 0.9}')
    assert config.sampling_flags == {"top_k": 5, "temperature": 0.0}
    assert config.override_generation_config == {"top_p": 0.9}
    for flags, named in [(("--temperature", "-1"), "--temperature"), (("--top-p", "0"), "--top-p"),
                         (("--greedy", "--temperature", "0.5"), "--greedy"),
                         (("--no-thinking", "--reasoning-effort", "high"), "--no-thinking")]:
        with pytest.raises(ValueError, match=named):
            serve_config(*flags)
    for override, named in [({"max_new_tokens": 3}, "max_new_tokens"), ({"top_k": 1.5}, "top_k"),
                            ({"temperature": "hot"}, "temperature"), ({"min_p": 2.0}, "min_p")]:
        with pytest.raises(ValueError, match=named):
            check_override(override)


# ---- thinking: server defaults and template efforts -----------------------------------------------------

def test_no_thinking_is_the_default_a_request_can_override():
    model = model_with(default_thinking=False)
    assert parse_chat({"messages": USER}, model).prompt.template_kwargs["enable_thinking"] is False
    assert parse_chat({"messages": USER, "enable_thinking": True}, model).chat.thinking is True
    assert parse_chat({"messages": USER, "reasoning_effort": "low"}, model).chat.thinking is True
    assert responses({"input": "Hi"}, model).chat.thinking is False
    assert "enable_thinking" not in parse_chat({"messages": USER}, MODEL).prompt.template_kwargs


def test_the_default_effort_applies_where_the_request_names_none():
    model = model_with(default_reasoning_effort="low")
    request = parse_chat({"messages": USER}, model)
    assert request.chat.reasoning_effort == "low" and request.prompt.template_kwargs["reasoning_effort"] == "low"
    assert parse_chat({"messages": USER, "reasoning_effort": "high"}, model).chat.reasoning_effort == "high"
    off = parse_chat({"messages": USER, "enable_thinking": False}, model)
    assert off.chat.thinking is False and "reasoning_effort" not in off.prompt.template_kwargs
    assert responses({"input": "Hi"}, model).spec.echo["reasoning"]["effort"] == "low"


def test_an_effort_the_template_does_not_offer_is_refused_by_name():
    model = model_with(efforts=("low", "medium", "high"))
    for body, param in [({"messages": USER, "reasoning_effort": "xhigh"}, "reasoning_effort"),
                        ({"messages": USER, "reasoning_effort": "max"}, "reasoning_effort"),
                        ({"messages": USER, "chat_template_kwargs": {"reasoning_effort": "minimal"}},
                         "chat_template_kwargs.reasoning_effort")]:
        with pytest.raises(InvalidRequest) as refused:
            parse_chat(body, model)
        assert (refused.value.param, refused.value.code) == (param, "reasoning_effort_not_supported")
    with pytest.raises(InvalidRequest) as refused:
        responses({"input": "Hi", "reasoning": {"effort": "max"}}, model)
    assert (refused.value.param, refused.value.code) == ("reasoning.effort", "reasoning_effort_not_supported")
    with pytest.raises(InvalidRequest) as refused:
        parse_messages({"messages": USER, "max_tokens": 8, "output_config": {"effort": "max"}}, model)
    assert refused.value.param == "output_config.effort"  # max is xhigh here, which this template lacks
    assert parse_chat({"messages": USER, "reasoning_effort": "none"}, model).chat.thinking is False
    assert parse_chat({"messages": USER, "reasoning_effort": "high"}, model).chat.reasoning_effort == "high"
    offers_max = model_with(efforts=("low", "max"))
    assert parse_messages({"messages": USER, "max_tokens": 8, "thinking": {"type": "adaptive"},
                           "output_config": {"effort": "max"}}, offers_max).chat.reasoning_effort == "max"
    # a template that ignores efforts takes every one: it then only means thinking on
    assert parse_chat({"messages": USER, "reasoning_effort": "max"}, MODEL).chat.thinking is True


# ---- preserve_thinking --------------------------------------------------------------------------------

HISTORY = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
           {"role": "user", "content": "c"}, {"role": "assistant", "content": "", "reasoning_content": "r2",
                                              "tool_calls": [{"id": "1", "type": "function",
                                                              "function": {"name": "f", "arguments": {}}}]},
           {"role": "tool", "tool_call_id": "1", "content": "ok"}]


def test_preserve_thinking_is_read_under_both_names_and_defaults_to_the_server():
    assert parse_chat({"messages": USER}, MODEL).prompt.preserve_thinking is False
    assert parse_chat({"messages": USER}, model_with(preserve_thinking=True)).prompt.preserve_thinking is True
    assert parse_chat({"messages": USER, "preserve_thinking": True}, MODEL).prompt.preserve_thinking is True
    kwargs = parse_chat({"messages": USER, "chat_template_kwargs": {"preserve_thinking": True}}, MODEL).prompt
    assert kwargs.preserve_thinking is True and "preserve_thinking" not in kwargs.template_kwargs
    with pytest.raises(InvalidRequest) as refused:
        parse_chat({"messages": USER, "preserve_thinking": True, "chat_template_kwargs": {"preserve_thinking": False}},
                   MODEL)
    assert refused.value.code == "conflicting_parameters"
    assert "preserve_thinking" in refused.value.message and "chat_template_kwargs.preserve_thinking" in \
        refused.value.message
    assert parse_messages({"messages": USER, "max_tokens": 4, "preserve_thinking": True},
                          MODEL).prompt.preserve_thinking is True


def test_closed_turns_lose_their_reasoning_and_the_open_turn_keeps_it():
    kept = drop_closed_reasoning(HISTORY)
    assert [m.get("reasoning_content") for m in kept] == [None, None, None, "r2", None]
    assert HISTORY[1]["reasoning_content"] == "r1"  # the caller's messages are not changed


def test_a_stored_response_keeps_its_setting_and_a_child_inherits_it():
    store = MemoryResponseStore()
    ctx = make_context(store, ReasoningSeal(b"k" * 32))
    parent = parse_responses({"input": "Hi", "preserve_thinking": True}, MODEL, ctx)
    assert parent.spec.echo["preserve_thinking"] is True
    ctx.save({"id": "resp_parent", **parent.spec.echo}, parent.spec, tuple(parent.spec.input_items))
    child = parse_responses({"input": "More", "previous_response_id": "resp_parent"}, MODEL, ctx)
    assert child.prompt.preserve_thinking is True
    branch = parse_responses({"input": "More", "previous_response_id": "resp_parent", "preserve_thinking": False},
                             MODEL, ctx)
    assert branch.prompt.preserve_thinking is False


# ---- Codex history items and include -----------------------------------------------------------------------

def test_local_shell_items_become_a_call_and_its_result():
    items = [{"type": "message", "role": "user", "content": "List the files."},
             {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_1", "status": "completed",
              "action": {"type": "exec", "command": ["ls", "-la"], "working_directory": "/tmp"}},
             {"type": "local_shell_call_output", "call_id": "call_1", "output": "a.txt"}]
    request = responses({"input": items, "include": ["file_search_call.results"]})
    call, result = request.prompt.messages[1], request.prompt.messages[2]
    assert call["tool_calls"][0]["function"] == {"name": "local_shell", "arguments": {
        "type": "exec", "command": ["ls", "-la"], "working_directory": "/tmp"}}
    assert result == {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}
    assert [item["type"] for item in request.spec.input_items] == [i["type"] for i in items]
    for bad, param in [({"type": "local_shell_call", "call_id": "c"}, "input[0].action"),
                       ({"type": "local_shell_call", "call_id": "c", "action": {"type": "exec", "command": [1]}},
                        "input[0].action.command[0]"),
                       ({"type": "local_shell_call_output", "output": "x"}, "input[0].call_id")]:
        with pytest.raises(InvalidRequest) as refused:
            responses({"input": [bad]})
        assert refused.value.param == param


def test_max_new_tokens_zero_asks_generate_for_the_prompt_only():
    assert parse_generate({"text": "Hi", "sampling_params": {"max_new_tokens": 0}}, MODEL).params.max_tokens == 0
