"""Fields that ask for a kind of output ember's model does not tailor: how long-winded the answer
is (`verbosity`), OpenAI-side storage of chat completions (`store`), reasoning summaries
(`reasoning.summary`), and a prompt field sent to the route that reads the other one.

Each is either honoured (its neutral value), refused by name, or, where an agent client sends it on
every request, accepted and listed in `x-ember-ignored-fields`; never dropped without a word.
"""

from __future__ import annotations

from ember.errors import InvalidRequest
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields
from ember.protocols.unknown_fields import note_ignored

VERBOSITIES = ("low", "medium", "high")
NEUTRAL_VERBOSITY = "medium"  # the model's own length: what every reply already is
SUMMARIES = ("auto", "concise", "detailed")


def read_chat_verbosity(f: Fields) -> str | None:
    """Chat's `verbosity`: `medium` is honoured as is; `low` and `high` are refused by name."""
    verbosity = f.string("verbosity", choices=VERBOSITIES)
    if verbosity not in (None, NEUTRAL_VERBOSITY):
        raise unsupported("verbosity", f"verbosity '{verbosity}' cannot be honoured: this server does not steer "
                                       f"the length of replies; leave it out or send '{NEUTRAL_VERBOSITY}'")
    return verbosity


def read_text_verbosity(text: Fields) -> str | None:
    """Responses' `text.verbosity`: echoed; a value other than `medium` is listed as ignored, since
    agent clients (Codex) send it with every request from their own settings."""
    verbosity = text.string("verbosity", choices=VERBOSITIES)
    if verbosity not in (None, NEUTRAL_VERBOSITY):
        note_ignored(text.path_of("verbosity"))
    return verbosity


def read_reasoning_summary(reasoning: Fields) -> str | None:
    """Responses' `reasoning.summary` (and the older `generate_summary`): ember returns the raw
    reasoning, never a summary, so a requested summary is listed as ignored (agent clients send
    `auto` by habit); the value is echoed."""
    summary = reasoning.string("summary", choices=SUMMARIES)
    if summary is not None:
        note_ignored(reasoning.path_of("summary"))
    if reasoning.string("generate_summary", choices=SUMMARIES) is not None:
        note_ignored(reasoning.path_of("generate_summary"))
    return summary


def refuse_chat_store(f: Fields) -> None:
    """Chat's `store: true` asks for the completion to be kept for later retrieval, which this route
    does not offer: refused (`false` is what happens anyway)."""
    if f.boolean("store", False):
        raise unsupported("store", "store: true cannot be honoured: chat completions are not stored on this "
                                   "server; send store: false, or use /v1/responses, which stores responses")


def refuse_other_prompt_field(f: Fields, name: str, route: str, reads: str) -> None:
    """A prompt under the field of the other OpenAI route (`prompt` on chat, `messages` on
    completions): refused by name, since taking it would answer a different question."""
    if f.has(name):
        raise InvalidRequest(f"{name} is read by {route}; this route reads {reads}", param=name,
                             code="unsupported_parameter")
