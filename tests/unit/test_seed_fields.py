"""Fields the reference servers read that ember now honours, refuses by name or lists as ignored;
the thinking budget's room; timings; the order of tied top log probabilities; /generate's
meta_info. Pure logic and the real sampler on synthetic logits (no model)."""

from __future__ import annotations

import socket

import pytest
import torch

from ember.config import EngineConfig
from ember.engine.client import EngineClient
from ember.engine.messages import EngineInfo, WorkerSettings
from ember.engine.router import EngineRouter, choose_worker, prompt_block_hashes
from ember.engine.sampler import Sampler, SamplingRow
from ember.engine.weight_footprint import routed_experts, weight_footprint
from ember.errors import InvalidRequest
from ember.parsers.events import ThinkMarkers
from ember.parsers.events import ToolSpec
from ember.parsers.hermes import HERMES
from ember.parsers.reply import ReplyFormat, ReplyParser
from ember.protocols.anthropic_messages import parse_messages
from ember.protocols.chat_reply import BUDGET_ROOM_INSUFFICIENT, ChatFeatures, ChatOptions, plan_reply
from ember.protocols.native_generate import GenerateRenderer, parse_generate
from ember.protocols.neutral import ModelInfo, ResponseMeta, RunResult
from ember.protocols.openai_chat import CHAT, parse_chat
from ember.protocols.openai_completions import parse_completion
from ember.protocols.openai_responses import parse_responses
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.protocols.unknown_fields import watch_fields
from ember.server.cli import TCP_USER_TIMEOUT_MS, _bind
from ember.server.request_events import engine_timing, telemetry, thinking_budget, tool_call_parse
from ember.server.request_record import RequestRecord
from ember.server.response_store import MemoryResponseStore
from ember.server.responses_routes import make_context
from ember.server.sampling_defaults import check_override, mode_sampling_defaults, sampling_defaults
from ember.types import FinishReason, GenerationOutput, RequestTimings, SamplingParams
from tests.models.model_builders import build_pair

MODEL = ModelInfo(name="served", max_model_len=512, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))
HI = [{"role": "user", "content": "Hi"}]


def refusal(call) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        call()
    return caught.value


def responses(model=MODEL, **fields):
    context = make_context(MemoryResponseStore(), ReasoningSeal(b"k" * 32))
    return parse_responses({"input": "Hi", **fields}, model, context)


# ---- item 6: verbosity, store, summaries, the other route's prompt field ------------------------------


def test_chat_verbosity_medium_is_honoured_and_low_or_high_refused_by_name():
    with watch_fields(strict=True) as report:
        parse_chat({"messages": HI, "verbosity": "medium"}, MODEL)
    assert report.ignored == []
    for value in ("low", "high"):
        error = refusal(lambda: parse_chat({"messages": HI, "verbosity": value}, MODEL))
        assert (error.param, error.code) == ("verbosity", "unsupported_parameter")
    assert refusal(lambda: parse_chat({"messages": HI, "verbosity": "loud"}, MODEL)).param == "verbosity"


def test_chat_store_true_is_refused_and_false_accepted():
    parse_chat({"messages": HI, "store": False}, MODEL)
    error = refusal(lambda: parse_chat({"messages": HI, "store": True}, MODEL))
    assert (error.param, error.code) == ("store", "unsupported_parameter") and "/v1/responses" in error.message


def test_a_prompt_sent_to_the_other_route_is_refused_by_name():
    error = refusal(lambda: parse_chat({"prompt": "Hi"}, MODEL))
    assert error.param == "prompt" and "/v1/completions" in error.message
    assert refusal(lambda: parse_chat({"messages": HI, "prompt": "Hi"}, MODEL)).param == "prompt"
    error = refusal(lambda: parse_completion({"prompt": "Hi", "messages": HI}, MODEL))
    assert error.param == "messages" and "/v1/chat/completions" in error.message


