"""Reasoning text sealed for the client to carry: `encrypted_content` on Responses reasoning items.

A client that keeps no server state (`store: false`, as Codex runs) gets its reasoning back as an
opaque string and sends it in a later input; only this server process can read it, and any change
to it is detected. The scheme uses the standard library only (ember does not depend on a crypto
package): encrypt-then-MAC with keys derived from one random 32-byte key per process.

    token  = "ember1." + base64url(nonce[16] | ciphertext | tag[32])
    stream = SHA-256(enc_key | nonce | counter[8, big-endian]) for counter = 0, 1, ...
    tag    = HMAC-SHA256(mac_key, "ember1" | nonce | ciphertext)

A restart draws a new key, so items sealed before it can no longer be read (a 400 says so).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

PREFIX = "ember1."
_NONCE = 16
_TAG = 32


class SealError(ValueError):
    """A sealed text that this process cannot read: altered, truncated, or sealed by another process."""


class ReasoningSeal:
    def __init__(self, key: bytes | None = None) -> None:
        key = key if key is not None else secrets.token_bytes(32)
        self._enc_key = hashlib.sha256(b"ember-seal-enc" + key).digest()
        self._mac_key = hashlib.sha256(b"ember-seal-mac" + key).digest()

    def seal(self, text: str) -> str:
        nonce = secrets.token_bytes(_NONCE)
        data = text.encode("utf-8")
        ciphertext = bytes(a ^ b for a, b in zip(data, self._stream(nonce, len(data))))
        tag = self._tag(nonce, ciphertext)
        return PREFIX + base64.urlsafe_b64encode(nonce + ciphertext + tag).decode("ascii")

    def open(self, token: str) -> str:
        if not token.startswith(PREFIX):
            raise SealError("it was not produced by this server")
        try:
            raw = base64.urlsafe_b64decode(token[len(PREFIX):].encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            raise SealError("it is not valid base64") from None
        if len(raw) < _NONCE + _TAG:
            raise SealError("it is truncated")
        nonce, ciphertext, tag = raw[:_NONCE], raw[_NONCE:-_TAG], raw[-_TAG:]
        if not hmac.compare_digest(tag, self._tag(nonce, ciphertext)):
            raise SealError("it was altered, or sealed by another server process (a restart draws a new key)")
        data = bytes(a ^ b for a, b in zip(ciphertext, self._stream(nonce, len(ciphertext))))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise SealError("it does not decode") from None

    def _stream(self, nonce: bytes, size: int) -> bytes:
        blocks = []
        for counter in range((size + 31) // 32):
            blocks.append(hashlib.sha256(self._enc_key + nonce + counter.to_bytes(8, "big")).digest())
        return b"".join(blocks)[:size]

    def _tag(self, nonce: bytes, ciphertext: bytes) -> bytes:
        return hmac.new(self._mac_key, b"ember1" + nonce + ciphertext, hashlib.sha256).digest()
