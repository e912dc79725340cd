"""Token-level control of one chat reply: a thinking budget's close, and a forced tool call.

The engine asks `allowed_token_ids(output so far)` before each token. Everything here is decided
from the reply's own tokens, so a request writes the same reply alone, in a batch, streamed or not.
Forcing works by masking: while the reply must write a fixed text, only tokens that continue that
text are allowed, so the model still picks among them by its own logits (which declared name, for
one, or how a forced text is split into tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import JsonQuotes
from ember.parsers.reasoning import ThinkTracker
from ember.parsers.tool_format import CLOSER, ToolFormat
from ember.tokenization.vocab import TokenBytes


@dataclass(frozen=True, slots=True)
class ForcedCall:
    """The reply's answer must be a call to one of `names`."""

    tool_format: ToolFormat
    names: tuple[str, ...]


class _Literal:
    """The reply must go on with one of `targets`, byte for byte."""

    def __init__(self, targets: Sequence[bytes], on_done: Callable[[bytes], None], written: bytes = b"") -> None:
        self.targets = list(targets)
        self.on_done = on_done
        self.written = written


def budget_close_text(think: ThinkMarkers) -> str:
    """What a thinking budget's close writes into the reply (counted in its tokens)."""
    return f"\n{think.end}\n\n"


class ReplyConstraint:
    def __init__(self, token_bytes: TokenBytes, *, think: ThinkMarkers | None = None, in_block: bool = False,
                 may_open: bool = False, budget: int | None = None, forced_call: ForcedCall | None = None) -> None:
        self.token_bytes = token_bytes
        self.tracker = ThinkTracker(think, token_bytes, in_block=in_block, may_open=may_open) if think else None
        self.think = think
        self.budget = budget
        self.forced_call = forced_call
        self.num_budget_closes = 0
        self._call_state = "waiting" if forced_call is not None else "done"
        self._literal: _Literal | None = None
        self._json_depth: int | None = None  # hermes arguments: brace depth while the model writes them
        self._quotes = JsonQuotes()
        self._seen = 0
        self._plan()

    # ---- the engine's side ------------------------------------------------------------------------

    def allowed_token_ids(self, output_token_ids: Sequence[int]) -> list[int] | None:
        for token_id in output_token_ids[self._seen:]:
            self._advance(token_id)
        self._seen = max(self._seen, len(output_token_ids))  # outputs only grow; never count a token twice
        literal = self._literal
        if literal is None:
            return None
        ids: list[int] = []
        for target in literal.targets:
            if target.startswith(literal.written):
                ids.extend(self.token_bytes.ids_starting(target[len(literal.written):]))
        if not ids:  # no token writes the rest: give up forcing rather than stall
            self._literal = None
            return None
        return list(dict.fromkeys(ids))

    @property
    def forcing(self) -> bool:
        """A fixed text (a budget's close, a call's opener) is being written."""
        return self._literal is not None

    # ---- following the reply ----------------------------------------------------------------------

    def _advance(self, token_id: int) -> None:
        piece = self.token_bytes[token_id]
        if self.tracker is not None:
            self.tracker.feed(token_id)
        literal = self._literal
        if literal is not None:
            literal.written += piece
            if literal.written in literal.targets:
                self._literal = None
                literal.on_done(literal.written)
            elif not any(t.startswith(literal.written) for t in literal.targets):
                self._literal = None  # the reply left the text (a stop, a preemption race): let it be
        elif self._json_depth is not None:
            self._follow_arguments(piece)
        self._plan()

    def _plan(self) -> None:
        """Start forcing whatever the reply owes now."""
        if self._literal is not None or self._json_depth is not None:
            return
        tracker = self.tracker
        if tracker is not None and tracker.in_block:
            if self.budget is not None and tracker.num_tokens >= self.budget:
                self.num_budget_closes += 1
                close = budget_close_text(self.think).encode()
                self._literal = _Literal([close], lambda _: None)
            return
        if self._call_state != "waiting":
            return
        prefix = self.forced_call.tool_format.call_prefix.encode()
        if tracker is not None and tracker.undecided:
            # The reply may still open a think block: it either does, or the call opens now.
            self._literal = _Literal([prefix, self.think.start.encode()], self._opened)
        else:
            self._literal = _Literal([prefix], self._opened)

    def _opened(self, written: bytes) -> None:
        if written != self.forced_call.tool_format.call_prefix.encode():
            return  # a think block opened; the call waits for it to close
        self._call_state = "name"
        suffix = self.forced_call.tool_format.name_suffix
        self._literal = _Literal([(name + suffix).encode() for name in self.forced_call.names], self._named)

    def _named(self, _: bytes) -> None:
        after = self.forced_call.tool_format.after_name
        self._literal = _Literal([after.encode()], self._arguments_open)

    def _arguments_open(self, _: bytes) -> None:
        self._call_state = "done"
        if self.forced_call.tool_format.after_name.endswith("{"):
            self._json_depth = 1  # the model writes the arguments; ember closes the call after them

    def _follow_arguments(self, piece: bytes) -> None:
        for position, byte in enumerate(piece):
            char = chr(byte)
            if not self._quotes.structural(char):
                continue
            if char in "{[":
                self._json_depth += 1
            elif char in "}]":
                self._json_depth -= 1
                if self._json_depth == 0:
                    self._json_depth = None
                    rest = piece[position + 1:]
                    ending = f"}}\n{CLOSER}".encode()
                    if ending.startswith(rest) and rest != ending:
                        self._literal = _Literal([ending], lambda _: None, rest)
                    return
