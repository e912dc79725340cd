"""Claude Code's session-title requests, told apart so that they run as background work.

Beside the user's own turns, Claude Code asks the model for a short title of the session (older
versions: whether a message starts a new topic, and its title) in requests of their own. Nobody
waits on those, so they yield to the work someone waits on. They carry no header or field that
marks them; what marks them is the instruction Claude Code writes: in the system prompt, or (for
a conversation's title) in the last user turn. The phrases below are the ones its versions write.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_TITLE_INSTRUCTIONS = (
    re.compile(r"indicates a new conversation topic.*\btitle\b", re.IGNORECASE | re.DOTALL),
    re.compile(r"\btitle\b[^\n]*\bcaptures the main topic or goal of this coding session", re.IGNORECASE),
    re.compile(r"\bcoming up with a succinct title\b", re.IGNORECASE),
    re.compile(r"\bwrite a \d+-\d+ word title for the following conversation", re.IGNORECASE),
)


def is_session_title_request(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether a conversation (neutral messages) asks for a session title in Claude Code's words."""
    if not messages:
        return False
    candidates = [m for m, role in ((messages[0], "system"), (messages[-1], "user")) if m.get("role") == role]
    return any(pattern.search(_text(message.get("content"))) for message in candidates
               for pattern in _TITLE_INSTRUCTIONS)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or () if isinstance(part, dict))
