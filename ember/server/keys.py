"""The API keys a server accepts, and the tenant each belongs to.

`--api-key KEY` is one key of the tenant `default`. `--api-key-file FILE` holds one key per line,
optionally named `tenant: key` (a line without a name belongs to `default`); blank lines and lines
starting with `#` are skipped. A key is compared with every accepted key in constant time, so
neither which key matched nor how much of it did shows in the answer's timing. The file is read
again on SIGHUP (`reload`): a file that fails to read keeps the keys in force, and requests
already admitted are not touched. Keys are never logged; the tenant's name is what logs and
metrics show.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path

DEFAULT_TENANT = "default"


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file and the line."""


def read_key_file(path: str) -> dict[bytes, str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read the API key file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    keys: dict[bytes, str] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        tenant, colon, key = text.partition(":")
        tenant, key = (tenant.strip(), key.strip()) if colon else (DEFAULT_TENANT, text)
        if not tenant or not key or any(c.isspace() for c in key):
            raise KeyFileError(f"{path}, line {number}: expected 'KEY' or 'TENANT: KEY' (a key has no spaces)")
        if key.encode() in keys:
            raise KeyFileError(f"{path}, line {number}: this key is listed twice")
        keys[key.encode()] = tenant
    if not keys:
        raise KeyFileError(f"the API key file {path} holds no key")
    return keys


class KeyRing:
    def __init__(self, api_key: str | None = None, key_file: str | None = None) -> None:
        self.key_file = key_file
        self._keys: dict[bytes, str] = {}
        if api_key:
            self._keys[api_key.encode()] = DEFAULT_TENANT
        self._static = dict(self._keys)
        self.listeners: list[Callable[[list[str]], None]] = []  # told the keys' texts after each (re)load
        if key_file:
            self._keys = {**self._static, **read_key_file(key_file)}

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def texts(self) -> list[str]:
        return [key.decode() for key in self._keys]

    def tenant_of(self, offered: list[str]) -> str | None:
        """The tenant of the first offered key that is accepted; None if none is."""
        keys = self._keys  # one consistent set, even while a reload swaps it
        found = None
        for candidate in offered:
            encoded = candidate.encode()
            for key, tenant in keys.items():  # every comparison is made, whatever matched
                if hmac.compare_digest(encoded, key) and found is None:
                    found = tenant
        return found

    def reload(self) -> int:
        """Read the key file again; returns the number of keys now accepted (KeyFileError: unchanged)."""
        if not self.key_file:
            return len(self._keys)
        keys = {**self._static, **read_key_file(self.key_file)}
        self._keys = keys  # one assignment: a reader sees the old set or the new one, never a mix
        for listener in self.listeners:
            listener(self.texts())
        return len(keys)
