"""One reply held to a compiled grammar, token by token.

The grammar covers the reply's answer. With a think block, the answer starts once the block has
closed, whether the model wrote the closing marker or a thinking budget forced it (after the
budget's whole closing text); until then a ReplyConstraint follows the reasoning and forces that
close. The engine asks before each token; everything is decided from the reply's own tokens, so a
request writes the same reply alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ember.grammar.bitmask import unpack_bitmask
from ember.parsers.constraint import ReplyConstraint
from ember.tokenization.vocab import TokenBytes
from ember.types import ConstraintFailed

_BLANKS = b" \t\r\n"


class GrammarConstraint:
    """A MaskingConstraint (see ember.types): a packed bitmask while the grammar speaks, a list of ids
    while the reasoning before it is steered."""

    def __init__(self, matcher: Any, vocab_size: int, token_bytes: TokenBytes, stop_token_ids: Sequence[int], *,
                 reply: ReplyConstraint | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the model's: the width of the bitmask
        self.token_bytes = token_bytes
        self.stop_token_ids = list(stop_token_ids)
        self.reply = reply
        self.answer_start: int | None = None  # output index where the grammar took over
        self._end_marker = reply.think.end.encode() if reply is not None and reply.think is not None else b""
        self._recent = b""  # the reasoning's last bytes, where the closing marker is looked for
        self._seen = 0
        if self._answer_began():
            self.answer_start = 0

    # ---- the engine's side ------------------------------------------------------------------------

    def fill_token_bitmask(self, output_token_ids: Sequence[int], bitmask, row: int) -> bool:
        self._catch_up(output_token_ids)
        if self.answer_start is None or self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    @property
    def num_budget_closes(self) -> int:
        return self.reply.num_budget_closes if self.reply is not None else 0

    def allowed_token_ids(self, output_token_ids: Sequence[int]) -> list[int] | None:
        self._catch_up(output_token_ids)
        if self.answer_start is None:
            return self.reply.allowed_token_ids(output_token_ids)
        if self.matcher.is_terminated():  # an end token was accepted and decoding goes on (ignore_eos)
            return self.stop_token_ids
        bitmask = torch.full((1, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return unpack_bitmask(bitmask, self.vocab_size)[0].nonzero().flatten().tolist()

    @property
    def completed(self) -> bool:
        """The answer so far is a whole sentence of the grammar."""
        return self.answer_start is not None and self.matcher.is_completed()

    # ---- following the reply ----------------------------------------------------------------------

    def _catch_up(self, output_token_ids: Sequence[int]) -> None:
        end = len(output_token_ids)
        for position in range(self._seen, end):
            token_id = output_token_ids[position]
            if self.answer_start is not None:
                if not self.matcher.accept_token(token_id):
                    raise ConstraintFailed(f"the grammar rejected token {token_id} "
                                           f"({self.token_bytes[token_id]!r}) at reply position {position}")
                continue
            self.reply.allowed_token_ids(output_token_ids if position + 1 == end
                                         else output_token_ids[:position + 1])
            self._recent = (self._recent + self.token_bytes[token_id])[-(len(self._end_marker) + 64):]
            if self._answer_began():
                self.answer_start = position + 1
                self._take_overhang()
        self._seen = max(self._seen, end)  # outputs only grow; never count a token twice

    def _answer_began(self) -> bool:
        reply = self.reply
        if reply is None:
            return True
        tracker = reply.tracker
        in_reasoning = tracker is not None and tracker.in_block
        return not in_reasoning and not reply.forcing

    def _take_overhang(self) -> None:
        """Text the closing marker's token wrote past the marker belongs to the answer; blanks right
        after the marker are the separator the template puts there."""
        if not self._end_marker:
            return
        found = self._recent.rfind(self._end_marker)
        overhang = self._recent[found + len(self._end_marker):] if found >= 0 else b""
        overhang = overhang.lstrip(_BLANKS)
        if overhang and not self.matcher.accept_string(overhang.decode("utf-8", errors="replace")):
            raise ConstraintFailed("the text after the reasoning's closing marker does not start the grammar")