def test_responses_verbosity_and_summary_are_echoed_and_listed_as_ignored_even_when_strict():
    with watch_fields(strict=True) as report:
        job = responses(text={"verbosity": "low"}, reasoning={"effort": "low", "summary": "auto"})
    assert report.ignored == ["text.verbosity", "reasoning.summary"]
    assert job.spec.echo["text"]["verbosity"] == "low" and job.spec.echo["reasoning"]["summary"] == "auto"
    with watch_fields(strict=False) as report:
        responses(text={"verbosity": "medium"}, reasoning={"generate_summary": "concise"})
    assert report.ignored == ["reasoning.generate_summary"]
    assert refusal(lambda: responses(text={"verbosity": "terse"})).param == "text.verbosity"


# ---- item 11: the cap on messages -----------------------------------------------------------------


def test_messages_beyond_the_cap_are_a_400_naming_the_field_on_every_dialect():
    capped = ModelInfo(name="served", max_model_len=512, vocab_size=1000, max_messages=2)
    three = HI * 3
    for call, param in ((lambda: parse_chat({"messages": three}, capped), "messages"),
                        (lambda: parse_messages({"model": "m", "max_tokens": 5, "messages": three}, capped),
                         "messages"),
                        (lambda: responses(capped, input=[{"role": "user", "content": "Hi"}] * 3), "input")):
        error = refusal(call)
        assert (error.param, error.code, error.status) == (param, "too_many_messages", 400)
        assert "at most 2" in error.message
    assert len(parse_chat({"messages": HI * 2}, capped).prompt.messages) == 2
    uncapped = ModelInfo(name="served", max_model_len=512, vocab_size=1000, max_messages=None)
    assert len(parse_chat({"messages": HI * 300}, uncapped).prompt.messages) == 300
    assert MODEL.max_messages == 256


# ---- item 8: a thinking budget needs room for its close ----------------------------------------


def budget_plan(budget: int | None, close_tokens: int = 3, param: str = "thinking_budget", default: int | None = None):
    features = ChatFeatures(ThinkMarkers(), HERMES, default_thinking_budget=default)
    plan = plan_reply(ChatOptions(thinking_budget=budget, thinking_budget_param=param), features, "<think>\n", None)
    plan.budget_close_tokens = close_tokens
    return plan


def test_a_budget_the_reply_can_pass_must_leave_room_for_the_close_and_one_token():
    plan = budget_plan(10)
    for max_tokens in (5, 10, 14, 100):  # within the budget (never closed), or room enough
        plan.check_budget_room(max_tokens)
    for max_tokens in (11, 13):
        error = refusal(lambda: plan.check_budget_room(max_tokens))
        assert (error.param, error.code, error.status) == ("thinking_budget", BUDGET_ROOM_INSUFFICIENT, 400)
        assert "14" in error.message
    anthropic = budget_plan(1024, param="thinking.budget_tokens")
    assert refusal(lambda: anthropic.check_budget_room(1025)).param == "thinking.budget_tokens"
    server_default = budget_plan(None, default=10)
    error = refusal(lambda: server_default.check_budget_room(12))
    assert error.param == "max_tokens" and "server's thinking budget" in error.message


# ---- item 11: timings and tied log probabilities -------------------------------------------------


def test_timings_carry_milliseconds_per_token_over_the_tokens_after_the_first():
    result = RunResult(1, list(range(10)), received=100.0)
    timings = RequestTimings(arrival=100.0, scheduled=100.0, first_token=100.5, finished=101.5)
    result.add(0, GenerationOutput("r", [], [1, 2, 3, 4, 5], "x", [1, 2, 3, 4, 5], "x", None, None,
                                   FinishReason.STOP, 2, timings))
    body = result.timings()
    assert body["prompt_n"] == 8 and body["prompt_per_token_ms"] == pytest.approx(500.0 / 8)
    assert body["predicted_per_token_ms"] == pytest.approx(1000.0 / 4)  # 4 intervals after the first token
    empty = RunResult(1, [1], received=100.0)
    empty.add(0, GenerationOutput("r", [], [], "", [], "", None, None, FinishReason.LENGTH, 1,
                                  RequestTimings(arrival=100.0, scheduled=100.0)))
    assert empty.timings()["prompt_per_token_ms"] == 0.0 and empty.timings()["predicted_per_token_ms"] == 0.0


