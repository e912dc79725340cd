"""Claude Code's session-title requests run as background work; every other request keeps its
priority. Pure logic, through the Messages dialect's parser."""

from __future__ import annotations

import pytest

from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.protocols.anthropic_messages import parse_count_tokens, parse_messages
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.neutral import ModelInfo

MODEL = ModelInfo(name="served", max_model_len=2048, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))
BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli"}
CLAUDE_CODE = {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}
TOPIC = ("Analyze if this message indicates a new conversation topic. If it does, extract a 2-3 word title that "
         "captures the new topic. Format your response as a JSON object with two fields: 'isNewTopic' (boolean) "
         "and 'title' (string, or null if isNewTopic is false).")
SESSION = ("Generate a concise, sentence-case title (3-7 words) that captures the main topic or goal of this coding "
           "session. Return JSON with a single \"title\" field.")
BRANCH = "You are coming up with a succinct title and git branch name for a coding session."
FIX_THE_TESTS = [{"role": "user", "content": "Fix the failing tests in parser.py"}]


def priority(system=None, messages=FIX_THE_TESTS) -> int:
    body = {"model": "claude-haiku", "max_tokens": 64, "messages": messages}
    if system is not None:
        body["system"] = system
    return parse_messages(body, MODEL).params.priority


@pytest.mark.parametrize("system", [
    [BILLING, CLAUDE_CODE, {"type": "text", "text": TOPIC}],
    [BILLING, {"type": "text", "text": SESSION}],
    BRANCH,
])
def test_a_title_instruction_in_the_system_prompt_makes_a_background_request(system):
    assert priority(system) == 1


def test_a_conversation_title_asked_in_the_last_user_turn_is_background_too():
    ask = [{"role": "user", "content": [{"type": "text", "text": "Please write a 5-10 word title for the following "
                                                                 "conversation:\n\nUser: fix the tests"}]}]
    assert priority(messages=ask) == 1


@pytest.mark.parametrize("system, messages", [
    ([BILLING, CLAUDE_CODE], FIX_THE_TESTS),
    ("Give every function a clear title comment.", FIX_THE_TESTS),
    (None, [{"role": "user", "content": "Does this message indicate a new conversation topic?"}]),
    (None, [{"role": "user", "content": "Please write a 5-10 word title for the following conversation:"},
            {"role": "assistant", "content": "Fixing tests"}, {"role": "user", "content": "Now the parser."}]),
])
def test_other_requests_stay_in_the_foreground(system, messages):
    assert priority(system, messages) == 0


def test_count_tokens_is_not_a_generation_and_keeps_no_priority():
    body = {"model": "claude-haiku", "system": SESSION, "messages": FIX_THE_TESTS}
    assert parse_count_tokens(body, MODEL).params.priority == 0
