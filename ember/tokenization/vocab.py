"""Every token's raw bytes, for token-level control that must see text the model writes one token
at a time (a marker spread over several tokens, a name held to a list of names)."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """id -> bytes, and the reverse lookup by exact byte string."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)
        by_bytes: dict[bytes, list[int]] = defaultdict(list)
        for token_id, piece in enumerate(self.pieces):
            if piece:
                by_bytes[piece].append(token_id)
        self.ids_by_bytes = dict(by_bytes)

    def __getitem__(self, token_id: int) -> bytes:
        return self.pieces[token_id] if 0 <= token_id < len(self.pieces) else b""

    def join(self, token_ids: Sequence[int]) -> bytes:
        return b"".join(self[t] for t in token_ids)

    def ids_starting(self, text: bytes) -> list[int]:
        """Ids of the tokens whose bytes are a non-empty prefix of `text`: the tokens that write
        `text` onwards without leaving it."""
        ids: list[int] = []
        for end in range(1, len(text) + 1):
            ids.extend(self.ids_by_bytes.get(text[:end], ()))
        return ids


def build_token_bytes(backend: Any, vocab_size: int) -> TokenBytes:
    """From a `tokenizers.Tokenizer`: byte-level vocabularies map their stand-in characters back to
    bytes; SentencePiece ones turn "▁" into a space and <0xNN> pieces into that byte. Added tokens
    are their text."""
    byte_level = "ByteLevel" in type(backend.decoder).__name__ if backend.decoder is not None else False
    alphabet = byte_alphabet()
    added = {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()}
    pieces: list[bytes] = []
    for token_id in range(vocab_size):
        if token_id in added:
            pieces.append(added[token_id].encode())
            continue
        token = backend.id_to_token(token_id)
        if token is None:
            pieces.append(b"")
        elif byte_level and set(token) <= alphabet.keys():
            pieces.append(bytes(alphabet[c] for c in token))
        elif byte_level:
            pieces.append(token.encode())
        else:
            match = _BYTE_PIECE.fullmatch(token)
            pieces.append(bytes([int(match.group(1), 16)]) if match else token.replace("▁", " ").encode())
    return TokenBytes(pieces)


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, as char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}
