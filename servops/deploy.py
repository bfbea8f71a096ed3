"""deploy / rollback: release, patch set, health-gated restart, automatic rollback.

Order on the host, under the deploy lock:
  port check -> new release dir (launch.sh, variant.yml, release.json, server files)
  -> patch set -> stop old server -> switch `current` -> start -> health gate
  -> healthy: keep, prune old releases | failed: excerpt, roll back to the previous good release.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from . import patching, patchstore, releases
from .deploylock import deploy_lock
from .errors import ServopsError
from .health import health_gate
from .output import CHANGED, FAILED, OK, console, err_console
from .playbooks import load_variant
from .render import render_launch
from .transport import HostSession

REPO = Path(__file__).resolve().parent.parent


class DeployError(ServopsError):
    pass


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def server_port(hs: HostSession) -> int:
    return int(hs.host.require("server_port"))


def plan_patches(hs: HostSession, wanted: list[str]) -> list[tuple[str, patchstore.Patch]]:
    """(action, patch) pairs that make the applied set equal `wanted` (servops-applied only)."""
    store = {p.name: p for p in patchstore.all_patches()}
    missing = [n for n in wanted if n not in store]
    if missing:
        raise DeployError(f"variant needs patch {missing[0]!r}, which is not under {patchstore.PATCH_ROOT}/")
    actions = []
    for row in patching.status(hs, list(store.values())):
        name = row["patch"]
        if name in wanted and row["state"] != patching.APPLIED:
            if row["state"] in (patching.CONFLICTS, patching.NOT_INSTALLED, patching.MISMATCH):
                raise DeployError(f"{hs.host.name}: required patch {name} is {row['state']} "
                                  f"({row['dist']} {row['version'] or '-'}); see invoke patch.status")
            actions.append(("apply", store[name]))
        elif name not in wanted and row["state"] == patching.APPLIED and row["recorded"]:
            actions.append(("revert", store[name]))
    return actions


def sync_patches(hs: HostSession, wanted: list[str]) -> list[str]:
    done = []
    for action, patch in plan_patches(hs, wanted):
        res = patching.apply(hs, patch) if action == "apply" else patching.revert(hs, patch)
        if res["status"] == CHANGED:
            done.append(f"{action} {patch.name}")
    return done


def _files_for_release(hs: HostSession, variant: dict, launch: str, patches: list[str]) -> dict:
    record = {
        "variant": variant["name"], "chain": variant["chain"], "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "patches": patches, "status": "deploying", "servops_git": git_sha(), "port": server_port(hs),
        "health": variant["health"], "crash_signatures": variant["crash_signatures"],
        "stop_grace": variant.get("stop_grace", 30), "deployed_by": os.environ.get("USER", "unknown"),
    }
    shown = {k: v for k, v in variant.items() if k not in ("chain",)}
    return {
        "launch.sh": {"text": launch, "mode": 0o755},
        "variant.yml": {"text": yaml.safe_dump(shown, sort_keys=False)},
        "release.json": {"text": json.dumps(record, indent=1, sort_keys=True)},
    }


def _upload_server_files(hs: HostSession, release_dir: str) -> None:
    for local in hs.host.get("server_files") or []:
        path = Path(local) if Path(local).is_absolute() else REPO / local
        if not path.is_file():
            raise DeployError(f"{hs.host.source}: server_files entry {local!r} does not exist locally")
        hs.put(str(path), f"{release_dir}/{path.name}")


def _bring_up(hs: HostSession, name: str, meta: dict, progress_label: str) -> dict:
    """Stop whatever runs, point `current` at `name`, start it, and health-gate it."""
    releases.stop(hs, float(meta.get("stop_grace", 30)))
    releases.switch(hs, name)
    releases.start(hs, name, int(meta["port"]))
    signatures = list(dict.fromkeys(list(meta.get("crash_signatures") or []) + DEFAULT_SIGNATURES))
    return health_gate(hs, name, int(meta["port"]), meta.get("health") or {}, signatures, progress_label)


DEFAULT_SIGNATURES = [r"torch\._dynamo\.exc\.Unsupported", r"CUDA out of memory"]


def render_for_host(hs: HostSession, variant: dict, name: str, root: str) -> str:
    return render_launch(hs.host, variant, name, f"{root}/releases/{name}")


def _check_port(hs: HostSession) -> None:
    port = server_port(hs)
    res = releases.ctl(hs, "port_check", port=port)
    if res["busy"] and not res["ours"]:
        raise DeployError(f"{hs.host.name}: port {port} is already in use by a process servops did not start; "
                          f"free it or change server_port")


def deploy(hs: HostSession, variant_name: str, *, dry_run: bool = False, diff: bool = False,
           no_rollback: bool = False, skip_patches: bool = False, break_lock: bool = False,
           keep: int | None = None, gate: list | None = None, bench_opts: dict | None = None,
           push_url: str | None = None) -> tuple[str, str]:
    variant = load_variant(variant_name)
    wanted = [] if skip_patches else list(variant["patches"])
    for name in wanted:
        patchstore.find_patch(name)  # fail before touching the host
    if dry_run:
        return _plan(hs, variant, wanted, diff)
    with deploy_lock(hs, f"deploy {variant_name}", break_lock) as lock:
        root = lock["root"]
        _check_port(hs)
        state = releases.listing(hs)
        previous = state["current"]
        base = releases.release_name(variant_name)
        launch = render_for_host(hs, variant, "@@RELEASE_NAME@@", root).replace(
            f"{root}/releases/@@RELEASE_NAME@@", "@@RELEASE_DIR@@")
        prepared = releases.ctl(hs, "prepare", name=base, files=_files_for_release(hs, variant, launch, wanted))
        name, release_dir = prepared["name"], prepared["dir"]
        _upload_server_files(hs, release_dir)
        patch_changes = sync_patches(hs, wanted)
        meta = json.loads(_files_for_release(hs, variant, launch, wanted)["release.json"]["text"])
        outcome = _bring_up(hs, name, meta, f"{hs.host.name}: {name}")
        if outcome["state"] == "healthy" and gate:
            outcome = _metric_gate(hs, gate, bench_opts or {}, outcome)
        if push_url:
            from .push import push_deploy_event

            push_deploy_event(push_url, hs.host.name, variant_name, name, outcome["state"])
        if outcome["state"] == "healthy":
            releases.mark(hs, name, status="healthy", healthy_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          previous=previous)
            releases.prune(hs, int(keep or hs.host.get("keep_releases", 5)), protect=previous)
            extra = f"; patches: {', '.join(patch_changes)}" if patch_changes else ""
            return CHANGED, f"deployed {name} (healthy in {outcome['elapsed']:.1f}s){extra}"
        releases.mark(hs, name, status="failed", failure=outcome["reason"])
        _report_failure(hs, name, outcome)
        if no_rollback:
            return FAILED, f"{name} {outcome['state']}: {outcome['reason']} (--no-rollback: left as is)"
        back = _rollback_locked(hs, releases.listing(hs), to=None, failed=name)
        return FAILED, f"{name} {outcome['state']}: {outcome['reason']}; {back}"


def _metric_gate(hs: HostSession, gate: list, bench_opts: dict, outcome: dict) -> dict:
    """Bench the healthy release at the gate's levels; a failed condition fails the deploy."""
    from . import bench
    from .gate import evaluate, gate_levels

    result = bench.run_bench(hs, gate_levels(gate), **bench_opts)
    bench.print_result(result)
    passed, lines = evaluate(gate, result, lambda v: bench.latest_for_variant(hs.host.name, v))
    for line in lines:
        console.print(f"{hs.host.name}: gate {line}", markup=False)
    if passed:
        return outcome
    failed = "; ".join(l for l in lines if l.startswith("FAIL"))
    return {"state": "gate-failed", "reason": f"metric gate failed: {failed}", "elapsed": outcome["elapsed"], "excerpt": []}


