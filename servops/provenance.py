"""Where a change came from: the servops checkout's git revision, the local operator."""

from __future__ import annotations

import functools
import getpass
import os
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def operator() -> str:
    """Who runs servops, as locks, releases and the host journal record it: $SERVOPS_OPERATOR,
    else the checkout's git user.email (two people sharing one account differ there), else
    `user@machine`. A name of control or odd characters is cut down to printable text."""
    who = os.environ.get("SERVOPS_OPERATOR", "").strip()
    if not who:
        try:
            who = subprocess.run(["git", "config", "user.email"], cwd=REPO, capture_output=True, text=True,
                                 timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            who = ""
    if not who:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = "unknown"
        who = f"{user}@{socket.gethostname()}"
    return "".join(ch for ch in who if ch.isprintable())[:200] or "unknown"
