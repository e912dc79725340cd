"""Token constraints inside the engine's batched sampling step, on the real default model."""

from __future__ import annotations

from ember.parsers.constraint import ForcedCall, ReplyConstraint
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.types import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def run(llm, requests: dict[str, tuple[list[int], SamplingParams, object]]) -> dict[str, list[int]]:
    """Run requests together through the engine core; their output token ids by id."""
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (prompt, params, constraint) in requests.items():
        llm.engine.add_request(rid, prompt, params, constraint=constraint)
    while llm.engine.has_unfinished():
        for step in llm.engine.step():
            outputs[step.request_id] += step.new_token_ids
    return outputs


def prompt_of(llm, text: str) -> list[int]:
    return llm.encode_prompt([{"role": "user", "content": text}])


def test_a_thinking_budget_closes_the_block_after_exactly_that_many_tokens(llm):
    tokens = llm.tokenizer.token_bytes
    constraint = ReplyConstraint(tokens, think=ThinkMarkers(), in_block=True, budget=5)
    out = run(llm, {"think": (prompt_of(llm, "Tell me about whales."), GREEDY, constraint)})["think"]
    written = tokens.join(out)
    free = tokens.join(out[:5])
    assert written.startswith(free + b"\n</think>\n\n")
    assert constraint.num_budget_closes == 1


def test_a_forced_call_writes_the_opener_and_a_declared_name(llm):
    tokens = llm.tokenizer.token_bytes
    constraint = ReplyConstraint(tokens, forced_call=ForcedCall(HERMES, ("get_weather", "get_time")))
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3)
    out = run(llm, {"call": (prompt_of(llm, "Weather in Oslo?"), params, constraint)})["call"]
    text = tokens.join(out).decode()
    assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {') or \
        text.startswith('<tool_call>\n{"name": "get_time", "arguments": {')


def test_a_constrained_neighbour_leaves_other_requests_unchanged(llm):
    plain = prompt_of(llm, "Name three rivers.")
    alone = run(llm, {"alone": (plain, GREEDY, None)})["alone"]
    constraint = ReplyConstraint(llm.tokenizer.token_bytes, think=ThinkMarkers(), in_block=True, budget=2)
    together = run(llm, {"plain": (plain, GREEDY, None),
                         "steered": (prompt_of(llm, "Count to ten."), GREEDY, constraint)})
    assert together["plain"] == alone


def test_a_forced_token_wins_over_min_tokens_suppression(llm):
    """The constraint may force an end token that min_tokens holds back: it is the stronger rule."""
    eos = sorted(llm.engine.eos_token_ids)[0]

    class ForceEnd:
        def allowed_token_ids(self, output_token_ids):
            return [eos]

    params = SamplingParams(max_tokens=8, min_tokens=4, temperature=0.0, ignore_eos=True)
    out = run(llm, {"end": (prompt_of(llm, "Hi"), params, ForceEnd())})["end"]
    assert out == [eos] * 8
