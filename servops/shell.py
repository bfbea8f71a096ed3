"""Pure builders of remote shell command lines. Every argument goes through `quote`.

Nothing here runs anything; the transport layer executes what these return.
"""

from __future__ import annotations

import shlex
from typing import Iterable, Mapping


def quote(arg: object) -> str:
    return shlex.quote(str(arg))


def remote_path(path: str) -> str:
    """Quote a remote path, keeping a leading `~/` meaning the remote user's home.

    `'~/x'` would not expand inside quotes, so `~/x` becomes `"$HOME"/'x'`.
    """
    path = str(path)
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"/' + quote(rest) if rest else '"$HOME"/'
    return quote(path)


def join(argv: Iterable[object]) -> str:
    return " ".join(quote(a) for a in argv)


def with_env(command: str, env: Mapping[str, str] | None) -> str:
    """Prefix `env K=V ... command`, each assignment quoted as one word."""
    if not env:
        return command
    for key in env:
        if not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise ValueError(f"invalid environment variable name {key!r}")
    assigns = " ".join(quote(f"{k}={v}") for k, v in env.items())
    return f"env {assigns} {command}"


def python_stdin(python: str, env: Mapping[str, str] | None = None) -> str:
    """Run a Python program read from stdin (`python -`): the whole operation is one round trip."""
    return with_env(f"{remote_path(python)} -", env)
