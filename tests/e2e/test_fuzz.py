"""Fuzzing ember's routes with schemathesis against a real server, from two OpenAPI documents:

- ember's own `/openapi.json`, every operation;
- another server's document (document 002 of the reference set), cut down by
  `tools/foreign_spec.py` to the routes ember shares with it and to their structure, committed as
  `tests/e2e/specs/foreign_openapi.json` (the reference set is not part of ember's repository). A
  spec ember did not write draws requests ember's own document would not think of.

For every operation Hypothesis draws valid requests (positive) and requests that break the document
(negative; an operation with nothing to break has no negative ones), EXAMPLES of each; every answer
must be a status below 500 and arrive within the request timeout, and the server must be healthy
afterwards. The server runs with a small context window so that whatever the fuzzer asks for
generates few tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from conftest import ServerProcess

EXAMPLES = 6
REQUEST_TIMEOUT_S = 60
FOREIGN_SPEC = Path(__file__).parent / "specs" / "foreign_openapi.json"


@pytest.fixture(scope="module")
def fuzz_server():
    process = ServerProcess("--max-model-len", "128", "--default-max-tokens", "4", "--max-pending", "64").start()
    yield process
    process.stop()


def fuzz(schema, base_url: str) -> tuple[Counter, list[str], list]:
    """Every operation of `schema`, both modes, against `base_url`: (requests tried by (operation,
    mode), the answers of 5xx, the operations)."""
    tried: Counter[tuple[str, str]] = Counter()
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        for mode in GenerationMode:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def probe(case):
                tried[operation.label, mode.value] += 1
                response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
                if response.status_code >= 500:
                    failures.append(f"{operation.label} ({mode.value}): {response.status_code} "
                                    f"{response.text[:300]} for {case.body!r:.300}")

            try:
                probe()
            except Unsatisfiable:  # nothing in this operation's document can be broken (no body, no parameters)
                assert mode is GenerationMode.NEGATIVE, operation.label
    return tried, failures, operations


def check_run(process: ServerProcess, tried: Counter, failures: list[str], operations: list, what: str) -> None:
    assert not failures, "\n".join(failures)
    assert {label for label, _ in tried} == {operation.label for operation in operations}  # each was called
    assert sum(count for (_, mode), count in tried.items() if mode == "negative") > 0
    health = httpx.get(process.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    by_mode = Counter()
    for (_, mode), count in tried.items():
        by_mode[mode] += count
    print(f"{what}: fuzzed {len(operations)} operations: {by_mode['positive']} valid and {by_mode['negative']} "
          f"invalid requests, 0 answers of 5xx")


def test_no_route_answers_5xx_to_anything_its_document_allows_or_forbids(fuzz_server):
    tried, failures, operations = fuzz(schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json"),
                                       fuzz_server.url)
    assert len(operations) >= 10  # the walk saw the document
    check_run(fuzz_server, tried, failures, operations, "ember's document")


def test_no_shared_route_answers_5xx_to_what_another_server_s_document_allows_or_forbids(fuzz_server):
    tried, failures, operations = fuzz(schemathesis.openapi.from_path(str(FOREIGN_SPEC)), fuzz_server.url)
    assert len(operations) >= 10  # chat, completions, responses, messages, count_tokens, models, health ...
    check_run(fuzz_server, tried, failures, operations, "the foreign document")
