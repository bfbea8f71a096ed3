"""Releases on a host: `<deploy_root>/releases/<UTC timestamp>-<variant>/`, `current`, the server.

Thin wrappers over the remote deploy_ctl program; each call is one SSH command.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Callable

from .errors import ServopsError
from .inventory import Host
from .remote_exec import run_program
from .transport import HostSession


def deploy_root(host: Host) -> str:
    return str(host.get("deploy_root") or "~/.servops/deploy")


def ctl(hs: HostSession, op: str, ssh_timeout: int | None = None,
        on_progress: Callable[[dict], None] | None = None, **args: Any) -> dict:
    args = dict(args, op=op, deploy_root=deploy_root(hs.host))
    # Failure injection for the tests of "a failure after the old server stopped" (disk full at
    # start, say): SERVOPS_INJECT_FAILURE=OP:RELEASE_SUFFIX makes that host op fail.
    if os.environ.get("SERVOPS_INJECT_FAILURE"):
        args["_fail"] = os.environ["SERVOPS_INJECT_FAILURE"]
    return run_program(hs, "deploy_ctl", args, timeout=ssh_timeout, on_progress=on_progress)


def batch(hs: HostSession, *steps: dict, ssh_timeout: int | None = None) -> list[dict]:
    """Several deploy_ctl ops in one SSH command; a failing step stops the rest."""
    return ctl(hs, "batch", ssh_timeout=ssh_timeout, steps=list(steps))["results"]


RELEASE_NAME_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z-[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(name: str, flag: str) -> str:
    """A release is named by its directory name as `invoke releases` lists it; never a path."""
    if not RELEASE_NAME_RE.fullmatch(name or ""):
        raise ServopsError(f"{flag} {name!r}: expected a release name as listed by `invoke releases` "
                           f"(e.g. 20261202T101500Z-baseline), not a path")
    return name


def release_name(variant: str, when: float | None = None) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when)) + f"-{variant}"


def listing(hs: HostSession) -> dict:
    return ctl(hs, "releases")


def previous_good(releases: list[dict], current: str | None) -> dict | None:
    """The newest release before `current` that came up healthy (failed ones are skipped)."""
    names = [r["name"] for r in releases]
    upto = names.index(current) if current in names else len(names)
    for rel in reversed(releases[:upto]):
        if rel.get("status") == "healthy":
            return rel
    return None


def stop(hs: HostSession, grace: float) -> dict:
    return ctl(hs, "stop", grace=grace, ssh_timeout=int(grace) + 60)
