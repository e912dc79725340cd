"""Background priority and cache breakpoints through a real `ember serve` with one sequence slot and a
small KV cache (1,024 tokens, a quarter of it pinnable): a foreground request sent after a
background flood finishes first, and a cache_control breakpoint keeps its prefix through a flood of
other prompts that evicts an unmarked one."""

from __future__ import annotations

import threading
import time
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import ServerProcess, wait_idle

# the pool alone (no host tier): a prefix that other requests push out of it is gone, unless pinned
FLAGS = ["--max-num-seqs", "1", "--max-model-len", "1024", "--cache-ram", "0", "--log-level", "info"]
ASK = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def small():
    process = ServerProcess(*FLAGS).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(small):
    with httpx.Client(base_url=small.url, timeout=300) as session:
        yield session


@pytest.fixture(scope="module")
def openai_client(small) -> openai.OpenAI:
    return openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(openai_client) -> str:
    return openai_client.models.list().data[0].id


@pytest.fixture(scope="module")
def claude(small) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=small.url, api_key="unused", max_retries=0, timeout=300)


def wait_for(http: httpx.Client, check, what: str, timeout: float = 120) -> None:
    """A liveness wait on /health, not a timing check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check(http.get("/health").json()):
            return
        time.sleep(0.05)
    raise AssertionError(f"never saw {what}")


def test_a_foreground_request_sent_after_a_background_flood_finishes_first(openai_client, http, model):
    finished: list[str] = []
    replies: dict[str, str] = {}
    lock = threading.Lock()

    def ask(name: str, priority: str) -> None:
        try:
            reply = openai_client.chat.completions.create(
                model=model, messages=ASK, max_tokens=40, temperature=0,
                extra_body={"priority": priority, "ignore_eos": True})
            text = reply.choices[0].message.content
        except openai.OpenAIError as exc:
            text = f"failed: {exc}"
        with lock:
            finished.append(name)
            replies[name] = text

    flood = [threading.Thread(target=ask, args=(f"background-{i}", "background")) for i in range(3)]
    for thread in flood:
        thread.start()
    # The flood holds the one slot (one request running, two queued) before the foreground one is sent.
    wait_for(http, lambda h: h["requests_running"] == 1 and h["requests_waiting"] == 2
             and h["engine"]["num_running"] == 1, "the background flood running")
    foreground = threading.Thread(target=ask, args=("foreground", "foreground"))
    foreground.start()
    for thread in [*flood, foreground]:
        thread.join()
    assert not any(text.startswith("failed") for text in replies.values()), replies
    assert finished[0] == "foreground", finished
    # The background request that yielded its slot resumed where it was: every greedy reply is the same.
    assert len(set(replies.values())) == 1
    wait_idle(http)


def test_priority_is_refused_by_name_when_malformed(openai_client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=model, messages=ASK, max_tokens=1, extra_body={"priority": "now"})
    assert caught.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model=model, input="Hi", max_output_tokens=1, extra_body={"priority": -2})
    assert caught.value.body["param"] == "priority"


def flood_the_cache(openai_client, model) -> None:
    """Four unrelated prompts of about 600 tokens: more than twice the KV cache passes through it."""
    for i in range(4):
        words = " ".join(f"{uuid.uuid4().hex[:6]}" for _ in range(100))
        openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": words}],
                                              max_tokens=1)


def test_a_cache_control_breakpoint_keeps_its_prefix_through_other_requests(claude, openai_client, http, model):
    def persona(tag: str) -> str:
        return f"You are the archivist of the {tag} harbour museum; you answer in one sentence. " * 5

    pinned, plain = persona(uuid.uuid4().hex[:8]), persona(uuid.uuid4().hex[:8])

    def ask(system_text: str, question: str, marked: bool):
        block = {"type": "text", "text": system_text}
        if marked:
            block["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
        return claude.messages.create(model="m", max_tokens=2, system=[block],
                                      messages=[{"role": "user", "content": question}],
                                      extra_body={"temperature": 0})

    first = ask(pinned, "When did the museum open?", marked=True)
    assert first.usage.cache_read_input_tokens == 0
    # The persona's whole blocks, written and pinned: its random tag makes it 100 to 120 tokens long.
    assert first.usage.cache_creation_input_tokens >= 80
    counted = claude.messages.count_tokens(model="m", system=[{"type": "text", "text": pinned}],
                                           messages=[{"role": "user", "content": "When did the museum open?"}])
    assert (first.usage.input_tokens + first.usage.cache_creation_input_tokens
            + first.usage.cache_read_input_tokens) == counted.input_tokens
    unmarked = ask(plain, "When did the museum open?", marked=False)
    assert unmarked.usage.cache_creation_input_tokens == 0

    flood_the_cache(openai_client, model)

    later = ask(pinned, "Who founded it?", marked=True)
    assert later.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    assert later.usage.cache_creation_input_tokens == 0  # nothing new to write: it was all read
    evicted = ask(plain, "Who founded it?", marked=False)
    assert evicted.usage.cache_read_input_tokens < unmarked.usage.input_tokens - 100  # the flood took it
    body = wait_idle(http)
    assert body["engine"]["kv_blocks_used"] == 0


def test_openai_breakpoints_are_accepted_and_malformed_options_named(openai_client, model):
    content = [{"type": "text", "text": "Some background on tides. " * 20,
                "prompt_cache_breakpoint": {"mode": "explicit"}},
               {"type": "text", "text": " What causes them?"}]
    reply = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=1,
        extra_body={"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}})
    assert reply.usage.prompt_tokens > 100
    again = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content[:1] + [{"type": "text", "text": " And why?"}]}],
        max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 96
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=model, messages=ASK, max_tokens=1,
                                              extra_body={"prompt_cache_options": {"ttl": "forever"}})
    assert caught.value.body["param"] == "prompt_cache_options.ttl"
