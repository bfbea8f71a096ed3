"""The deploy lock on a host: owner, pid and time; stale-lock detection; --break-lock.

The lock file is created with O_EXCL on the host. A lock is stale when its owner process is
gone (same controller machine, pid not alive) or it is older than `lock_stale_after` seconds;
a stale lock is reported and replaced, a live one refuses the deploy unless --break-lock.
"""

from __future__ import annotations

import getpass
import os
import socket
import uuid
from contextlib import contextmanager

from .errors import ServopsError
from .output import err_console
from .releases import ctl
from .transport import HostSession

DEFAULT_STALE_AFTER = 4 * 3600


class LockHeld(ServopsError):
    pass


def _owner_alive(held: dict) -> bool | None:
    """True/False when the owner ran on this machine; None when we cannot tell."""
    if held.get("controller") != socket.gethostname() or not held.get("pid"):
        return None
    try:
        os.kill(int(held["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(held: dict, age: float, stale_after: float) -> str | None:
    alive = _owner_alive(held)
    if alive is False:
        return f"its owner pid {held.get('pid')} on {held.get('controller')} is gone"
    if alive is None and age > stale_after:
        return f"it is {int(age)}s old (lock_stale_after={int(stale_after)})"
    return None


@contextmanager
def deploy_lock(hs: HostSession, action: str, break_lock: bool = False, port: int | None = None):
    """Hold the host's deploy lock; yields the lock reply with the release listing (and `port` check)."""
    owner = {"id": uuid.uuid4().hex, "user": getpass.getuser(), "controller": socket.gethostname(),
             "pid": os.getpid(), "action": action}
    res = ctl(hs, "lock", owner=owner, port=port)
    if not res["acquired"]:
        held = res["held"]
        who = (f"{held.get('user')}@{held.get('controller')} pid {held.get('pid')} "
               f"({held.get('action')}, since {held.get('acquired_at')})")
        reason = is_stale(held, res["age"], float(hs.host.get("lock_stale_after", DEFAULT_STALE_AFTER)))
        if reason or break_lock:
            why = f"stale: {reason}" if reason else "--break-lock"
            err_console.print(f"{hs.host.name}: breaking deploy lock held by {who} ({why})", markup=False)
            res = ctl(hs, "lock", owner=owner, replace_id=held.get("id"), port=port)
        if not res["acquired"]:
            raise LockHeld(f"{hs.host.name}: deploy lock held by {who}; wait for it, or pass --break-lock "
                           f"if that deploy is dead")
    try:
        yield res
    finally:
        try:
            ctl(hs, "unlock", id=owner["id"])
        except ServopsError:
            pass  # a lost connection leaves a lock whose owner pid is gone: the next run breaks it
