"""Where a reply's think block is, token by token: the count a thinking budget and
`reasoning_tokens` use, from the tokens themselves rather than re-tokenized text."""

from __future__ import annotations

from ember.parsers.events import ThinkMarkers
from ember.tokenization.vocab import TokenBytes

_WHITESPACE = b" \t\r\n"


class ThinkTracker:
    """Follows one reply's tokens. `num_tokens` counts the reasoning tokens: those of a block the
    prompt opened, or of one the reply opens itself (opener included), through the token that
    completes the closing marker."""

    def __init__(self, markers: ThinkMarkers, token_bytes: TokenBytes, *, in_block: bool,
                 may_open: bool) -> None:
        self.start = markers.start.encode()
        self.end = markers.end.encode()
        self.token_bytes = token_bytes
        self.in_block = in_block
        self.closed = False
        self.num_tokens = 0
        self.undecided = may_open and not in_block  # the reply may still open a block itself
        self._head = b""  # the reply's opening bytes while undecided
        self._num_head_tokens = 0
        self._tail = b""  # the block's last bytes, where the closing marker is looked for

    def feed(self, token_id: int) -> None:
        piece = self.token_bytes[token_id]
        if self.undecided:
            self._head += piece
            self._num_head_tokens += 1
            head = self._head.lstrip(_WHITESPACE)
            if head.startswith(self.start):
                self.undecided = False
                self.in_block = True
                self.num_tokens = self._num_head_tokens - 1
                piece = head[len(self.start):]
            elif not self.start.startswith(head):
                self.undecided = False
                return
            else:
                return
        if not self.in_block:
            return
        self.num_tokens += 1
        self._tail = (self._tail + piece)[-(len(self.end) + len(piece)):]
        if self.end in self._tail:
            self.in_block = False
            self.closed = True
