"""Reasoning text sealed for the client to carry: `encrypted_content` on Responses reasoning items.

A client that keeps no server state (`store: false`, as Codex runs) gets its reasoning back as an
opaque string and sends it in a later input; only a server holding the same key can read it, and
any change to it is detected. The seal is AES-256-GCM from the `cryptography` package:

    token = "ember2." + base64url(nonce[12] | ciphertext | tag[16]),  associated data "ember2"

The key is 32 random bytes drawn per process, or read from `--reasoning-key-file` so that items
survive a restart and are readable by every server sharing the file. Items sealed under another
key (another process without a shared file, or an older ember) get a 400 that says so.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PREFIX = "ember2."
_AAD = b"ember2"
_NONCE = 12
_TAG = 16
KEY_BYTES = 32


class SealError(ValueError):
    """A sealed text this server cannot read: altered, truncated, or sealed under another key."""


class ReasoningSeal:
    def __init__(self, key: bytes | None = None) -> None:
        key = key if key is not None else secrets.token_bytes(KEY_BYTES)
        if len(key) != KEY_BYTES:
            raise ValueError(f"the reasoning key must be {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)

    @classmethod
    def from_key_file(cls, path: str) -> "ReasoningSeal":
        """A key file holds 32 bytes as 64 hexadecimal digits (`openssl rand -hex 32 > FILE`)."""
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the reasoning key file {path}: {exc.strerror or exc}") from None
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"the reasoning key file {path} must hold {2 * KEY_BYTES} hexadecimal digits") from None
        if len(key) != KEY_BYTES:
            raise ValueError(f"the reasoning key file {path} must hold {2 * KEY_BYTES} hexadecimal digits, "
                             f"not {len(text)}")
        return cls(key)

    def seal(self, text: str) -> str:
        nonce = secrets.token_bytes(_NONCE)
        sealed = self._aead.encrypt(nonce, text.encode("utf-8"), _AAD)
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode("ascii")

    def open(self, token: str) -> str:
        if not token.startswith(PREFIX):
            raise SealError("it was not produced by this server")
        try:
            raw = base64.urlsafe_b64decode(token[len(PREFIX):].encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise SealError("it is not valid base64") from None
        if len(raw) < _NONCE + _TAG:
            raise SealError("it is truncated")
        try:
            data = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], _AAD)
        except InvalidTag:
            raise SealError("it was altered, or sealed under another key (a restart without --reasoning-key-file "
                            "draws a new one)") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise SealError("it does not decode") from None
