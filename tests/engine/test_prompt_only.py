"""max_tokens 0 on the real default model: the prompt is prefilled and cached, nothing is generated,
and the request's KV blocks go back to the pool (the autouse fixture checks the invariants)."""

from ember.types import FinishReason, SamplingParams

PROMPT = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 6


def test_a_prompt_only_request_warms_the_prefix_cache_and_generates_nothing(llm):
    prompt = llm.encode_prompt(PROMPT + "Prompt only, first.")
    warm = llm.generate([prompt], SamplingParams(max_tokens=0))[0]
    assert warm.token_ids == [] and warm.text == ""
    assert warm.finish_reason == FinishReason.LENGTH
    assert llm.engine.kv_manager.num_used_blocks == 0  # nothing held once it ended

    reply = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    full_blocks = (len(prompt) - 1) // llm.engine.kv_manager.block_size * llm.engine.kv_manager.block_size
    assert reply.num_cached_tokens >= full_blocks > 0  # the prompt-only request left its blocks cached
    assert len(reply.token_ids) == 4


def test_a_prompt_only_request_beside_a_generating_one(llm):
    prompts = [llm.encode_prompt(PROMPT + "Side by side, A."), llm.encode_prompt("Tell me about the sea.")]
    quiet, talking = llm.generate(prompts, [SamplingParams(max_tokens=0), SamplingParams(temperature=0.0,
                                                                                         max_tokens=6)])
    assert quiet.token_ids == [] and len(talking.token_ids) == 6
    alone = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert alone.token_ids == talking.token_ids
