"""deploy / rollback: release, patch set, health-gated restart, automatic rollback.

Order on the host, under the deploy lock:
  port check -> new release dir (launch.sh, variant.yml, release.json, server files)
  -> patch set -> stop old server -> switch `current` -> start -> health gate
  -> healthy: keep, prune old releases | failed: excerpt, roll back to the previous good release.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

import yaml

from . import patching, patchstore, releases
from .deploylock import deploy_lock
from .errors import ServopsError
from .health import health_gate
from .output import CHANGED, FAILED, console, err_console
from .playbooks import load_variant
from .provenance import REPO, git_sha
from .redact import secret_values
from .render import render_launch
from .transport import HostSession

class DeployError(ServopsError):
    pass


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


def sync_patches(hs: HostSession, wanted: list[str], show_diff: bool = False) -> list[str]:
    done = []
    for action, patch in plan_patches(hs, wanted):
        res = patching.apply(hs, patch) if action == "apply" else patching.revert(hs, patch)
        if res["status"] == CHANGED:
            done.append(f"{action} {patch.name}")
            if show_diff:
                patching.print_diff(hs.host.name, res["diff"])
    return done


def _files_for_release(hs: HostSession, variant: dict, launch, patches: list[str]) -> dict:
    record = {
        "variant": variant["name"], "chain": variant["chain"], "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "patches": patches, "status": "deploying", "servops_git": git_sha(), "port": server_port(hs),
        "health": variant["health"], "crash_signatures": variant["crash_signatures"],
        "stop_grace": variant.get("stop_grace", 30), "deployed_by": os.environ.get("USER", "unknown"),
    }
    shown = {k: v for k, v in variant.items() if k not in ("chain",)}
    files = {
        "launch.sh": {"text": launch.script, "mode": 0o700},
        "variant.yml": {"text": hs.redactor(yaml.safe_dump(shown, sort_keys=False))},
        "release.json": {"text": json.dumps(record, indent=1, sort_keys=True)},
    }
    if launch.secret_env:
        files["secrets.env"] = {"text": launch.secrets_file(), "mode": 0o600}
    return files


def _server_files(hs: HostSession) -> dict:
    """Local files the release carries (e.g. the test double), sent with the release itself."""
    files = {}
    for local in hs.host.get("server_files") or []:
        path = Path(local) if Path(local).is_absolute() else REPO / local
        if not path.is_file():
            raise DeployError(f"{hs.host.source}: server_files entry {local!r} does not exist locally")
        files[path.name] = {"text": path.read_text()}
    return files


DEFAULT_SIGNATURES = [r"torch\._dynamo\.exc\.Unsupported", r"CUDA out of memory"]


def _bring_up(nodes: list[tuple[HostSession, str, dict]], label: str) -> dict:
    """Stop what runs, point `current` at each node's release, start rank 0 first, health-gate rank 0.

    nodes: (session, release name, release meta), rank 0 first. The other ranks of a multi-node
    server have no HTTP endpoint of their own: they must merely still be running.
    """
    def stop_and_switch(hs, name, meta):
        grace = float(meta.get("stop_grace", 30))
        return [{"op": "stop", "grace": grace}, {"op": "switch", "name": name}], int(grace) + 60

    if len(nodes) == 1:
        hs, name, meta = nodes[0]
        steps, timeout = stop_and_switch(hs, name, meta)
        releases.batch(hs, *steps, {"op": "start", "name": name, "port": int(meta["port"])}, ssh_timeout=timeout)
    else:
        for hs, name, meta in nodes:
            steps, timeout = stop_and_switch(hs, name, meta)
            releases.batch(hs, *steps, ssh_timeout=timeout)
        for hs, name, meta in nodes:  # rank 0 first
            releases.start(hs, name, int(meta["port"]))
    hs0, name0, meta0 = nodes[0]
    signatures = list(dict.fromkeys(list(meta0.get("crash_signatures") or []) + DEFAULT_SIGNATURES))
    outcome = health_gate(hs0, name0, int(meta0["port"]), meta0.get("health") or {}, signatures, label)
    if outcome["state"] == "healthy":
        for hs, name, _meta in nodes[1:]:
            if not releases.ctl(hs, "status")["server"]:
                return {"state": "crashed", "reason": f"rank on {hs.host.name} exited", "elapsed": outcome["elapsed"],
                        "excerpt": releases.ctl(hs, "logs", name=name, lines=30)["lines"]}
    return outcome


def render_for_host(hs: HostSession, variant: dict):
    return render_launch(hs.host, variant)


def render_preview(hs: HostSession, variant: dict) -> str:
    """The launch script exactly as deploy would write it on this host."""
    return render_for_host(hs, variant).script


def _check_port(hs: HostSession, res: dict) -> None:
    port = server_port(hs)
    if res["busy"] and not res["ours"]:
        raise DeployError(f"{hs.host.name}: port {port} is already in use by a process servops did not start; "
                          f"free it or change server_port")


def node_args(variant: dict, nodes: list[HostSession]) -> list[dict]:
    """Per-node server_args for a multi-node variant: --nnodes, --node-rank, --dist-init-addr."""
    nnodes = int(variant.get("nnodes") or 1)
    if nnodes == 1:
        return [{}]
    if len(nodes) != nnodes:
        raise DeployError(f"variant {variant['name']} needs {nnodes} nodes per server; got {len(nodes)}")
    rank0 = nodes[0].host
    addr = f"{rank0.get('dist_init_host') or rank0.ssh_host}:{int(rank0.get('dist_init_port', 5000))}"
    return [{"nnodes": nnodes, "node-rank": rank, "dist-init-addr": addr} for rank in range(nnodes)]


def _with_args(variant: dict, extra: dict) -> dict:
    if not extra:
        return variant
    out = dict(variant)
    out["server_args"] = dict(variant["server_args"], **extra)
    return out


def deploy(hs: HostSession, variant_name: str, **kwargs) -> tuple[str, str]:
    return deploy_group([hs], variant_name, **kwargs)


def deploy_group(nodes: list[HostSession], variant_name: str, *, dry_run: bool = False, diff: bool = False,
                 no_rollback: bool = False, skip_patches: bool = False, break_lock: bool = False,
                 keep: int | None = None, gate: list | None = None, bench_opts: dict | None = None,
                 push_url: str | None = None) -> tuple[str, str]:
    """Deploy one server: a single host, or the nodes of a multi-node server (rank 0 first)."""
    variant = load_variant(variant_name)
    for hs in nodes:  # a variant-only secret (HF_TOKEN) is masked like the host's own
        hs.redactor.add(secret_values(variant["env"], hs.host.get("secret_vars") or ()))
    wanted = [] if skip_patches else list(variant["patches"])
    for name in wanted:
        patchstore.find_patch(name)  # fail before touching the host
    per_node = node_args(variant, nodes)
    if dry_run:
        results = [_plan(hs, _with_args(variant, extra), wanted, diff) for hs, extra in zip(nodes, per_node)]
        return CHANGED, "; ".join(r[1] for r in results)
    with ExitStack() as stack:
        locks = [stack.enter_context(deploy_lock(hs, f"deploy {variant_name}", break_lock, port=server_port(hs)))
                 for hs in nodes]
        for hs, lock in zip(nodes, locks):
            _check_port(hs, lock["port"])
        prepared, previous = [], {}
        for hs, lock, extra in zip(nodes, locks, per_node):
            previous[hs.host.name] = lock["listing"]["current"]
            prepared.append(_prepare(hs, _with_args(variant, extra), wanted, lock["root"]))
        patch_changes = sorted({c for hs in nodes for c in sync_patches(hs, wanted, show_diff=diff)})
        if diff:
            for (hs, name, _meta), lock in zip(prepared, locks):
                print_script_diff(hs, lock["root"], previous[hs.host.name], name)
        hs0, name0, _ = prepared[0]
        outcome = _bring_up(prepared, f"{hs0.host.name}: {name0}")
        if outcome["state"] == "healthy" and gate:
            outcome = _metric_gate(hs0, gate, bench_opts or {}, outcome)
        if push_url:
            from .push import push_deploy_event

            push_deploy_event(push_url, hs0.host.name, variant_name, name0, outcome["state"])
        if outcome["state"] == "healthy":
            for hs, name, _meta in prepared:
                releases.batch(hs, {"op": "mark", "name": name,
                                    "fields": {"status": "healthy", "healthy_at": _now(), "previous": previous[hs.host.name]}},
                               {"op": "prune", "keep": int(keep or hs.host.get("keep_releases", 5)),
                                "protect": previous[hs.host.name]})
            extra_msg = f"; patches: {', '.join(patch_changes)}" if patch_changes else ""
            ranks = f" on {len(nodes)} nodes" if len(nodes) > 1 else ""
            return CHANGED, f"deployed {name0}{ranks} (healthy in {outcome['elapsed']:.1f}s){extra_msg}"
        for hs, name, _meta in prepared:
            releases.mark(hs, name, status="failed", failure=outcome["reason"])
        _report_failure(hs0, name0, outcome)
        if no_rollback:
            return FAILED, f"{name0} {outcome['state']}: {outcome['reason']} (--no-rollback: left as is)"
        back = _rollback_locked(nodes, to=None, failed=[name for _hs, name, _m in prepared])
        return FAILED, f"{name0} {outcome['state']}: {outcome['reason']}; {back}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _prepare(hs: HostSession, variant: dict, wanted: list[str], root: str) -> tuple[HostSession, str, dict]:
    """A new release dir with its launch script, variant, record and the server files."""
    base = releases.release_name(variant["name"])
    launch = render_for_host(hs, variant)
    files = _files_for_release(hs, variant, launch, wanted)
    files.update(_server_files(hs))
    prepared = releases.ctl(hs, "prepare", name=base, files=files)
    return hs, prepared["name"], json.loads(files["release.json"]["text"])


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


def _rollback_locked(nodes: list[HostSession], to: str | None, failed: list[str] | None = None,
                     show_diff: bool = False) -> str:
    """Bring every node back to an earlier release (`to`, or each node's previous healthy one)."""
    targets = []
    for i, hs in enumerate(nodes):
        state = releases.listing(hs)
        rels = {r["name"]: r for r in state["releases"]}
        if to:
            if to not in rels:
                raise DeployError(f"{hs.host.name}: no release {to!r} (see invoke releases)")
            target = rels[to]
        else:
            anchor = failed[i] if failed else state["current"]
            target = releases.previous_good(state["releases"], anchor)
            if target is None:
                if failed:
                    for other in nodes:
                        releases.stop(other, 10.0)
                    return "no earlier healthy release to roll back to: server stopped"
                raise DeployError(f"{hs.host.name}: no healthy release before {anchor} to roll back to")
        targets.append((hs, target))
    for hs, target in targets:
        sync_patches(hs, list(target.get("patches") or []), show_diff=show_diff)
        if show_diff:
            state = releases.listing(hs)
            print_script_diff(hs, state["root"], state["current"], target["name"])
    hs0, t0 = targets[0]
    outcome = _bring_up([(hs, t["name"], t) for hs, t in targets], f"{hs0.host.name}: rollback to {t0['name']}")
    if outcome["state"] != "healthy":
        _report_failure(hs0, t0["name"], outcome)
        raise DeployError(f"{hs0.host.name}: rollback to {t0['name']} failed too: {outcome['reason']}")
    for hs, target in targets:
        releases.mark(hs, target["name"], status="healthy", rolled_back_at=_now())
    return f"rolled back to {t0['name']} (healthy in {outcome['elapsed']:.1f}s)"


def rollback(hs: HostSession, to: str | None = None, dry_run: bool = False, break_lock: bool = False,
             diff: bool = False) -> tuple[str, str]:
    if dry_run:
        state = releases.listing(hs)
        target = (next((r for r in state["releases"] if r["name"] == to), None) if to
                  else releases.previous_good(state["releases"], state["current"]))
        if target is None:
            raise DeployError(f"{hs.host.name}: " + (f"no release {to!r}" if to else
                              f"no healthy release before {state['current']} to roll back to"))
        plan = plan_patches(hs, list(target.get("patches") or []))
        if diff:
            print_script_diff(hs, state["root"], state["current"], target["name"])
            for action, patch in plan:
                res = (patching.apply(hs, patch, dry_run=True) if action == "apply"
                       else patching.revert(hs, patch, dry_run=True))
                patching.print_diff(hs.host.name, res["diff"])
        actions = [f"{a} {p.name}" for a, p in plan]
        return CHANGED, (f"would roll back {state['current']} -> {target['name']}"
                         + (f"; patches: {', '.join(actions)}" if actions else "") + " (check mode)")
    with deploy_lock(hs, "rollback", break_lock):
        return CHANGED, _rollback_locked([hs], to, show_diff=diff)


def _plan(hs: HostSession, variant: dict, wanted: list[str], show_diff: bool) -> tuple[str, str]:
    """Check mode: render, diff against the current release's script, list patch actions."""
    state = releases.listing(hs)
    root = state["root"]
    name = releases.release_name(variant["name"])
    new = render_preview(hs, variant)
    actions = plan_patches(hs, wanted)
    if show_diff:
        print_script_diff(hs, root, state["current"], name, new)
        for action, patch in actions:
            res = (patching.apply(hs, patch, dry_run=True) if action == "apply"
                   else patching.revert(hs, patch, dry_run=True))
            patching.print_diff(hs.host.name, res["diff"])
    summary = ", ".join(f"{a} {p.name}" for a, p in actions)
    return CHANGED, (f"would deploy {name} (replacing {state['current'] or 'nothing'})"
                     + (f"; patches: {summary}" if summary else "") + " (check mode)")


def print_script_diff(hs: HostSession, root: str, old: str | None, new: str, new_text: str | None = None) -> None:
    """Unified diff of launch.sh between two releases (`new_text`: a script not yet on the host)."""
    import difflib

    before = _read_remote(hs, f"{root}/releases/{old}/launch.sh") if old else ""
    after = new_text if new_text is not None else _read_remote(hs, f"{root}/releases/{new}/launch.sh")
    text = "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        f"{old or 'nothing'}/launch.sh", f"{new}/launch.sh"))
    patching.print_diff(hs.host.name, hs.redactor(text))


def _read_remote(hs: HostSession, path: str) -> str:
    from . import shell

    res = hs.run(f"cat {shell.remote_path(path)}")
    return res.stdout if res.ok else ""
