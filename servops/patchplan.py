"""Making a host's applied patch set equal a release's: plan (pure, from the host's patch status), apply, undo.

"Applied" comes from the FILES (the host's patch program probes them and reconciles its state
file), so a patch applied but never recorded is still reverted when a release does not want it.
"""

from __future__ import annotations

from . import patching, patchstore
from .errors import ServopsError
from .transport import HostSession


class PatchPlanError(ServopsError):
    pass


def actions(host_name: str, store: list[patchstore.Patch], rows: list[dict],
            wanted: list[str]) -> list[tuple[str, patchstore.Patch]]:
    """The plan (pure), from the status rows of every patch in the store (patching.status_rows):
    apply what `wanted` lacks, revert what is applied and not wanted."""
    by_name = {p.name: p for p in store}
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise PatchPlanError(f"the variant needs patch {missing[0]!r}, which is not under {patchstore.PATCH_ROOT}/")
    out = []
    for row in rows:
        name = row["patch"]
        if name in wanted and row["state"] != patching.APPLIED:
            if row["state"] in (patching.CONFLICTS, patching.NOT_INSTALLED, patching.MISMATCH):
                raise PatchPlanError(f"{host_name}: required patch {name} is {row['state']} "
                                     f"({row['dist']} {row['version'] or '-'}); see invoke patch.status")
            out.append(("apply", by_name[name]))
        elif name not in wanted and row["state"] == patching.APPLIED:
            out.append(("revert", by_name[name]))
    return out


def run(hs: HostSession, actions: list[tuple[str, patchstore.Patch]], show_diff: bool = False,
        done: list | None = None) -> list[str]:
    """Carry out a plan; `done` collects what changed (for `undo`). Returns 'apply X' lines."""
    lines = []
    for action, patch in actions:
        res = patching.apply(hs, patch) if action == "apply" else patching.revert(hs, patch)
        if res["status"] == patching.CHANGED:
            if done is not None:
                done.append((action, patch))
            lines.append(f"{action} {patch.name}")
            if show_diff:
                patching.print_diff(hs.host.name, res["diff"])
    return lines


def undo(hs: HostSession, done: list[tuple[str, patchstore.Patch]]) -> None:
    """Reverse what `run` changed, newest first."""
    for action, patch in reversed(done):
        if action == "apply":
            patching.revert(hs, patch)
        else:
            patching.apply(hs, patch, force=True)


def between(current: list[str], target: list[str]) -> list[dict]:
    """The host guard's plan: from a release's patch set back to another's, as patch specs."""
    store = {p.name: p for p in patchstore.all_patches()}
    steps = [{"action": "revert", "patch": store[n].remote_spec()} for n in reversed(current)
             if n not in target and n in store]
    steps += [{"action": "apply", "patch": store[n].remote_spec()} for n in target if n not in current and n in store]
    return steps
