"""Token ids to text, one step at a time, and stop strings matched across token boundaries."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first, so the first output token decodes with its true
# leading space (SentencePiece-style decoders strip a space at the start of a text).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns output token ids into text deltas; never emits half a UTF-8 character."""

    def __init__(self, backend_tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = backend_tokenizer  # a `tokenizers.Tokenizer`
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        pieces = []
        for token_id in token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                pieces.append(piece)
        return "".join(pieces)


class StopStringMatcher:
    """Holds back text that might be the start of a stop string until it is known not to be.

    `push(delta)` returns (text safe to release, the stop string matched or None). After a match,
    the returned text ends right before the stop string (or after it, if it is to be included).
    `flush()` releases what is held when the request ends for another reason.
    """

    def __init__(self, stop: list[str], include_in_output: bool = False) -> None:
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._include = include_in_output
        self._pending = ""

    def push(self, delta: str) -> tuple[str, str | None]:
        if not self._stop:
            return delta, None
        text = self._pending + delta  # the held part alone never contains a whole stop string
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = text.find(stop)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self._pending = ""
            return text[: at + len(stop)] if self._include else text[:at], stop
        keep = min(self._hold, len(text))
        self._pending = text[len(text) - keep:]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text
