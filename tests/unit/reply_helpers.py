"""Reply parsing for tests: a whole reply at once, through the streaming parser the server uses."""

from __future__ import annotations

from collections.abc import Sequence

from ember.parsers.events import ParsedReply
from ember.parsers.reply import ReplyFormat, ReplyParser
from ember.tokenization.vocab import TokenBytes


def parse_reply(fmt: ReplyFormat, text: str, token_ids: Sequence[int] = (),
                token_bytes: TokenBytes | None = None) -> ParsedReply:
    parser = ReplyParser(fmt, token_bytes)
    parser.feed(text, token_ids)
    parser.finish()
    return parser.reply
