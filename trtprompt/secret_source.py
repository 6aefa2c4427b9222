"""Secrets (the API key, the Redis password) read from a file or an environment variable, never argv.

A command line is readable by every local user in /proc/PID/cmdline, so a
secret comes from a file named on it, else from a variable; both rules are
here once (docs/security.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping


def read_secret(path: str | Path | None, env: Mapping[str, str], variable: str, what: str) -> str | None:
    """The file's content (surrounding whitespace dropped), else env[variable]; None when neither is set.

    An empty variable counts as unset; an unreadable or empty file is a ValueError naming `what` and the file.
    """
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the {what} file {path}: {exc}") from None
        if not text:
            raise ValueError(f"the {what} file {path} is empty")
        return text
    return env.get(variable, "").strip() or None