def _report_failure(hs: HostSession, name: str, outcome: dict) -> None:
    err_console.print(f"[bold red]{hs.host.name}: release {name} {outcome['state']}[/]: {hs.redactor(outcome['reason'])}")
    if outcome.get("excerpt"):
        err_console.print(f"--- server.log excerpt ({hs.host.name}) ---", markup=False)
        for line in outcome["excerpt"]:
            err_console.print(hs.redactor(line), markup=False, highlight=False)
        err_console.print("---", markup=False)


def _rollback_locked(hs: HostSession, state: dict, to: str | None, failed: str | None = None) -> str:
    rels = {r["name"]: r for r in state["releases"]}
    if to:
        if to not in rels:
            raise DeployError(f"{hs.host.name}: no release {to!r} (see invoke releases)")
        target = rels[to]
    else:
        anchor = failed or state["current"]
        target = releases.previous_good(state["releases"], anchor)
        if target is None:
            if failed:
                releases.stop(hs, 10.0)
                return "no earlier healthy release to roll back to: server stopped"
            raise DeployError(f"{hs.host.name}: no healthy release before {anchor} to roll back to")
    sync_patches(hs, list(target.get("patches") or []))
    outcome = _bring_up(hs, target["name"], target, f"{hs.host.name}: rollback to {target['name']}")
    if outcome["state"] != "healthy":
        _report_failure(hs, target["name"], outcome)
        raise DeployError(f"{hs.host.name}: rollback to {target['name']} failed too: {outcome['reason']}")
    releases.mark(hs, target["name"], status="healthy",
                  rolled_back_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return f"rolled back to {target['name']} (healthy in {outcome['elapsed']:.1f}s)"


def rollback(hs: HostSession, to: str | None = None, dry_run: bool = False, break_lock: bool = False) -> tuple[str, str]:
    if dry_run:
        state = releases.listing(hs)
        target = (next((r for r in state["releases"] if r["name"] == to), None) if to
                  else releases.previous_good(state["releases"], state["current"]))
        if target is None:
            raise DeployError(f"{hs.host.name}: " + (f"no release {to!r}" if to else
                              f"no healthy release before {state['current']} to roll back to"))
        actions = [f"{a} {p.name}" for a, p in plan_patches(hs, list(target.get("patches") or []))]
        return CHANGED, (f"would roll back {state['current']} -> {target['name']}"
                         + (f"; patches: {', '.join(actions)}" if actions else "") + " (check mode)")
    with deploy_lock(hs, "rollback", break_lock):
        return CHANGED, _rollback_locked(hs, releases.listing(hs), to)


def _plan(hs: HostSession, variant: dict, wanted: list[str], show_diff: bool) -> tuple[str, str]:
    """Check mode: render, diff against the current release's script, list patch actions."""
    import difflib

    state = releases.listing(hs)
    root = state["root"]
    name = releases.release_name(variant["name"])
    new = render_for_host(hs, variant, name, root)
    actions = plan_patches(hs, wanted)
    if show_diff:
        old = _read_remote(hs, f"{root}/releases/{state['current']}/launch.sh") if state["current"] else ""
        text = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                            f"current/launch.sh", f"{name}/launch.sh"))
        patching.print_diff(hs.host.name, hs.redactor(text))
        for action, patch in actions:
            res = (patching.apply(hs, patch, dry_run=True) if action == "apply"
                   else patching.revert(hs, patch, dry_run=True))
            patching.print_diff(hs.host.name, res["diff"])
    summary = ", ".join(f"{a} {p.name}" for a, p in actions)
    return CHANGED, (f"would deploy {name} (replacing {state['current'] or 'nothing'})"
                     + (f"; patches: {summary}" if summary else "") + " (check mode)")


def _read_remote(hs: HostSession, path: str) -> str:
    from . import shell

    res = hs.run(f"cat {shell.remote_path(path)}")
    return res.stdout if res.ok else ""
