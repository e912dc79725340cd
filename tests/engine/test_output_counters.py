"""What a request's final step output tells the front end of its run, on the real default model:
the closes its thinking budget forced, and how often it was preempted."""

from __future__ import annotations

from ember.parsers.constraint import ReplyConstraint
from ember.parsers.events import ThinkMarkers
from ember.types import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def final_outputs(llm, requests: dict) -> dict:
    """Run the requests together; each one's last step output, by id."""
    last = {}
    for rid, (prompt, params, constraint) in requests.items():
        llm.engine.add_request(rid, prompt, params, constraint=constraint)
    while llm.engine.has_unfinished():
        for step in llm.engine.step():
            last[step.request_id] = step
    return last


def test_the_final_output_carries_the_budget_closes_and_the_preemptions(llm):
    prompt = llm.encode_prompt([{"role": "user", "content": "Tell me about whales."}])
    constraint = ReplyConstraint(llm.tokenizer.token_bytes, think=ThinkMarkers(), in_block=True, budget=4)
    last = final_outputs(llm, {"budgeted": (prompt, GREEDY, constraint), "plain": (prompt, GREEDY, None)})
    assert last["budgeted"].finish_reason is not None and last["budgeted"].num_budget_closes == 1
    assert last["plain"].num_budget_closes == 0
    assert last["budgeted"].num_preemptions == last["plain"].num_preemptions == 0  # room for both
