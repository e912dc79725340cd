"""What crosses between the server and its engine worker: every message survives its encoding
whole, fault plans parse or are refused, and a request run again after a restart hands on only
what its consumer does not have yet."""

from __future__ import annotations

import pytest

from ember.config import EngineConfig
from ember.constraint_spec import STRUCTURAL_TAG, ConstraintSpec, SteeringSpec
from ember.engine import messages
from ember.engine.client import _Replay
from ember.engine.faults import FaultPlan
from ember.engine.messages import Abort, Add, Outputs, Query, QueryKind, WorkerSettings
from ember.engine.stats import EngineCounters, EngineStats
from ember.errors import EngineRestarted
from ember.types import FinishReason, SamplingParams, StepOutput, TokenLogprob


def stats() -> EngineStats:
    return EngineStats.build(EngineCounters(num_steps=3, generation_tokens=7), num_running=1, num_waiting=0,
                             num_prefilling=0, kv_blocks_total=10, kv_blocks_used=2, kv_blocks_cached=1, kv_blocks_pinned=0,
                             prefix_cache_queries=4, prefix_cache_hits=2)


def test_an_add_with_every_kind_of_field_comes_back_equal():
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=42, stop=["\n\n"], stop_token_ids=[2], priority=1,
                            logit_bias={17: -5.0}, logprobs=2, logprob_token_ids=[3, 4])
    spec = ConstraintSpec(SteeringSpec("<think>", "</think>", in_block=True, budget=8, forced_tool_format="hermes",
                                       forced_names=["get_weather"]), STRUCTURAL_TAG, '{"type": "structural_tag"}',
                          "tools")
    add = Add("req-1", [1, 2, 3], params, cache_salt="s", arrival_time=12.5, constraint=spec,
              report_progress=True)
    back = messages.to_worker.decode(messages.encode(add))
    assert back == add and back.params.logit_bias == {17: -5.0} and back.constraint.steering.budget == 8


def test_step_outputs_and_statistics_come_back_equal():
    step = StepOutput("req-1", [5, 6], [TokenLogprob(5, -0.1, [(5, -0.1), (9, -2.5)]),
                                        TokenLogprob(6, -0.3, [(6, -0.3)], [(3, -4.0)])],
                      FinishReason.LENGTH, 3, 1, scheduled_time=1.5, stop_token_id=None)
    back = messages.from_worker.decode(messages.encode(Outputs([step], stats())))
    assert back.outputs == [step] and back.stats == stats()
    assert back.outputs[0].finish_reason is FinishReason.LENGTH


def test_the_other_messages_and_the_settings_come_back_equal():
    for message in (Abort(["a", "b"]), Query(7, QueryKind.STATS), messages.Shutdown()):
        assert messages.to_worker.decode(messages.encode(message)) == message
    settings = WorkerSettings("model.gguf", None, None, None, "{{ messages }}", EngineConfig(max_model_len=512),
                              fault="kill@3")
    assert messages.settings_decoder.decode(messages.encode(settings)) == settings


@pytest.mark.parametrize("text, plan", [("kill@3", FaultPlan("kill", 3)), ("raise@1,always", FaultPlan("raise", 1, True)),
                                        ("exit@load", FaultPlan("exit", 0))])
def test_fault_plans_parse(text, plan):
    assert FaultPlan.parse(text) == plan


@pytest.mark.parametrize("text", ["kill", "kill@0", "kill@x", "boom@3", "exit@3", "raise@2,often"])
def test_malformed_fault_plans_are_refused_with_the_reason(text):
    with pytest.raises(ValueError, match="EMBER_INJECT_FAULT"):
        FaultPlan.parse(text)


def step(ids, finish=None, error=None):
    return StepOutput("r", ids, None, finish, 3, 0, error=error)


def test_a_replay_drops_what_was_delivered_and_hands_on_the_rest():
    replay = _Replay([10, 11, 12])
    assert replay.trim(step([10])) is None
    assert replay.trim(step([11, 12, 13])).new_token_ids == [13]
    assert replay.trim(step([14], FinishReason.LENGTH)).new_token_ids == [14]


def test_a_replay_that_differs_or_ends_early_is_an_error():
    with pytest.raises(EngineRestarted, match="differs"):
        _Replay([10, 11]).trim(step([10, 99]))
    with pytest.raises(EngineRestarted, match="ended early"):
        _Replay([10, 11]).trim(step([10], FinishReason.STOP))
    failed = step([], FinishReason.ERROR, error="the grammar rejected a token")
    assert _Replay([10, 11]).trim(failed) is failed  # an error of its own is passed on as it is
