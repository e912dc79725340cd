"""Where ember keeps what must outlive a server process (the response store): a folder of this
user's, created on first use with room for no one else.

EMBER_STATE_DIR names it outright (tests and CI point it at a scratch folder); otherwise it is
`ember` in the platform's user data folder: $XDG_DATA_HOME or ~/.local/share on Linux and other
Unix systems, ~/Library/Application Support on macOS, %LOCALAPPDATA% on Windows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

STATE_DIR_VARIABLE = "EMBER_STATE_DIR"


def state_dir(environ=os.environ) -> Path:
    """The folder, created if missing."""
    folder = Path(environ[STATE_DIR_VARIABLE]) if environ.get(STATE_DIR_VARIABLE) else _user_data_dir(environ) / "ember"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def _user_data_dir(environ) -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support"
    if sys.platform == "win32" and environ.get("LOCALAPPDATA"):
        return Path(environ["LOCALAPPDATA"])
    if environ.get("XDG_DATA_HOME"):
        return Path(environ["XDG_DATA_HOME"])
    return Path.home() / ".local" / "share"
