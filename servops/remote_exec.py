"""Run one of servops' remote programs on a host: one SSH command, program on stdin."""

from __future__ import annotations

import json
from typing import Any, Mapping

from . import remote, shell
from .errors import RemoteError
from .transport import HostSession


def run_program(hs: HostSession, name: str, args: Mapping[str, Any], python: str | None = None,
                env: Mapping[str, str] | None = None, timeout: int | None = None) -> dict:
    python = python or hs.host.python
    command = shell.python_snippet(python, args, env)
    result = hs.run(command, stdin=remote.program(name), timeout=timeout)
    out = result.stdout.strip()
    try:
        data = json.loads(out.splitlines()[-1]) if out else None
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "error" in data:
        raise RemoteError(f"{hs.host.name}: {hs.redactor(str(data['error']))}")
    if result.exited != 0 or not isinstance(data, dict):
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        if result.exited == 127 or "No such file or directory" in result.stderr:
            raise RemoteError(f"{hs.host.name}: cannot run remote python {python}: {hs.redactor(detail)}; check the 'venv' var")
        raise RemoteError(f"{hs.host.name}: remote {name} failed (exit {result.exited}): {hs.redactor(detail)}")
    if "site" in data:
        hs.cache["site_dirs"] = data["site"]
    return data
