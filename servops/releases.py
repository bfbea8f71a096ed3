"""Releases on a host: `<deploy_root>/releases/<UTC timestamp>-<variant>/`, `current`, the server.

Thin wrappers over the remote deploy_ctl program; each call is one SSH command.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from . import hostreply
from .errors import RemoteError, ServopsError
from .hostreply import RELEASE_NAME_RE
from .inventory import deploy_root  # noqa: F401 - callers read it as releases.deploy_root
from .remote_exec import run_program
from .transport import HostSession


class GuardTookOver(RemoteError):
    """The host's guard took over a deploy (its controller's lease ran out): servops stands down."""


_TOOK_OVER = "GUARD-TOOK-OVER: "


def ctl(hs: HostSession, op: str, ssh_timeout: int | None = None,
        on_progress: Callable[[dict], None] | None = None, **args: Any) -> dict:
    args = dict(args, op=op, deploy_root=deploy_root(hs.host))
    # Failure injection for the tests of "a failure after the old server stopped" (disk full at
    # start, say): SERVOPS_INJECT_FAILURE=OP:RELEASE_SUFFIX makes that host op fail.
    if os.environ.get("SERVOPS_INJECT_FAILURE"):
        args["_fail"] = os.environ["SERVOPS_INJECT_FAILURE"]
    if os.environ.get("SERVOPS_FAULT"):  # crash tests: the host program SIGKILLs itself at a named point
        args["_fault"] = os.environ["SERVOPS_FAULT"]
    try:
        reply = run_program(hs, "deploy_ctl", args, timeout=ssh_timeout, on_progress=on_progress)
    except RemoteError as exc:
        if _TOOK_OVER in str(exc):
            raise GuardTookOver(str(exc).replace(_TOOK_OVER, "")) from None
        raise
    return check_reply(hs, op, reply)


def check_reply(hs: HostSession, op: str, data: dict) -> dict:
    """A deploy_ctl reply as servops' program writes it (hostreply.deploy_ctl: release names are
    names, never paths; records are objects; pids, ports and the lock's fields are what they say):
    anything else is one line naming the host and the field, before any of it is used."""
    return hostreply.check(data, hostreply.deploy_ctl(op), hs.host.name, f"deploy_ctl {op}")


def batch(hs: HostSession, *steps: dict, ssh_timeout: int | None = None) -> list[dict]:
    """Several deploy_ctl ops in one SSH command; a failing step stops the rest."""
    return ctl(hs, "batch", ssh_timeout=ssh_timeout, steps=list(steps))["results"]


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


def facts(hs: HostSession, patches: list[dict]) -> dict:
    """`listing` and the state of `patches` (remote specs) in one round trip: the reply's
    "patches" are patch_op status entries, in order."""
    return ctl(hs, "facts", patches=patches)


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
