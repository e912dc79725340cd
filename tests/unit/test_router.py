"""The data-parallel router's decisions (ember.engine.router): which worker a prompt goes to, and
the prefix hashes it compares, checked against the KV manager that reports them."""

from __future__ import annotations

import dataclasses

import pytest

from ember.config import EngineConfig
from ember.engine.kv_cache import KVCacheManager
from ember.engine.messages import WorkerSettings
from ember.engine.request import Request
from ember.engine.router import choose_worker, leading_matches, prompt_block_hashes, replica_launches
from ember.errors import EngineUnavailable
from ember.types import SamplingParams


def test_the_longest_match_wins_then_load_then_the_one_chosen_longest_ago():
    assert choose_worker([0, 3], [2, 0], [5, 4], [True, True]) == 1
    assert choose_worker([3, 3], [2, 1], [0, 9], [True, True]) == 1
    assert choose_worker([0, 0], [1, 1], [4, 3], [True, True]) == 1
    assert choose_worker([0, 0], [0, 0], [-1, -1], [True, True]) == 0


def test_a_worker_too_far_over_the_least_loaded_is_passed_over():
    assert choose_worker([9, 0], [5, 0], [0, 0], [True, True], max_imbalance=4) == 1
    assert choose_worker([9, 0], [4, 0], [0, 0], [True, True], max_imbalance=4) == 0


def test_a_worker_with_every_seat_taken_is_passed_over_while_another_has_one():
    assert choose_worker([9, 0], [2, 0], [0, 0], [True, True], seats=2) == 1
    assert choose_worker([9, 0], [2, 1], [0, 0], [True, True], seats=2) == 1
    assert choose_worker([9, 0], [1, 0], [0, 0], [True, True], seats=2) == 0
    assert choose_worker([9, 0], [2, 2], [0, 0], [True, True], seats=2) == 0  # all full: as without seats


def test_a_worker_that_is_down_gets_nothing():
    assert choose_worker([9, 0], [0, 3], [0, 0], [False, True]) == 1
    with pytest.raises(EngineUnavailable):
        choose_worker([0, 0], [0, 0], [0, 0], [False, False])


def test_the_router_hashes_prompts_as_the_cache_does():
    """The blocks a KV manager caches for a computed prompt are the router's hashes of that prompt,
    and its change log carries exactly them."""
    manager = KVCacheManager(num_blocks=32, block_size=4)
    manager.record_cache_changes()
    tokens = list(range(100, 118))  # 18 tokens: 4 whole blocks
    request = Request("a", tokens, SamplingParams(), max_tokens=1, eos_token_ids=(), arrival_time=0.0, cache_salt="salt")
    assert manager.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    manager.cache_full_blocks(request)
    cleared, stored, removed = manager.take_cache_changes()
    assert cleared and not removed
    hashes = prompt_block_hashes(tokens, 4, "salt")
    assert len(hashes) == 4 and set(stored) == set(hashes)
    assert prompt_block_hashes(tokens, 4, None)[0] not in set(stored)  # the salt is part of the hash
    assert leading_matches(prompt_block_hashes(tokens[:13] + [0] * 5, 4, "salt"), set(stored)) == 3
    assert manager.take_cache_changes() == (False, [], [])


def test_evicted_and_cleared_blocks_are_reported():
    manager = KVCacheManager(num_blocks=3, block_size=4)  # two usable blocks
    manager.record_cache_changes()
    first = Request("a", list(range(9)), SamplingParams(), max_tokens=1, eos_token_ids=(), arrival_time=0.0)
    assert manager.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    manager.cache_full_blocks(first)
    manager.free(first)
    _, stored, _ = manager.take_cache_changes()
    second = Request("b", list(range(50, 59)), SamplingParams(), max_tokens=1, eos_token_ids=(), arrival_time=0.0)
    assert manager.allocate_slots(second, 8)  # takes both cached blocks: they are evicted
    _, _, removed = manager.take_cache_changes()
    assert set(removed) == set(stored)
    manager.free(second)
    assert manager.reset_prefix_cache()
    assert manager.take_cache_changes()[0] is True


def test_replicas_split_the_cores_and_the_gpus():
    settings = WorkerSettings("m", None, None, None, None, EngineConfig(device="cpu"))
    launches = replica_launches(settings, 2, environ={})
    assert [env for _, env in launches] == [None, None]
    assert all(replica.report_cache_changes and replica.engine.num_threads >= 1 for replica, _ in launches)
    gpu = dataclasses.replace(settings.engine, device="cuda", num_threads=3)
    launches = replica_launches(WorkerSettings("m", None, None, None, None, gpu), 2,
                                environ={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launches] == ["4", "5"]
    assert [replica.engine.num_threads for replica, _ in launches] == [3, 3]
