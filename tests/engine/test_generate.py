"""The engine on the real default model: parity, batch invariance, prefix cache, stops, aborts."""

from pathlib import Path

import pytest
import torch

from ember import SamplingParams
from ember.engine.core import EngineCore
from ember.errors import ContextLengthExceeded, InvalidRequest
from ember.types import FinishReason

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."},
     {"role": "assistant", "content": "Buenos días."},
     {"role": "user", "content": "And into French?"}],
]

PROMPTS = [
    "The history of the printing press", "def fibonacci(n):", "Once upon a time in a small village",
    "The three laws of thermodynamics are", "Dear hiring manager,", "import numpy as np\n",
    "The best way to learn a language is", "In 1969, astronauts", "Recipe for pancakes:\n1.",
    "The quick brown fox", "SELECT name FROM users WHERE", "A poem about the sea:\n",
    "Photosynthesis is the process", "My favourite book is", "The mitochondria", "To be or not to be",
]


@pytest.fixture(scope="module")
def reference(llm_fp32):
    """transformers' model on the same GGUF file, in float32 (read once: transformers takes about
    20 s over a GGUF file)."""
    import transformers
    path = Path(llm_fp32.source.path)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def _reconfigured(reference, **config):
    """The reference's weights in a model of its config with `config` changed."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{**reference.config.to_dict(), **config}), dtype=torch.float32)
    model.load_state_dict(reference.state_dict())
    return model.eval()


def _greedy_pair(llm, reference, chat, max_tokens: int) -> tuple[list[int], list[int]]:
    """(ember's greedy tokens, transformers' greedy tokens) for one chat."""
    prompt = llm.encode_prompt(chat)
    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                    eos_token_id=sorted(llm.engine.eos_token_ids), pad_token_id=0)
    return ours.token_ids, theirs[0, len(prompt):].tolist()


def test_greedy_matches_transformers_on_default_model(llm_fp32, reference):
    for chat in CHATS:
        ours, theirs = _greedy_pair(llm_fp32, reference, chat, 32)
        assert ours == theirs


def test_rope_scaling_override_stretches_the_window_and_matches_transformers(llm_fp32, reference):
    from ember.llm import LLM
    yarn = {"rope_type": "yarn", "factor": 4.0}
    llm = LLM(dtype="float32", quantization="none", rope_scaling=yarn, kv_cache_tokens=4096)
    assert llm.engine.max_model_len == 4 * 8192  # SmolLM2-135M's trained length, times the factor
    stretched = _reconfigured(reference, max_position_embeddings=4 * 8192, rope_scaling={
        **yarn, "original_max_position_embeddings": 8192, "rope_theta": llm.engine.model_config.rope_theta})
    assert stretched.config.rope_parameters["rope_type"] == "yarn"
    changed = 0
    for chat in CHATS[:2]:
        ours, theirs = _greedy_pair(llm, stretched, chat, 24)
        assert ours == theirs
        plain = llm_fp32.generate([llm_fp32.encode_prompt(chat)], SamplingParams(temperature=0.0, max_tokens=24))[0]
        changed += ours != plain.token_ids
    assert changed  # the stretched positions do change what the model says
    llm.engine.check_invariants()


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_batch_invariance_greedy_and_seeded(llm):
    params = [_greedy(24) if i % 2 else SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=24)
              for i in range(len(PROMPTS))]
    together = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    for batched, single in zip(together, alone):
        assert batched.token_ids == single.token_ids
        assert batched.text == single.text


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    a = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=7, max_tokens=20))[0]
    b = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=7, max_tokens=20))[0]
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=8, max_tokens=20))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_prefix_cache_serves_shared_prefix(llm):
    engine = llm.engine
    assert engine.kv_manager.reset_prefix_cache()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    prefix = llm.tokenizer.encode(" ".join(words[i % len(words)] for i in range(400)))[:200]
    suffix_a = llm.tokenizer.encode(" What comes next in this list?")
    suffix_b = llm.tokenizer.encode(" Summarise this list in one word.")
    first = llm.generate([prefix + suffix_a], _greedy(16))[0]
    assert first.num_cached_tokens == 0
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
    second = llm.generate([prefix + suffix_b], with_logprobs)[0]
    block = engine.config.block_size
    assert second.num_cached_tokens == 200 // block * block

    # The same bits with no cache: each query row runs over all its keys in one pass, however
    # much of the prompt came from the cache.
    uncached = _sibling_engine(engine, enable_prefix_caching=False)
    uncached.add_request("x", prefix + suffix_b, with_logprobs)
    tokens, logprobs = [], []
    while uncached.has_unfinished():
        for out in uncached.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
            assert out.num_cached_tokens == 0
    assert tokens == second.token_ids
    assert logprobs == [lp.logprob for lp in second.logprobs]
    uncached.check_invariants()


def _sibling_engine(engine: EngineCore, **overrides) -> EngineCore:
    """Another engine over the same loaded model, with some settings changed."""
    settings = {name: getattr(engine.config, name) for name in engine.config.__slots__}
    config = type(engine.config)(**{**settings, **overrides})
    return EngineCore(engine.runner.model, engine.model_config, config, set(engine.eos_token_ids),
                      engine.device, engine.dtype)


def test_stop_string_across_token_boundary(llm):
    params = _greedy(40)
    full = llm.generate(PROMPTS[2], params)[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # A stop string made of the end of one token and the start of the next.
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    expected = full.text[: full.text.index(stop)]
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.stop_reason == stop
    assert out.text == expected
    kept = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert kept.text == expected + stop


def test_max_tokens_min_tokens_and_ignore_eos(llm):
    chat = [{"role": "user", "content": "Say OK."}]
    natural = llm.generate([chat], _greedy(200))[0]
    assert natural.finish_reason == FinishReason.STOP and len(natural.token_ids) < 60
    assert natural.token_ids[-1] in llm.engine.eos_token_ids

    capped = llm.generate([chat], _greedy(3))[0]
    assert capped.finish_reason == FinishReason.LENGTH and len(capped.token_ids) == 3

    floor = len(natural.token_ids) + 5
    longer = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=200, min_tokens=floor))[0]
    assert len(longer.token_ids) >= floor
    assert not set(longer.token_ids[:floor]) & llm.engine.eos_token_ids

    forced = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=len(natural.token_ids) + 10,
                                                 ignore_eos=True))[0]
    assert forced.finish_reason == FinishReason.LENGTH
    assert len(forced.token_ids) == len(natural.token_ids) + 10
    assert forced.token_ids[: len(natural.token_ids)] == natural.token_ids


def test_stop_token_ids(llm):
    full = llm.generate(PROMPTS[0], _greedy(20))[0]
    target = full.token_ids[5]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[target]))[0]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == target
    assert out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]


def test_abort_returns_every_block(llm):
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(f"abort-{i}", llm.tokenizer.encode(prompt), _greedy(50))
    for _ in range(4):
        engine.step()
    assert engine.kv_manager.num_used_blocks > 0
    engine.abort([f"abort-{i}" for i in range(6)])
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_used_blocks == 0


def test_refusals_name_both_numbers(llm):
    engine = llm.engine
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 2048 tokens; your request has 3000"):
        engine.add_request("long", [1] * 3000, _greedy(1))
    with pytest.raises(InvalidRequest, match=r"max_tokens \(2000\) plus the prompt \(100 tokens\)"):
        engine.add_request("big", [1] * 100, _greedy(2000))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request("bad", [10**9], _greedy(1))
    assert not engine.has_unfinished()


def test_logprobs(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))[0]
    assert len(out.logprobs) == 8
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0.0
        assert len(lp.top) == 3
        assert lp.top[0][1] == lp.logprob  # greedy picks a most likely token (bfloat16 logits tie often)
        assert token_id in [t for t, v in lp.top if v == lp.logprob]
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_prompt_forms(llm):
    text = llm.generate("Hello", _greedy(4))[0]
    ids = llm.generate(llm.tokenizer.encode("Hello", add_special_tokens=True), _greedy(4))[0]
    assert text.token_ids == ids.token_ids
    chat = llm.chat([{"role": "user", "content": "Hello"}], _greedy(4))
    assert chat.prompt_token_ids == llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
