"""patch.status / apply / revert / create on a host's venv, via the remote patch program.

The host does the work under a lock (patch(1) on a staged copy, then temp-file + rename for
each file, all or nothing); this side checks versions against `applies_to` and reports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import hostreply
from .output import CHANGED, OK, console, err_console, is_tty
from .provenance import operator
from .releases import deploy_root
from .patchstore import PATCH_ROOT, Patch, PatchError, write_patch
from .errors import NeedsAttention, RemoteError
from .remote_exec import run_program
from .transport import HostSession

NOT_APPLIED, APPLIED, CONFLICTS, MISMATCH, NOT_INSTALLED = (
    "not applied", "applied", "conflicts", "version does not match", "not installed")
_REMOTE_STATE = {"not-applied": NOT_APPLIED, "applied": APPLIED, "conflicts": CONFLICTS,
                 "not-installed": NOT_INSTALLED}


def _run(hs: HostSession, op: str, **args) -> dict:
    """One patch_op run. Every op first finishes or undoes a transaction a killed run left
    behind on the host; say so when it did."""
    args = dict(args, op=op, operator=operator(), journal=f"{deploy_root(hs.host)}/journal.jsonl",
                deploy_root=deploy_root(hs.host))
    # Crash-safety tests: SERVOPS_FAULT=<op>:<point> makes the host program SIGKILL itself there.
    if os.environ.get("SERVOPS_FAULT"):
        args["_fault"] = os.environ["SERVOPS_FAULT"]
    try:
        res = run_program(hs, "patch_op", args)
    except RemoteError as exc:
        if "could not be undone yet" in str(exc):  # files half-changed until the next patch operation
            raise NeedsAttention(f"{exc}; run invoke patch.status -H {hs.host.name}") from None
        raise
    if res.get("recovered"):
        err_console.print(f"{hs.host.name}: patch state: {res['recovered']}", markup=False)
    return res


def status(hs: HostSession, patches: list[Patch], lock_timeout: int = 30) -> list[dict]:
    res = _run(hs, "status", patches=[p.remote_spec() for p in patches], lock_timeout=lock_timeout)
    return status_rows(hs.host.name, patches, res.get("patches"))


def status_rows(host: str, patches: list[Patch], entries) -> list[dict]:
    """The host's patch program's entries (one per patch, in order) as status rows (pure): a
    version outside a patch's applies_to is a mismatch unless the patch is applied. Entries not as
    patch_op writes them (a field's type, one per patch asked about, in order) are one line naming
    the entry (RemoteError), before any is used."""
    hostreply.check(entries, hostreply.list_of(hostreply.PATCH_ENTRY), host, "the patch status")
    names = [e["name"] for e in entries]
    if names != [p.name for p in patches]:
        raise hostreply.malformed(host, "the patch status", f"entries for {hostreply.shown(', '.join(names), 120) or 'no patch'}, "
                                  f"asked for {hostreply.shown(', '.join(p.name for p in patches), 120)}")
    rows = []
    for patch, entry in zip(patches, entries):
        state = _REMOTE_STATE[entry["state"]]
        if entry.get("version") and not patch.version_ok(entry["version"]) and state != APPLIED:
            state = MISMATCH
        rows.append({"patch": patch.name, "dist": patch.distribution, "version": entry.get("version"),
                     "state": state, "recorded": bool(entry.get("recorded")), "applies_to": str(patch.applies_to)})
    return rows


def _check_version(hs: HostSession, patch: Patch, force: bool, lock_timeout: int) -> str:
    row = status(hs, [patch], lock_timeout)[0]
    if row["state"] == NOT_INSTALLED:
        raise PatchError(f"{hs.host.name}: {patch.distribution} is not installed in {hs.host.venv}")
    if not patch.version_ok(row["version"]) and not force:
        raise PatchError(f"{hs.host.name}: {patch.distribution} {row['version']} is outside applies_to "
                         f"'{patch.applies_to}' of patch {patch.name}; pass --force to apply anyway")
    return row["version"]


def apply(hs: HostSession, patch: Patch, dry_run: bool = False, force: bool = False,
          lock_timeout: int = 30) -> dict:
    version = _check_version(hs, patch, force, lock_timeout)
    res = _run(hs, "apply", patch=patch.remote_spec(), dry_run=dry_run, expect_version=version,
               lock_timeout=lock_timeout)
    return {"status": CHANGED if res["result"] == "changed" else OK, "message": res["message"], "diff": res["diff"]}


def revert(hs: HostSession, patch: Patch, dry_run: bool = False, lock_timeout: int = 30) -> dict:
    res = _run(hs, "revert", patch=patch.remote_spec(), dry_run=dry_run, lock_timeout=lock_timeout)
    return {"status": CHANGED if res["result"] == "changed" else OK, "message": res["message"], "diff": res["diff"]}


def create(hs: HostSession, file: str, name: str, root: Path = PATCH_ROOT, why: str = "") -> tuple[Path, dict]:
    res = _run(hs, "pristine", file=file)
    if not res["diff"]:
        raise PatchError(f"{hs.host.name}: {res['rel']} is identical to its pristine copy ({res['source']}); nothing to capture")
    path = write_patch(root, res["dist"], name, res["diff"], [res["rel"]], res["version"], why)
    return path, res


def print_diff(host: str, diff: str) -> None:
    if not diff:
        return
    if is_tty():
        from rich.syntax import Syntax

        console.print(f"--- {host}", markup=False, style="bold")
        console.print(Syntax(diff, "diff", theme="ansi_dark"))
    else:
        sys.stdout.write(f"--- {host}\n{diff}")
        if not diff.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()


def print_status(rows_by_host: dict[str, list[dict]]) -> None:
    from rich.text import Text

    from .output import print_table, table

    t = table("patch status", ["host", "patch", "distribution", "installed", "applies_to", "state"])
    style = {APPLIED: "green", NOT_APPLIED: "yellow", CONFLICTS: "red", MISMATCH: "magenta", NOT_INSTALLED: "dim"}
    for host, rows in rows_by_host.items():
        for r in rows:
            t.add_row(host, r["patch"], r["dist"], r["version"] or "-", r["applies_to"],
                      Text(r["state"], style=style[r["state"]]))
    print_table(t)
