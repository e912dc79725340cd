"""Fuzzing ember's routes from its own OpenAPI document with schemathesis, against a real server.

For every operation in `/openapi.json`, Hypothesis draws valid requests (positive) and requests
that break the document (negative; an operation with nothing to break has no negative ones), EXAMPLES of each; every answer must be a status below 500
and arrive within the request timeout, and the server must be healthy afterwards. The server
runs with a small context window so that whatever the fuzzer asks for generates few tokens.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from conftest import ServerProcess

EXAMPLES = 6
REQUEST_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def fuzz_server():
    process = ServerProcess("--max-model-len", "128", "--default-max-tokens", "4", "--max-pending", "64").start()
    yield process
    process.stop()


def _operations(url: str):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    for result in schema.get_all_operations():
        yield result.ok()


def test_no_route_answers_5xx_to_anything_its_document_allows_or_forbids(fuzz_server):
    tried: Counter[str] = Counter()
    failures: list[str] = []
    operations = list(_operations(fuzz_server.url))
    assert len(operations) >= 10  # the walk saw the document
    for operation in operations:
        for mode in GenerationMode:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def probe(case):
                tried[operation.label, mode.value] += 1
                response = case.call(base_url=fuzz_server.url, timeout=REQUEST_TIMEOUT_S)
                if response.status_code >= 500:
                    failures.append(f"{operation.label} ({mode.value}): {response.status_code} "
                                    f"{response.text[:300]} for {case.body!r:.300}")

            try:
                probe()
            except Unsatisfiable:  # nothing in this operation's document can be broken (no body, no parameters)
                assert mode is GenerationMode.NEGATIVE, operation.label
    assert not failures, "\n".join(failures)
    assert {label for label, _ in tried} == {operation.label for operation in operations}  # each was called
    assert sum(count for (_, mode), count in tried.items() if mode == "negative") > 0
    health = httpx.get(fuzz_server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    by_mode = Counter()
    for (_, mode), count in tried.items():
        by_mode[mode] += count
    print(f"fuzzed {len(operations)} operations: {by_mode['positive']} valid and {by_mode['negative']} invalid "
          f"requests, 0 answers of 5xx")
