"""Pure builders of remote shell command lines. Every argument goes through `quote`.

Nothing here runs anything; the transport layer executes what these return.
"""

from __future__ import annotations

import shlex


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


def python_stdin(python: str) -> str:
    """Run a Python program read from stdin (`python -`): the whole operation is one round trip.
    Its arguments and environment travel on stdin too (servops.remote.with_args)."""
    return f"{remote_path(python)} -"
