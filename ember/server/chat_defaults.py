"""The served model's chat features: its reply markers and tool-call format (from the flags or its
template), the reasoning efforts its template offers, and the server's thinking defaults."""

from __future__ import annotations

from ember.parsers import resolve_reasoning, resolve_tool_format
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.thinking import check_effort
from ember.server.config import ServerConfig


def chat_features(config: ServerConfig, tokenizer) -> ChatFeatures:
    """Refuses (an EmberError, which ends the load) a --reasoning-effort the template does not offer."""
    template = tokenizer.chat_template
    features = ChatFeatures(
        resolve_reasoning(config.reasoning_parser, template), resolve_tool_format(config.tool_call_parser, template),
        config.default_thinking_budget, efforts=tokenizer.template_traits.efforts if template else None,
        default_thinking=False if config.no_thinking else None, default_reasoning_effort=config.reasoning_effort,
        preserve_thinking=config.preserve_thinking)
    if config.reasoning_effort not in (None, "none"):
        check_effort(config.reasoning_effort, "--reasoning-effort", features)  # ends the load, naming the flag
    return features
