"""Run one of servops' remote programs on a host: one SSH command, program on stdin."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from . import remote, shell
from .errors import RemoteError
from .transport import HostSession


def run_program(hs: HostSession, name: str, args: Mapping[str, Any], python: str | None = None,
                env: Mapping[str, str] | None = None, timeout: int | None = None,
                on_progress: Callable[[dict], None] | None = None) -> dict:
    """Run a remote program; `on_progress` gets each JSON line it prints before its result."""
    python = python or hs.host.python
    command = shell.python_stdin(python)
    on_output = _line_splitter(on_progress) if on_progress else None
    # a short read-only program, with nothing to set in its environment: a warm agent may run it
    # in the host's warm interpreter (its environment is that of a fresh `python -` there)
    warm = python if name in remote.WARM and not env and on_progress is None else None
    hs.programs.append(f"{name}:{args['op']}" if isinstance(args.get("op"), str) else name)
    result = hs.run(command, stdin=remote.with_args(name, args, env), timeout=timeout, on_output=on_output,
                    warm=warm)
    out = result.stdout.strip()
    try:
        data = json.loads(out.splitlines()[-1]) if out else None
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        data = None
    if isinstance(data, dict) and "error" in data:
        raise RemoteError(f"{hs.host.name}: {hs.redactor(_one_line(data['error']))}")
    if result.exited != 0 or not isinstance(data, dict):
        detail = _one_line((result.stderr.strip().splitlines() or ["no output"])[-1])
        if result.exited == 127 or "No such file or directory" in result.stderr:
            raise RemoteError(f"{hs.host.name}: cannot run remote python {python}: {hs.redactor(detail)}; check the 'venv' var")
        raise RemoteError(f"{hs.host.name}: remote {name} failed (exit {result.exited}): {hs.redactor(detail)}")
    if "site" in data:
        hs.cache["site_dirs"] = data["site"]
    return data


def _one_line(text, limit: int = 2000) -> str:
    """A host's error message as one bounded line (a hostile host can send anything)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + f" ... [{len(text) - limit} more characters]"


def _line_splitter(callback: Callable[[dict], None]) -> Callable[[str], None]:
    buffer = [""]

    def feed(text: str) -> None:
        buffer[0] += text
        *lines, buffer[0] = buffer[0].split("\n")
        for line in lines:
            try:
                data = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(data, dict) and "progress" in data:
                callback(data)

    return feed
