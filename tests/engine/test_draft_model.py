"""A draft model inside the served model's steps: its entries live in the pool's blocks, so a round
feeds it only the tokens it has not seen, a prompt met again is read back, and nothing it
proposes changes a reply."""

from __future__ import annotations

import pytest

from ember.engine.spec.draft_model import DraftModelProposer
from tests.engine.test_generate import _sibling_engine
from tests.engine.test_speculative import FREE, GREEDY, REPETITIVE, _bits, _drafting_llm, _generate, _messages, _with


@pytest.fixture(scope="module")
def draft_llm(llm):
    return _drafting_llm(llm)


def _proposer(engine) -> DraftModelProposer:
    return engine.speculator.proposer


class _Feeds:
    """Every StepItem the draft model's runner is given, call by call."""

    def __init__(self, proposer: DraftModelProposer, monkeypatch) -> None:
        self.calls: list[list[tuple[int, int, bool]]] = []  # per call: (start, tokens, samples) per item
        forward = proposer.runner.forward

        def counting(items, *args, **kwargs):
            self.calls.append([(item.start, len(item.token_ids), item.samples) for item in items])
            return forward(items, *args, **kwargs)

        monkeypatch.setattr(proposer.runner, "forward", counting)

    def prefills(self) -> list[tuple[int, int]]:
        return [(start, count) for call in self.calls for start, count, samples in call if not samples]

    def drafting(self) -> list[tuple[int, int]]:
        return [(start, count) for call in self.calls for start, count, samples in call if samples]


def test_a_round_feeds_the_draft_model_only_what_it_has_not_seen(llm, draft_llm, monkeypatch):
    feeds = _Feeds(_proposer(draft_llm.engine), monkeypatch)
    prompt = REPETITIVE[0]
    drafted = _generate(draft_llm, [prompt], GREEDY)[0]
    assert _bits(drafted) == _bits(_generate(llm, [prompt], GREEDY)[0])
    num_prompt = len(drafted.prompt_token_ids)
    # the prompt once, as the served model prefilled it; then each round's new tokens: the first
    # reply token, or the last round's bonus token and its last kept draft, never more
    assert sum(count for _, count in feeds.prefills()) == num_prompt
    assert max(count for _, count in feeds.drafting()) <= 2
    assert drafted.speculation.rounds > 1 and drafted.speculation.accepted > drafted.speculation.rounds


def test_a_prompt_met_again_is_read_from_the_entries_its_blocks_kept(llm, draft_llm, monkeypatch):
    prompt = REPETITIVE[2]
    first = _generate(draft_llm, [prompt], GREEDY)[0]  # clears the prefix cache first
    feeds = _Feeds(_proposer(draft_llm.engine), monkeypatch)
    again = draft_llm.generate([_messages(prompt)], GREEDY)[0]  # its prompt's full blocks are cached now
    draft_llm.engine.check_invariants()
    assert _bits(again) == _bits(first)
    block_size = draft_llm.engine.kv_manager.block_size
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - block_size
    # only what the pool did not hold goes through the draft model again
    fed = sum(count for _, count in feeds.prefills()) + feeds.drafting()[0][1]
    assert fed <= len(again.prompt_token_ids) - again.num_cached_tokens + block_size


def test_blocks_filled_without_the_draft_model_are_computed_again_for_it(llm, draft_llm, monkeypatch):
    """A request that does not draft leaves its blocks without the draft model's entries; a
    drafting request that meets them in the prefix cache computes those entries itself."""
    prompt = FREE[0]
    serial = _generate(draft_llm, [prompt], _with(GREEDY, draft=False))[0]
    feeds = _Feeds(_proposer(draft_llm.engine), monkeypatch)
    drafted = draft_llm.generate([_messages(prompt)], GREEDY)[0]
    draft_llm.engine.check_invariants()
    assert drafted.num_cached_tokens > 0  # the served model read the cached blocks
    assert _bits(drafted) == _bits(serial)
    starts = [start for start, _ in feeds.prefills()] + [feeds.drafting()[0][0]]
    assert min(starts) == 0  # the draft model's own entries began at the first token


def test_preempted_drafting_requests_give_their_plain_replies(llm):
    """A pool too small for every request at once: requests are preempted mid-round and computed
    again, the draft model's knowledge of them with them; replies equal plain ones, no block leaks."""
    small = _drafting_llm(llm, kv_cache_tokens=640)
    prompts = REPETITIVE[2:6] + FREE[:4]
    drafted = _generate(small, prompts, _with(GREEDY, max_tokens=96))
    assert small.engine.counters.num_preemptions > 0
    plain = _generate(llm, prompts, _with(GREEDY, max_tokens=96))
    assert [_bits(d) for d in drafted] == [_bits(p) for p in plain]
    assert sum(d.speculation.accepted for d in drafted if d.speculation) > len(prompts)


def test_the_draft_model_entries_share_the_pool_memory_budget(llm):
    """Its cache has a block for each of the pool's; a memory budget pays for both models' entries."""
    budget = dict(kv_cache_tokens=None, kv_cache_memory_gb=0.05)
    drafting = _drafting_llm(llm, **budget).engine
    alone = _sibling_engine(llm.engine, **budget)
    # the draft model is the served one's 4-bit file: the same entries a token, so half the blocks
    assert drafting.kv_manager.num_blocks - 1 == (alone.kv_manager.num_blocks - 1) // 2
    assert _proposer(drafting).runner.cache.num_blocks == drafting.kv_manager.num_blocks


def test_a_draft_named_by_its_file_loads_beside_the_model_and_drafts(llm):
    """The way `ember serve --speculate draft --draft FILE` builds it: by name, through the loaders."""
    from ember import LLM
    from ember.config import SpeculativeConfig

    served = LLM(max_model_len=1024, kv_cache_tokens=8 * 1024,
                 speculative=SpeculativeConfig(mode="draft", draft_model=llm.source.path, draft_tokens=4))
    proposer = _proposer(served.engine)
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.runner.cache.num_blocks == served.engine.kv_manager.num_blocks
    prompts = REPETITIVE[2:4]
    drafted = _generate(served, prompts, GREEDY)
    assert [_bits(d) for d in drafted] == [_bits(p) for p in _generate(llm, prompts, GREEDY)]
    assert all(d.speculation.accepted > 0 for d in drafted)