def test_a_tie_for_the_top_lists_the_token_greedy_decoding_chose_first():
    vocab = 40
    logits = torch.full((2, vocab), -5.0)
    logits[0, [7, 19, 31]] = 2.0  # a three-way tie: argmax takes 7
    logits[1, [3, 30]] = 1.0
    logits[1, 12] = 4.0
    sampler = Sampler(vocab, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, logprobs=3)
    out = sampler(logits, [SamplingRow(params, [], 1, frozenset()) for _ in range(2)])
    assert out.token_ids == [7, 12]
    assert [t for t, _ in out.logprobs[0].top] == [7, 19, 31]
    assert [t for t, _ in out.logprobs[1].top] == [12, 3, 30]
    narrow = sampler(logits[:1], [SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [], 1, frozenset())])
    assert narrow.logprobs[0].top[0][0] == 7


# ---- item 12: /generate's meta_info and chat's metadata -------------------------------------------


def test_generate_meta_info_carries_sglangs_fields():
    job = parse_generate({"text": "a"}, MODEL)
    result = RunResult(1, [1, 2], received=100.0)
    renderer = GenerateRenderer(job, result, ResponseMeta("id1", 100, "served", "fp", str))
    output = GenerationOutput("r", [], [5, 6], "xy", [5, 6], "xy", None, None, FinishReason.LENGTH, 0,
                              RequestTimings(arrival=100.0, scheduled=100.1, first_token=100.2, finished=100.3),
                              num_preemptions=2, dp_rank=1)
    info = renderer.meta_info(result.add(0, output))
    assert info["weight_version"] == "default"
    assert info["weight_versions"] == [{"version": "default", "start": 0, "end": 2}]
    assert info["num_retractions"] == 2 and info["dp_rank"] == 1 and info["reasoning_tokens"] == 0
    assert info["request_received_ts"] <= info["api_server_dispatch_finish_ts"] <= info["response_sent_to_client_ts"]
    alone = RunResult(1, [1, 2], received=100.0)
    lone = renderer.meta_info(alone.add(0, GenerationOutput("r", [], [5], "x", [5], "x", None, None, None, 0,
                                                            RequestTimings(arrival=100.0))))
    assert lone["dp_rank"] is None and lone["num_retractions"] == 0


def test_a_whole_chat_reply_carries_metadata_with_the_weights_version():
    job = parse_chat({"messages": HI}, MODEL)
    result = RunResult(1, [1, 2], received=100.0)
    result.add(0, GenerationOutput("r", [], [5, 6, 7], "abc", [5, 6, 7], "abc", None, None, FinishReason.STOP, 0,
                                   RequestTimings(arrival=100.0)))
    body = CHAT.renderer(job, result, ResponseMeta("id1", 100, "served", "fp", str)).response()
    assert body["metadata"] == {"weight_version": "default",
                                "weight_versions": [{"version": "default", "start": 0, "end": 3}]}


# ---- item 10: the listening socket -----------------------------------------------------------------


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
def test_accepted_connections_carry_keepalive_and_a_15_s_user_timeout():
    listener = _bind("127.0.0.1", 0)
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == TCP_USER_TIMEOUT_MS == 15_000
        assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    finally:
        for sock in (accepted, client, listener):
            sock.close()


# ---- item 10: the weights' footprint and a mixture-of-experts model's routing ----------------------


@pytest.mark.parametrize("case", ["llama_tied_bias", "qwen3_moe_top2"])
def test_the_weight_footprint_counts_what_the_checkpoint_holds_once(case):
    hf_model, model, config = build_pair(case)
    footprint = weight_footprint(model)
    num_weights = sum(p.numel() for p in hf_model.parameters())  # a tied table and head count once
    assert footprint.num_weights == num_weights
    assert footprint.num_bytes == 4 * num_weights  # float32, nothing packed yet
    assert footprint.formats["dense"] > 0
    experts = routed_experts(config)
    assert experts == ({"num_experts": 8, "experts_per_token": 2} if "moe" in case else None)


