"""One reply's text, as it streams, split into reasoning, content and tool calls.

The same parser serves whole replies (one feed, then finish) and streams (many feeds), so the
joined events of a stream always equal the whole. Content is given out at once, except text that
could still be the start of a marker (`<think>`, `<tool_call>`). A call block is held until its
format shows a declared tool's name; from then on it is the reply's call and streams: a start, the
pieces of its arguments as they are written, and an end that says whether the arguments came out
whole. A block that never shows a declared name (malformed, an undeclared tool, a layout that
cannot be read as it streams) is read whole when it closes, and goes out as content exactly as
written unless it is a call after all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ember.parsers.events import (
    TEXT_EVENTS, ContentText, ParsedReply, ReasoningText, ReplyEvent, ThinkMarkers, ToolCall, ToolCallDelta,
    ToolCallStart, ToolSpec, new_call_id, streamed_call,
)
from ember.parsers.reasoning import ThinkTracker
from ember.parsers.tool_format import CLOSER, OPENER, BlockScanner, CallReader, ToolFormat
from ember.tokenization.vocab import TokenBytes


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    """How to read one reply."""

    think: ThinkMarkers | None = None  # None: no reasoning parser
    starts_in_reasoning: bool = False  # the prompt opened the think block
    may_open_reasoning: bool = False  # the reply may open a think block itself
    tool_format: ToolFormat | None = None  # None: tool-call markup is plain content
    tools: Mapping[str, ToolSpec] = field(default_factory=dict)
    parallel_tool_calls: bool = True

    @property
    def parses_tools(self) -> bool:
        return self.tool_format is not None and bool(self.tools)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReplyParser:
    def __init__(self, fmt: ReplyFormat, token_bytes: TokenBytes | None = None) -> None:
        self.fmt = fmt
        self.reply = ParsedReply()
        self.finished = False
        self._reasoning = fmt.starts_in_reasoning and fmt.think is not None
        self._at_start = fmt.think is not None and fmt.may_open_reasoning and not self._reasoning
        self._after_think = False  # whitespace right after the block is dropped
        self._pending = ""  # text received, not given out yet
        self._block: BlockScanner | None = None  # inside a call block
        self._block_text = ""  # the open block's body so far
        self._reader: CallReader | None = None  # reads the open block as it streams
        self._call: ToolCallStart | None = None  # the open block's call, once its name is known
        self._call_dropped = False  # that call is left out (parallel_tool_calls is false)
        self._streamed = False  # the open block is read as it streams (False: whole, once it closes)
        self._sent_arguments = ""  # what the open call's deltas gave out so far
        self._held_space = ""  # whitespace right after a call, given out only if more content follows
        self._wrote_since_call = False
        self._tracker = (ThinkTracker(fmt.think, token_bytes, in_block=self._reasoning,
                                      may_open=fmt.may_open_reasoning)
                         if fmt.think is not None and token_bytes is not None else None)

    # ---- input --------------------------------------------------------------------------------

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[ReplyEvent]:
        if self._tracker is not None:
            for token_id in token_ids:
                self._tracker.feed(token_id)
            self.reply.num_reasoning_tokens = self._tracker.num_tokens
        self._pending += text
        events: list[ReplyEvent] = []
        while self._step(events):
            pass
        return self._record(events)

    def finish(self) -> list[ReplyEvent]:
        """The reply ended: give out whatever was held."""
        if self.finished:
            return []
        self.finished = True
        events: list[ReplyEvent] = []
        if self._reasoning:
            self._finish_reasoning(events)
        elif self._block is not None:
            self._close_block(self._block_text + self._pending, events, lenient=True)
        elif self._pending:
            self._content(self._pending, events)
        self._pending = ""
        return self._record(events)

    # ---- states ---------------------------------------------------------------------------------

    def _step(self, events: list[ReplyEvent]) -> bool:
        """Handle what is pending as far as can be decided now; True to look again."""
        if not self._pending:
            return False
        if self._reasoning:
            return self._step_reasoning(events)
        if self._after_think:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._after_think = False
        if self._at_start:
            return self._step_start()
        if self._block is not None:
            return self._step_block(events)
        return self._step_content(events)

    def _step_start(self) -> bool:
        head = self._pending.lstrip()
        start = self.fmt.think.start
        if head.startswith(start):
            self._at_start = False
            self._reasoning = True
            self._pending = head[len(start):]
            return True
        if start.startswith(head):
            return False  # maybe the opener, cut short
        self._at_start = False
        return True

    def _step_reasoning(self, events: list[ReplyEvent]) -> bool:
        end = self.fmt.think.end
        found = self._pending.find(end)
        if found >= 0:
            # A call only mentioned in reasoning that closes stays reasoning.
            self._emit(ReasoningText(self._pending[:found]), events)
            self._pending = self._pending[found + len(end):]
            self._reasoning = False
            self._after_think = True
            return True
        safe = len(self._pending) - partial_suffix(self._pending, end)
        if self.fmt.parses_tools:
            opener = self._pending.find(OPENER)
            if opener >= 0:
                safe = min(safe, opener)  # held until the block closes or the reply ends
            else:
                safe = min(safe, len(self._pending) - partial_suffix(self._pending, OPENER))
        self._emit(ReasoningText(self._pending[:safe]), events)
        self._pending = self._pending[safe:]
        return False

    def _step_content(self, events: list[ReplyEvent]) -> bool:
        if not self.fmt.parses_tools:
            self._content(self._pending, events)
            self._pending = ""
            return False
        opener = self._pending.find(OPENER)
        if opener >= 0:
            self._content(self._pending[:opener], events)
            self._pending = self._pending[opener + len(OPENER):]
            self._open_block()
            return True
        safe = len(self._pending) - partial_suffix(self._pending, OPENER)
        self._content(self._pending[:safe], events)
        self._pending = self._pending[safe:]
        return False

    def _open_block(self) -> None:
        self.reply.num_call_blocks += 1
        self._block = self.fmt.tool_format.scanner()
        self._reader = self.fmt.tool_format.reader(self.fmt.tools)
        self._block_text = ""
        self._call, self._call_dropped, self._streamed, self._sent_arguments = None, False, True, ""

    def _step_block(self, events: list[ReplyEvent]) -> bool:
        already = len(self._block_text)
        self._block_text += self._pending
        self._pending = ""
        end = self._block.feed(self._block_text[already:])
        if end is None:
            # Text that may be the closing tag arriving is not read yet.
            self._read_call(self._block_text[:len(self._block_text) - partial_suffix(self._block_text, CLOSER)],
                            events)
            return False
        self._pending = self._block_text[end + len(CLOSER):]
        self._close_block(self._block_text[:end], events, lenient=False)
        return True

    def _read_call(self, body: str, events: list[ReplyEvent]) -> None:
        """Give out what the open block shows of its call so far: its start, new argument text."""
        if not self._streamed:
            return
        if self._call is None:
            name = self._reader.head(body)
            if name is None:
                return
            if name is False:
                self._streamed = False
                return
            self._held_space = ""
            self._wrote_since_call = False
            index = self._num_calls(events)
            self._call = ToolCallStart(index, new_call_id(), name)
            self._call_dropped = bool(index) and not self.fmt.parallel_tool_calls
            if not self._call_dropped:
                self._emit(self._call, events)
        self._send_arguments(self._reader.arguments(body), events)

    def _send_arguments(self, arguments: str, events: list[ReplyEvent]) -> None:
        new = arguments[len(self._sent_arguments):]
        if new and not self._call_dropped:
            self._emit(ToolCallDelta(self._call.index, new), events)
        self._sent_arguments = arguments

    def _close_block(self, body: str, events: list[ReplyEvent], *, lenient: bool) -> None:
        """A whole block (or, at the end of the reply, an unclosed one) ends its call, or becomes a
        call or content."""
        self._block = None
        self._read_call(body, events)
        call = self._call
        if call is not None:
            arguments, rest, complete = self._reader.finish(body, closed=not lenient)
            self._send_arguments(arguments, events)
            if self._call_dropped:
                self.reply.num_dropped_calls += 1
                return
            self._emit(ToolCall(call.index, call.id, call.name, arguments, complete), events)
            self._content(rest, events)
            return
        parsed = self.fmt.tool_format.parse(body, self.fmt.tools)
        if parsed is None:
            self.reply.text_fallbacks.append("unclosed_block" if lenient else "not_a_declared_call")
            self._content(OPENER + body + ("" if lenient else CLOSER), events)
            return
        self.reply.num_recovered_calls += 1
        self._held_space = ""
        self._wrote_since_call = False
        index = self._num_calls(events)
        if index and not self.fmt.parallel_tool_calls:
            self.reply.num_dropped_calls += 1
            return
        name, arguments = parsed
        for event in streamed_call(ToolCall(index, new_call_id(), name, arguments)):
            self._emit(event, events)

    def _finish_reasoning(self, events: list[ReplyEvent]) -> None:
        """The reply ended inside its think block: a call written there is the reply's call."""
        pending = self._pending
        opener = pending.find(OPENER) if self.fmt.parses_tools else -1
        if opener >= 0:
            inner = ReplyParser(ReplyFormat(tool_format=self.fmt.tool_format, tools=self.fmt.tools,
                                            parallel_tool_calls=self.fmt.parallel_tool_calls))
            inner_events = inner.feed(pending[opener:]) + inner.finish()
            self.reply.num_call_blocks += inner.reply.num_call_blocks
            if inner.reply.tool_calls:
                self.reply.num_recovered_calls += len(inner.reply.tool_calls) + inner.reply.num_dropped_calls
                self._emit(ReasoningText(pending[:opener]), events)
                offset = len(self.reply.tool_calls)
                for event in inner_events:
                    if not isinstance(event, TEXT_EVENTS):
                        event = dataclasses.replace(event, index=event.index + offset)
                    self._emit(event, events)
                self.reply.num_dropped_calls += inner.reply.num_dropped_calls
                return
        self._emit(ReasoningText(pending), events)

    # ---- output -------------------------------------------------------------------------------

    def _content(self, text: str, events: list[ReplyEvent]) -> None:
        if not text:
            return
        if self._num_calls(events) and not self._wrote_since_call:
            if not text.strip():
                self._held_space += text
                return
            text, self._held_space = self._held_space + text, ""
            self._wrote_since_call = True
        self._emit(ContentText(text), events)

    def _num_calls(self, events: list[ReplyEvent]) -> int:
        """Calls given out so far, this batch's included."""
        return len(self.reply.tool_calls) + sum(isinstance(e, ToolCall) for e in events)

    @staticmethod
    def _emit(event: ReplyEvent, events: list[ReplyEvent]) -> None:
        if isinstance(event, TEXT_EVENTS):
            if not event.text:
                return
            if events and type(events[-1]) is type(event):
                events[-1] = type(event)(events[-1].text + event.text)
                return
        events.append(event)

    def _record(self, events: list[ReplyEvent]) -> list[ReplyEvent]:
        for event in events:
            self.reply.add(event)
        return events
