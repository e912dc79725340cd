"""What a request may leave out or add, against real `ember serve` processes through the `openai` and
`anthropic` libraries: unknown fields (ignored and listed, or refused with --strict-fields), the
server's sampling defaults, reasoning efforts the template offers and --reasoning-effort,
--no-thinking, preserve_thinking and its inheritance, Codex's shell history items, and /generate
with max_new_tokens 0."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import ServerProcess, wait_idle

TEMPLATES = Path(__file__).parent / "templates"
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper and the sea."}]
HISTORY = [{"role": "user", "content": "What is two plus two?"},
           {"role": "assistant", "content": "Four.",
            "reasoning_content": "The user asks a sum. Two and two make four, which I should say plainly."},
           {"role": "user", "content": "And three plus three?"}]
IGNORED = "x-ember-ignored-fields"


def openai_client(process: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def claude_client(process: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=process.url, api_key="unused", max_retries=0, timeout=300)


def chat_text(completion) -> str:
    message = completion.choices[0].message
    return (getattr(message, "reasoning_content", None) or "") + (message.content or "")


# ---- the default server: unknown fields are accepted, listed and logged once -------------------------------

def test_an_unknown_field_is_ignored_listed_in_a_header_and_logged_once(server, client, model_id):
    mark = len(server.lines)
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=model_id, messages=STORY, max_tokens=4, temperature=0,
            extra_body={"x_new_field": {"anything": 1}, "x_unset_field": None})
        assert raw.headers[IGNORED] == "x_new_field"
        assert raw.parse().choices[0].message.content
    logged = [line for line in server.log_since(mark) if "ignored the unknown request field x_new_field" in line]
    assert len(logged) == 1
    known = client.chat.completions.with_raw_response.create(model=model_id, messages=STORY, max_tokens=2)
    assert IGNORED not in known.headers
    message = claude_client(server).messages.with_raw_response.create(
        model="claude", max_tokens=4, messages=STORY, extra_body={"x_new_field": 1, "x_other": "y"})
    assert message.headers[IGNORED] == "x_new_field, x_other" and message.parse().content
    refused = client.chat.completions.with_raw_response  # a field ember knows but cannot honour: refused
    with pytest.raises(openai.BadRequestError) as error:
        refused.create(model=model_id, messages=STORY, extra_body={"functions": [{"name": "f"}]})
    assert error.value.body["param"] == "functions"


def test_codex_shell_history_items_reach_the_prompt_and_unknown_include_values_are_ignored(client, model_id):
    question = {"type": "message", "role": "user", "content": "What files are in /tmp?"}
    shell = [{"type": "local_shell_call", "id": "lsh_1", "call_id": "call_1", "status": "completed",
              "action": {"type": "exec", "command": ["ls", "-la", "/tmp"], "working_directory": "/tmp"}},
             {"type": "local_shell_call_output", "call_id": "call_1", "output": "notes.txt\nreport.pdf"}]
    plain = client.responses.create(model=model_id, input=[question], max_output_tokens=4, temperature=0,
                                    store=False)
    with_shell = client.responses.create(model=model_id, input=[question, *shell], max_output_tokens=4,
                                         temperature=0, store=False, include=["file_search_call.results"])
    assert with_shell.usage.input_tokens > plain.usage.input_tokens + 8  # the command and its output
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model_id, input="Hi", include=["message.output_text.logprobs"])
    assert error.value.body["param"] == "include[0]"


def test_generate_with_max_new_tokens_zero_prefills_the_prompt_only(http):
    text = "The keeper climbed the stairs of the lighthouse every evening to light the lamp for the ships. " * 3
    reply = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 0}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["text"] == "" and body["output_ids"] == []
    info = body["meta_info"]
    assert info["completion_tokens"] == 0 and info["prompt_tokens"] > 32
    assert info["finish_reason"] == {"type": "length", "length": 0}
    wait_idle(http)  # no KV block is left held
    again = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}}).json()
    assert again["meta_info"]["cached_tokens"] >= 16  # the prompt's full blocks stayed in the prefix cache


# ---- a strict server with defaults of its own -----------------------------------------------------------

@pytest.fixture(scope="module")
def strict_server():
    process = ServerProcess(
        "--max-model-len", "1024", "--served-model-name", "m", "--strict-fields", "--chat-template", str(TEMPLATES / "effort_levels.jinja"),
        "--reasoning-effort", "low", "--preserve-thinking", "--top-p", "0.9",
        "--override-generation-config", '{"temperature": 0.0, "top_p": 0.5, "min_p": 0.02}').start()
    yield process
    process.stop()


def test_strict_fields_refuses_an_unknown_field_by_name(strict_server):
    client = openai_client(strict_server)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=STORY, max_tokens=2, extra_body={"x_new_field": 1})
    assert (error.value.body["code"], error.value.body["param"]) == ("unknown_parameter", "x_new_field")
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude_client(strict_server).messages.create(model="claude", max_tokens=2, messages=STORY,
                                                     extra_body={"x_new_field": 1})
    assert "x_new_field" in refused.value.message
    reply = httpx.post(strict_server.url + "/generate", json={"text": "Hi", "x_new_field": 1}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "unknown_parameter"
    assert client.chat.completions.create(model="m", messages=STORY, max_tokens=2).choices[0].finish_reason


def test_the_server_sampling_defaults_apply_and_a_request_s_own_values_win(strict_server):
    client = openai_client(strict_server)

    def ask(**fields) -> str:
        return chat_text(client.chat.completions.create(model="m", messages=STORY, max_tokens=24, **fields))

    greedy = ask(temperature=0)
    # temperature 0 from --override-generation-config: whatever the seed, the reply is the greedy one
    assert ask(seed=1) == greedy and ask(seed=2) == greedy
    # the request's own temperature wins: the draws now differ with the seed
    assert len({ask(seed=seed, temperature=1.0) for seed in (1, 2, 3)}) > 1
    ran = [entry["sampling"] for entry in httpx.get(strict_server.url + "/debug/requests", timeout=30).json()["data"]
           if entry.get("sampling")][-6:]
    # --top-p wins over the override's top_p; the override's min_p stays; the request's temperature wins
    assert all(s["top_p"] == 0.9 and s["min_p"] == 0.02 for s in ran)
    assert [s["temperature"] for s in ran] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_an_effort_the_template_does_not_offer_is_refused_and_the_default_effort_applies(strict_server):
    client = openai_client(strict_server)
    for effort in ("xhigh", "max", "minimal"):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="m", messages=STORY, max_tokens=2, reasoning_effort=effort)
        assert (error.value.body["code"], error.value.body["param"]) == ("reasoning_effort_not_supported",
                                                                         "reasoning_effort")
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="m", input="Hi", max_output_tokens=2, reasoning={"effort": "xhigh"})
    assert error.value.body["param"] == "reasoning.effort"
    tokens = {effort: client.chat.completions.create(model="m", messages=STORY, max_tokens=1,
                                                     reasoning_effort=effort).usage.prompt_tokens
              for effort in ("low", "high", "none")}
    default = client.chat.completions.create(model="m", messages=STORY, max_tokens=1).usage.prompt_tokens
    assert default == tokens["low"] and tokens["high"] > tokens["low"] and tokens["none"] != tokens["low"]
    stored = client.responses.create(model="m", input="Hi", max_output_tokens=1, store=False)
    assert stored.reasoning.effort == "low"


def test_preserve_thinking_defaults_to_the_server_and_a_child_response_inherits_its_parent(strict_server):
    client = openai_client(strict_server)

    def prompt_tokens(**fields) -> int:
        return client.chat.completions.create(model="m", messages=HISTORY, max_tokens=1, **fields).usage.prompt_tokens

    kept = prompt_tokens()  # --preserve-thinking: the closed turn keeps its reasoning
    assert kept == prompt_tokens(extra_body={"preserve_thinking": True}) == \
        prompt_tokens(extra_body={"chat_template_kwargs": {"preserve_thinking": True}})
    dropped = prompt_tokens(extra_body={"preserve_thinking": False})
    assert kept > dropped + 10
    with pytest.raises(openai.BadRequestError) as error:
        prompt_tokens(extra_body={"preserve_thinking": True, "chat_template_kwargs": {"preserve_thinking": False}})
    assert "chat_template_kwargs.preserve_thinking" in error.value.body["message"]
    parent = client.responses.create(model="m", input=[
        {"type": "message", "role": "user", "content": "What is two plus two?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Two and two make four, "
                                                          "which I should say plainly and briefly."}]},
        {"type": "message", "role": "assistant", "content": "Four."}], max_output_tokens=1,
        extra_body={"preserve_thinking": False})
    child = client.responses.create(model="m", previous_response_id=parent.id, input="And three plus three?",
                                    max_output_tokens=1)
    kept_child = client.responses.create(model="m", previous_response_id=parent.id, input="And three plus three?",
                                         max_output_tokens=1, extra_body={"preserve_thinking": True})
    assert parent.model_extra["preserve_thinking"] is False and child.model_extra["preserve_thinking"] is False
    assert kept_child.usage.input_tokens > child.usage.input_tokens + 10


# ---- --no-thinking and --greedy ---------------------------------------------------------------------------

def test_no_thinking_and_greedy_are_defaults_a_request_can_override():
    process = ServerProcess("--max-model-len", "1024", "--served-model-name", "m", "--no-thinking", "--greedy",
                            "--chat-template", str(TEMPLATES / "effort_levels.jinja")).start()
    try:
        client = openai_client(process)
        plain = client.chat.completions.create(model="m", messages=STORY, max_tokens=16)
        assert plain.choices[0].message.reasoning_content is None and plain.choices[0].message.content
        thinking = client.chat.completions.create(model="m", messages=STORY, max_tokens=16,
                                                  extra_body={"enable_thinking": True})
        assert thinking.choices[0].message.reasoning_content
        again = client.chat.completions.create(model="m", messages=STORY, max_tokens=16, seed=7)
        assert again.choices[0].message.content == plain.choices[0].message.content  # greedy: the seed is moot
        sampled = {client.chat.completions.create(model="m", messages=STORY, max_tokens=16, temperature=1.0,
                                                  seed=seed).choices[0].message.content for seed in (1, 2, 3)}
        assert len(sampled) > 1
    finally:
        process.stop()


def test_a_default_effort_the_template_does_not_offer_stops_the_start():
    process = ServerProcess("--max-model-len", "256", "--reasoning-effort", "xhigh",
                            "--chat-template", str(TEMPLATES / "effort_levels.jinja"))
    with pytest.raises(RuntimeError):
        process.start()
    assert any("--reasoning-effort 'xhigh'" in line for line in process.lines)
    assert process.proc.wait(30) == 1