# ---- item 9: a session stays on one data-parallel worker ----------------------------------------


def test_the_session_s_worker_wins_a_tie_but_not_a_longer_cached_prefix():
    assert choose_worker([0, 0], [0, 0], [5, -1], [True, True]) == 1  # the one chosen longest ago
    assert choose_worker([0, 0], [0, 0], [5, -1], [True, True], preferred=0) == 0
    assert choose_worker([0, 3], [0, 0], [5, -1], [True, True], preferred=0) == 1  # the prefix is cached there
    assert choose_worker([0, 0], [5, 0], [5, -1], [True, True], preferred=0) == 1  # too far over the other


def test_the_router_remembers_each_session_s_worker():
    settings = WorkerSettings("m", None, None, None, None, EngineConfig(device="cpu"))
    clients = [EngineClient(settings, None) for _ in range(2)]
    info = EngineInfo(max_model_len=64, vocab_size=100, kv_capacity_tokens=64, dtype="float32", device="cpu",
                      max_num_batched_tokens=64, attention_cost_tokens=None, kv_cache_blocks=16, block_size=4,
                      kv_cache_bytes=0, eos_token_ids=[], batch_invariance={}, tensor_parallel_size=1,
                      cache_ram_bytes=0)
    for client in clients:
        client.status, client.info = "ok", info
    router = EngineRouter(clients)
    prompt = list(range(20))
    router.last_chosen = [-1, 7]
    assert router.route(prompt, None, session="alice")[0] == 0
    router.last_chosen = [9, 7]  # worker 0 was chosen since: without the session, worker 1 would be
    assert router.route(prompt, None)[0] == 1
    assert router.route(prompt + [1], None, session="alice")[0] == 0
    clients[1].cached_blocks.update(prompt_block_hashes(prompt, 4, None))  # the prefix lives on worker 1
    assert router.route(prompt, None, session="alice") == (1, 16)
    assert router.sessions["alice"] == 1


# ---- item 7: sampling defaults by thinking mode --------------------------------------------------


def test_each_thinking_mode_has_its_own_defaults_layered_like_the_top_level():
    generation_config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2,
                         "non_thinking": {"temperature": 0.7, "top_p": 0.8}}
    override = {"thinking": {"presence_penalty": 1.5}, "non_thinking": {"top_p": 0.85}}
    flags = {"top_k": 30}
    assert sampling_defaults(generation_config, override, flags) == {"temperature": 0.6, "top_p": 0.95, "top_k": 30}
    modes = mode_sampling_defaults(generation_config, override, flags)
    assert modes[True] == {"temperature": 0.6, "top_p": 0.95, "top_k": 30, "presence_penalty": 1.5}
    assert modes[False] == {"temperature": 0.7, "top_p": 0.85, "top_k": 30}
    greedy = mode_sampling_defaults(generation_config, {}, {"temperature": 0.0})
    assert greedy[True]["temperature"] == greedy[False]["temperature"] == 0.0  # --greedy wins in every mode


def test_the_override_s_mode_objects_are_checked_at_the_start():
    check_override({"top_p": 0.9, "thinking": {"temperature": 1.0}, "non_thinking": {"top_k": 20}})
    for override, named in [({"thinking": 0.5}, "'thinking' must be an object"),
                            ({"non_thinking": {"max_tokens": 3}}, "'non_thinking.max_tokens'"),
                            ({"thinking": {"top_p": 0}}, "thinking.top_p"),
                            ({"thinking": {"thinking": {}}}, "'thinking.thinking'")]:
        with pytest.raises(ValueError, match=named):
            check_override(override)


