"""The host lock every verb that changes a host takes: deploy, rollback, stop, patch.apply/revert,
tune. Owner, pid and time; stale-lock detection; --break-lock.

The host writes the lock atomically (a complete record linked into place), so a full disk
leaves no lock rather than an empty one. A lock is stale when its owner process is gone (same
controller machine, or the host-side guard), when it is unreadable or empty, or when it is
older than `lock_stale_after` seconds; a stale lock is reported and replaced. --break-lock
always replaces it.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
import uuid
from contextlib import contextmanager

from . import interrupt
from .errors import RemoteError, ServopsError, TransportError
from .hostreply import shown
from .output import err_console
from .provenance import operator
from .releases import ctl
from .transport import HostSession

DEFAULT_STALE_AFTER = 4 * 3600


class LockHeld(ServopsError):
    pass


def _owner_alive(held: dict) -> bool | None:
    """True/False when we can tell (a holder on this machine or the host's guard); else None."""
    if "alive_on_host" in held:
        return bool(held["alive_on_host"])
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
    if held.get("damaged"):
        return f"the lock file is damaged ({shown(held['damaged'], 120)})"
    if held.get("unreadable"):
        return f"the lock file is empty or unreadable ({held.get('size', 0)} bytes)"
    alive = _owner_alive(held)
    if alive is False:
        return f"its owner pid {held.get('pid') or held.get('host_pid')} is gone"
    if alive is None and age > stale_after:
        return f"it is {int(age)}s old (lock_stale_after={int(stale_after)})"
    return None


def describe(held: dict) -> str:
    """The lock's holder in a few words; its text (the host's) cut to a line's worth each."""
    def cut(key: str) -> str:
        return shown(str(held.get(key)), 80)

    if held.get("unreadable"):
        return "a damaged lock file" if held.get("damaged") else "an unreadable lock file"
    if held.get("guard"):
        return f"the host's guard, {cut('action')} ({cut('detail')})"
    who = cut("who") if held.get("who") else f"{cut('user')}@{cut('controller')}"
    return f"{who} pid {held.get('pid') or held.get('host_pid')} ({cut('action')}, since {cut('acquired_at')})"


def check_mode_note(lock: dict | None, stale_after: float, break_lock: bool) -> str | None:
    """Check mode: what the real run would meet at the deploy lock, from the lock record the
    facts trip read (with its age): None where the lock is free."""
    if not lock:
        return None
    held = {k: v for k, v in lock.items() if k != "age"}
    reason = is_stale(held, float(lock.get("age") or 0.0), stale_after)
    if reason or break_lock:
        return f"the deploy lock is held by {describe(held)}: the real run would break it " \
               f"({f'stale: {reason}' if reason else '--break-lock'})"
    return f"the deploy lock is held by {describe(held)}: the real run would refuse unless it is released " \
           f"first (or pass --break-lock if that operation is dead)"


@contextmanager
def host_lock(hs: HostSession, action: str, break_lock: bool = False, port: int | None = None, wait: float = 0.0,
              supersede: bool = False):
    """Hold the host's deploy lock; yields the lock reply (release listing, and `port` check).
    `wait`: seconds to wait for a live holder to finish before refusing. `supersede`: this
    operation replaces or stops the server, so it takes over a deploy that never finished
    (the host's guard stands down); any other waits for that guard."""
    owner = {"id": uuid.uuid4().hex, "who": operator(), "user": getpass.getuser(),
             "controller": socket.gethostname(), "pid": os.getpid(), "action": action}
    try:
        res = _acquire(hs, owner, break_lock, port, wait, supersede)
    except RemoteError:  # a reply servops could not use may have taken the lock all the same: no stale lock
        _release(hs, owner["id"])
        raise
    try:
        yield res
    finally:
        _release(hs, owner["id"])


def _release(hs: HostSession, lock_id: str) -> None:
    try:
        with interrupt.handling():  # an interrupted operation still releases its lock
            ctl(hs, "unlock", id=lock_id)
    except (TransportError, ServopsError):
        pass  # a lost connection leaves a lock whose owner pid is gone: the next run breaks it


def _acquire(hs: HostSession, owner: dict, break_lock: bool, port: int | None, wait: float, supersede: bool) -> dict:
    """host_lock's taking of the lock (waiting, breaking a stale one): the lock op's reply."""
    res = ctl(hs, "lock", owner=owner, port=port, supersede=supersede or break_lock)
    deadline = time.monotonic() + wait
    while not res["acquired"] and time.monotonic() < deadline and not break_lock and not is_stale(
            res["held"], res["age"], float(hs.host.get("lock_stale_after", DEFAULT_STALE_AFTER))):
        time.sleep(0.5)
        res = ctl(hs, "lock", owner=owner, port=port, supersede=supersede)
    if not res["acquired"]:
        held = res["held"]
        reason = is_stale(held, res["age"], float(hs.host.get("lock_stale_after", DEFAULT_STALE_AFTER)))
        if reason or break_lock:
            why = f"stale: {reason}" if reason else "--break-lock"
            err_console.print(f"{hs.host.name}: breaking the deploy lock held by {describe(held)} ({why})", markup=False)
            replace = {"id": held.get("id"), "unreadable": held.get("unreadable", False), "mtime": held.get("mtime"),
                       "why": why}
            res = ctl(hs, "lock", owner=owner, replace=replace, port=port, supersede=True)
        if not res["acquired"]:
            raise LockHeld(f"{hs.host.name}: the deploy lock is held by {describe(res.get('held') or held)}; "
                           f"wait for it, or pass --break-lock if that operation is dead")
    res["id"] = owner["id"]
    return res