def test_a_turn_starts_from_the_defaults_of_its_settled_thinking_mode():
    model = ModelInfo(name="served", max_model_len=512, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES),
                      sampling_defaults={"temperature": 0.6}, mode_sampling_defaults={
                          True: {"temperature": 1.0, "top_p": 0.95}, False: {"temperature": 0.7, "top_p": 0.8}})
    chat = lambda **fields: parse_chat({"messages": HI, **fields}, model).params
    assert (chat().temperature, chat().top_p) == (0.6, 1.0)  # not settled: the template decides
    assert (chat(enable_thinking=True).temperature, chat(enable_thinking=True).top_p) == (1.0, 0.95)
    assert chat(reasoning_effort="none").temperature == 0.7
    assert chat(enable_thinking=False, temperature=0.2).temperature == 0.2  # the request's own value wins
    assert responses(model, reasoning={"effort": "low"}).params.temperature == 1.0
    messages = lambda **fields: parse_messages({"model": "m", "max_tokens": 2048, "messages": HI, **fields}, model)
    assert messages().params.temperature == 0.7  # Messages without thinking: thinking off
    assert messages(thinking={"type": "enabled", "budget_tokens": 1024}).params.top_p == 0.95
    assert parse_completion({"prompt": "Hi"}, model).params.temperature == 0.6


# ---- item 13: the request log's new fields ----------------------------------------------------------


def test_the_tool_call_parse_records_calls_recoveries_and_text_fallbacks():
    tools = {"get_weather": ToolSpec("get_weather", {"type": "object"})}
    parser = ReplyParser(ReplyFormat(tool_format=HERMES, tools=tools))
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>'
            '<tool_call>\n{"name": "get_weather", "argu')
    parser.feed(text)
    parser.finish()
    reply = parser.reply
    assert reply.num_call_blocks == 3 and len(reply.tool_calls) == 2
    assert reply.text_fallbacks == ["not_a_declared_call"]
    assert not reply.tool_calls[1].complete  # cut short as the reply ended


def _finished_chat(text: str, budget: int | None, closes: int) -> RunResult:
    features = ChatFeatures(ThinkMarkers(), HERMES)
    options = ChatOptions(tools=(ToolSpec("get_weather", {"type": "object"}),), thinking_budget=budget)
    plan = plan_reply(options, features, "<think>\n", None)
    result = RunResult(1, [1, 2], received=100.0, plan=plan)
    timings = RequestTimings(arrival=100.5, scheduled=101.0, first_token=101.5, finished=103.0)
    result.add(0, GenerationOutput("r", [], [5, 6], text, [5, 6], text, None, None, FinishReason.STOP, 0, timings,
                                   num_budget_closes=closes))
    return result


def test_request_done_says_how_calls_parsed_what_the_budget_did_and_where_engine_time_went():
    result = _finished_chat('thought</think><tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', 8, 1)
    parse = tool_call_parse(result)
    assert parse["outcome"] == "text_fallback" and parse["fallback_reasons"] == ["not_a_declared_call"]
    assert (parse["call_blocks"], parse["calls"]) == (1, 0)
    assert thinking_budget(result) == {"budget": 8, "source": "thinking_budget", "forced_closes": 1}
    timing = engine_timing(result)
    assert timing == {"queue_wait_seconds": 0.5, "prefill_seconds": 0.5, "decode_seconds": 1.5,
                      "total_seconds": 2.5}
    plain = _finished_chat("thought</think>Hello", None, 0)
    assert tool_call_parse(plain)["outcome"] == "none" and thinking_budget(plain) is None


def test_a_rejected_request_s_entry_has_its_message_phase_and_shape():
    record = RequestRecord("POST", "/v1/chat/completions", "id")
    record.route, record.status = "chat", 400
    record.job, record.phase = parse_chat({"messages": HI, "reasoning_effort": "low"}, MODEL), "prepare"
    record.note_error(InvalidRequest("max_tokens is too large", param="max_tokens"))
    entry = telemetry(record)
    assert entry["outcome"] == "rejected" and entry["phase"] == "prepare"
    assert entry["message"] == "max_tokens is too large" and entry["param"] == "max_tokens"
    assert entry["shape"]["num_messages"] == 1
    assert (entry["shape"]["requested_reasoning_effort"], entry["shape"]["reasoning_effort"]) == ("low", "low")
    early = RequestRecord("POST", "/v1/chat/completions", "id2")
    early.route, early.status = "chat", 400
    assert telemetry(early)["phase"] == "parse" and telemetry(early)["shape"] is None
