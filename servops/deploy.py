"""deploy / rollback: release, patch set, health-gated restart, automatic rollback.

Order, per server (one host, or the nodes of a multi-node server, rank 0 first):
  validate everything that needs no host            (bad input: one line, host untouched)
  launch preflight + patch plan, read-only          (a bad flag is refused before anything stops)
  -- lock --
  new release dir (0700: launch.sh, secrets.env, variant.yml, release.json) -> patch set
     (a failure or Ctrl-C here undoes the patches and removes the release: nothing changed)
  -- the point of no return: the old server stops --
  stop -> switch `current` -> start (+ host guard) -> health gate -> metric gate
  healthy: mark, prune  |  anything else (failure, exception, Ctrl-C): mark, roll back
  -- unlock --
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
import yaml

from . import deploystages as stages
from . import auditstage, engines, hostreply, interrupt, jitcache, patchplan, patchstore, prebuild, releases, startup
from .bringup import DEFAULT_LEASE_TIMEOUT, LeaseKeeper, Node, bring_up, health_timeout, signatures
from .deploylock import DEFAULT_STALE_AFTER, check_mode_note, host_lock
from .errors import ServopsError
from .launchcheck import (LaunchCheck, check_missing_branch, check_variant, engine_version, raise_if_refused,
                          read_facts, resolve, verdict)
from .multinode import node_args, with_args
from .output import ATTENTION, CHANGED, FAILED, OK, RESTORED, console, err_console
from .playbooks import load_variant
from .progress import Phases
from .provenance import git_sha, operator
from .redact import variant_secrets
from .render import Launch, render_launch
from .transport import HostSession

class DeployError(ServopsError):
    pass


NO_EARLIER = "no earlier healthy release to roll back to"


def server_port(hs: HostSession) -> int:
    return int(hs.host.require("server_port"))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---- what a variant becomes on one host ------------------------------------------------------

def preflight(hs: HostSession, variant: dict) -> tuple[dict, Launch, LaunchCheck]:
    """Read-only, one round trip: the host's own engine (sglang, vllm) parses the launch (every
    `when:` branch); a flag it rejects, a missing model, a busy port or too few GPUs refuse here,
    before anything stops. Returns the variant as it applies to this host's engine version and
    what it renders to. (deploy_group runs the same stages, with the deploy's facts.)"""
    check = check_variant(hs, variant, deploy_root=releases.deploy_root(hs.host))
    raise_if_refused(check, hs.host.name)
    return check.variant, render_launch(hs.host, check.variant), check


def render_preview(hs: HostSession, variant: dict) -> str:
    """The launch script exactly as deploy would write it on this host; what decided it on stderr."""
    resolved, launch, check = preflight(hs, variant)
    health = resolved.get("health") or {}
    source = "variant" if health.get("timeout") is not None else "inventory or default"
    notes = [f"host {check.engine}: {check.sglang_version or 'not installed'}"
             + (" (static check)" if check.static else ""),
             *(f"rule applied: {r}" for r in check.rules),
             f"health gate: {health.get('endpoint', '/health')} within {health_timeout(hs, health):g}s ({source})"]
    if launch.secret_env:
        notes.append(f"secrets from secrets.env (0600): {', '.join(sorted(launch.secret_env))}")
    for note in notes:
        err_console.print(f"# {hs.host.name}: {note}", markup=False, highlight=False)
    return launch.script


def release_files(hs: HostSession, variant: dict, launch: Launch, patches: list[str],
                  caches: jitcache.CachePlan | None = None) -> dict:
    health = dict(variant["health"], timeout=health_timeout(hs, variant["health"]))
    record = {
        "variant": variant["name"], "chain": variant["chain"], "created": _now(), "patches": patches,
        "status": "deploying", "servops_git": git_sha(), "port": server_port(hs), "health": health,
        "crash_signatures": variant["crash_signatures"], "stop_grace": variant.get("stop_grace", 30),
        "deployed_by": operator(),
    }
    if caches is not None:  # every start of the release records what it built in the host's cache ledger
        record["caches"] = caches.record_spec()
    engine = engines.of_variant(variant)
    if engine.name != engines.DEFAULT:  # recorded for bench and stop; an sglang release.json stays as it was
        record["engine"] = engine.name
    shown = {k: v for k, v in variant.items() if k not in ("chain",)}
    runs_from = stages.launch_files(hs.host, variant, launch)
    record["files"] = stages.digests(runs_from)  # as written: start and restart refuse a file edited since
    return {
        "launch.sh": runs_from.pop("launch.sh"),
        # secret values masked: the real ones live only in secrets.env (0600)
        "variant.yml": {"text": hs.redactor(yaml.safe_dump(shown, sort_keys=False))},
        "release.json": {"text": json.dumps(record, indent=1, sort_keys=True)},
        **runs_from,
    }


# ---- validation that needs no host -----------------------------------------------------------

def validate(variant: dict, nodes: list[HostSession], gate: list | None, push_url: str | None) -> None:
    """Everything checkable before any connection: a bad value is one line, nothing touched."""
    from . import patchstore

    for name in variant["patches"]:
        patchstore.find_patch(name)
    if push_url:
        from .push import validate_url

        validate_url(push_url)
    if gate:
        from .gate import validate as validate_gate
        from .playbooks import PLAYBOOK_ROOT

        validate_gate(gate, nodes[0].host.name, {p.stem for p in PLAYBOOK_ROOT.glob("*.yml")})
    for hs in nodes:
        server_port(hs)
        health_timeout(hs, variant["health"])


# ---- deploy ----------------------------------------------------------------------------------

def launch_identity(hs: HostSession, variant: dict, launch: Launch) -> dict[str, str]:
    """sha256 of what the server runs from a release: its launch script, secrets file and server
    files (not release.json or variant.yml: their timestamps and metadata restart nothing)."""
    return stages.digests(stages.launch_files(hs.host, variant, launch))


def deploy_group(nodes: list[HostSession], variant: str | dict, *, dry_run: bool = False, diff: bool = False,
                 no_rollback: bool = False, skip_patches: bool = False, break_lock: bool = False,
                 keep: int | None = None, gate: list | None = None, bench_opts: dict | None = None,
                 push_url: str | None = None, record: dict | None = None, force: bool = False, fix: bool = False,
                 skip_audit: bool = False) -> tuple[str, str]:
    """Deploy one server: a single host, or the nodes of a multi-node server (rank 0 first).

    `variant`: a playbook name, or a variant dict (a tuning trial). `record`, when given, receives
    the outcome: release, state (healthy / crashed / timeout / gate-failed / failed / interrupted),
    reason, elapsed and the log's path. A deploy that would change nothing (deploystages.plan)
    restarts nothing, unless `force`.

    The stages (deploystages), each once, top to bottom; per node:
      validate (no host) -> facts (ONE round trip: the engine's check program parses every `when:`
      branch's launch and reports the current release, the patch state, the lock) -> resolve
      (the `when:` rules of the host's version) -> render -> check (the host parser's verdict on
      that launch, from the facts) -> audit (a launch that compiles: the engine's compile and capture
      pass on a shrunk model beside the serving server, auditstage.py; an uncovered break refuses
      here, `fix` writes and proves its patch) -> plan (unchanged, or what changes)
    -> check mode ends here -> transaction (lock, release, patches, restart, gate, conclude).
    Extra round trips only where asked for: a host version that none of the `when:` probe
    versions stood for (its launch is checked in a second trip), a patch that proves an engine
    call site, --diff's patch diffs. tests/test_deploy_roundtrips.py counts them."""
    variant = load_variant(variant) if isinstance(variant, str) else variant
    variant_name = variant["name"]
    for hs in nodes:  # a variant-only secret (HF_TOKEN) is masked like the host's own
        hs.redactor.add(variant_secrets(variant, hs.host.get("secret_vars") or ()))
    validate(variant, nodes, gate, push_url)
    per_node = node_args(variant, [hs.host for hs in nodes])  # a bad node count fails before any output
    phases = Phases(nodes[0].host.name, nodes[0].redactor)
    phases.step("preflight", f"{variant_name}: launch check against the host's {engines.of_variant(variant).name}, "
                             f"patch plan (read-only)")
    store = patchstore.all_patches()
    prepared, plans = [], []
    for hs, extra in zip(nodes, per_node):
        node_variant = with_args(variant, extra)
        root = releases.deploy_root(hs.host)
        facts = read_facts(hs, node_variant, deploy_root=root,
                           deploy=stages.facts_request(hs.host, node_variant, store, script=diff and dry_run))
        if facts["deploy"].get("patches_recovered"):
            err_console.print(f"{hs.host.name}: patch state: {facts['deploy']['patches_recovered']}", markup=False)
        resolved, applied = resolve(node_variant, facts)
        launch = render_launch(hs.host, resolved)  # a branch that does not render fails here, on its host only
        check_missing_branch(hs, node_variant, facts, launch)
        check = verdict(hs.host, node_variant, resolved, applied, launch, facts, hs.redactor)
        raise_if_refused(check, hs.host.name)
        hs.redactor.add(launch.secret_env.values())  # as rendered (a value may be a template)
        phases.step("preflight", f"{hs.host.name}: {check.summary()}" + "".join(f"; rule: {r}" for r in check.rules))
        for w in check.warnings:  # what the check could not settle, or found on the host (GPU memory held)
            phases.step("warning", f"{hs.host.name}: {w}")
        # the fix set is the RESOLVED variant's: a `when:` rule adds the patches a release needs
        wanted = [] if skip_patches else list(resolved.get("patches") or [])
        if hs is nodes[0] and not dry_run and not skip_patches:  # one audit per server, on rank 0's host
            a0 = time.monotonic()
            added = auditstage.deploy_stage(hs, variant_name, resolved, launch, facts, wanted, fix=fix,
                                            skip=skip_audit, phases=phases)
            if record is not None and added is not None:  # spent before anything stopped (tune shows it)
                record["audit_s"] = round(time.monotonic() - a0, 2)
            if added:
                store = patchstore.all_patches()  # the fix loop may have stored new patches
                wanted += [n for n in added if n not in wanted]
                resolved = dict(resolved, patches=wanted)
        elif hs is nodes[0] and dry_run and auditstage.launch_compiles(engines.of_variant(resolved), launch.args,
                                                                        engine_version(facts)):
            phases.step("audit", f"{hs.host.name}: the launch compiles: the real deploy audits its compiled region "
                                 f"first (invoke audit --variant {variant_name} shows it now)")
        unproven = [n for n in wanted if not patchstore.find_patch(n).proven()]
        if unproven:
            raise DeployError(f"{hs.host.name}: {', '.join(unproven)}: synthesised but not proven; never deployed "
                              f"(invoke audit --fix proves it)")
        plans.append((stages.plan(hs.host, facts, resolved, launch, wanted, store, nodes=len(nodes)), facts))
        prepared.append((hs, resolved, launch, plans[-1][0].actions))
        for line in plans[-1][0].caches.lines() if plans[-1][0].caches else []:
            phases.step("caches", f"{hs.host.name}: {line}")
    wanted = [] if skip_patches else list(prepared[0][1].get("patches") or [])  # the set rank 0 resolved
    if record is not None:  # as deployed: the variant's set and what the audit stage added to it
        record["patches"] = list(wanted)
    same = [] if force or gate else [p.unchanged for p, _facts in plans]
    if same and all(same):
        phases.step("done", f"{same[0]} already runs this launch and patch set, healthy: nothing restarted "
                            f"(--force restarts it)")
        if record is not None:
            record.update(release=same[0], state="healthy", reason="unchanged", elapsed=0.0, log=None)
        return OK, f"{'no change' if dry_run else 'unchanged'} (current: {same[0]})" + (" (check mode)" if dry_run else "")
    if dry_run:
        if diff:
            for (hs, _resolved, launch, _actions), (p, facts) in zip(prepared, plans):
                _print_plan_diff(hs, facts, p, launch)
        return CHANGED, "; ".join(p.text(resolved["name"]) for (_hs, resolved, *_), (p, _f) in zip(prepared, plans)) \
            + "".join(_lock_note(hs, facts["deploy"], break_lock, named=True)
                      for (hs, *_), (_p, facts) in zip(prepared, plans))
    with ExitStack() as stack:
        locks = []
        for hs in nodes:
            locks.append(stack.enter_context(host_lock(hs, f"deploy {variant_name}", break_lock, port=server_port(hs),
                                                       supersede=True)))
        phases.step("lock", "deploy lock taken" + (f" on {len(nodes)} nodes" if len(nodes) > 1 else ""))
        for hs, lock in zip(nodes, locks):
            port = lock["port"]
            if port["busy"] and not port["ours"]:
                raise DeployError(f"{hs.host.name}: port {server_port(hs)} is already in use by a process servops "
                                  f"did not start; free it or change server_port")
        return _deploy_locked(prepared, locks, variant_name, phases, wanted, diff=diff, no_rollback=no_rollback,
                              keep=keep, gate=gate, bench_opts=bench_opts or {}, push_url=push_url,
                              record=record if record is not None else {}, plans=[p for p, _f in plans])


def _print_plan_diff(hs: HostSession, facts: dict, plan: stages.Plan, launch: Launch) -> None:
    """Check mode's --diff: the new launch.sh against the current release's (read in the facts
    trip), and each patch action's diff (a dry run of it on the host)."""
    from . import patching

    old = ((facts["deploy"].get("current") or {}).get("launch_sh") or "") if plan.current else ""
    print_script_diff(hs, facts["deploy"]["root"], plan.current, "new release", launch.script, old_text=old)
    for action, patch in plan.actions:
        res = (patching.apply(hs, patch, dry_run=True) if action == "apply"
               else patching.revert(hs, patch, dry_run=True))
        patching.print_diff(hs.host.name, res["diff"])


def guard_spec(hs: HostSession, meta: dict, lock: dict, wanted: list[str], previous: str | None = None) -> dict:
    """What the host guard needs to finish, or undo, this deploy (or restart) by itself: the
    release to go back to is the one running now (a restart: the previous healthy one)."""
    prev = previous if previous is not None else lock["listing"]["current"]
    target = next((r for r in lock["listing"]["releases"] if r["name"] == prev), None)
    spec = {"_clock_step": float(os.environ["SERVOPS_TEST_GUARD_CLOCK_STEP"])} \
        if os.environ.get("SERVOPS_TEST_GUARD_CLOCK_STEP") else {}  # tests: the guard's wall clock stepped
    return {**spec, "lease_timeout": float(hs.host.get("lease_timeout") or DEFAULT_LEASE_TIMEOUT),
            "health_timeout": health_timeout(hs, meta["health"]), "port": meta["port"], "health": meta["health"],
            "signatures": signatures(meta), "stop_grace": meta.get("stop_grace", 30), "lock_id": lock["id"],
            "previous": target and {"name": target["name"], "port": target.get("port"), "health": target.get("health")},
            "patch_plan": patchplan.between(wanted, list((target or {}).get("patches") or []))}


def _deploy_locked(prepared, locks, variant_name, phases, wanted, *, diff, no_rollback, keep, gate, bench_opts,
                   push_url, record, plans) -> tuple[str, str]:
    previous = {hs.host.name: lock["listing"]["current"] for (hs, *_), lock in zip(prepared, locks)}
    patch_done: dict[str, list] = {}
    nodes: list[Node] = []
    keeper = None
    # Before the old server stops, any failure (or Ctrl-C) undoes what was done: nothing changed.
    # The host guard is armed with the release, before the patches: a controller that dies from
    # here on is covered too (the guard undoes the patches, or rolls back after the stop).
    try:
        phases.step("upload", f"new release for {variant_name}; guard armed")
        for (hs, resolved, launch, actions), lock, plan in zip(prepared, locks, plans):
            files = release_files(hs, resolved, launch, wanted, plan.caches)
            meta = json.loads(files["release.json"]["text"])
            guard = guard_spec(hs, meta, lock, wanted)
            res = releases.ctl(hs, "prepare", name=releases.release_name(resolved["name"]), files=files, guard=guard,
                               journal={"action": "deploy.start", "who": operator(), "variant": variant_name,
                                        "previous": previous[hs.host.name],
                                        "patches": [f"{a} {p.name}" for a, p in actions]})
            nodes.append(Node(hs, res["name"], meta, lock["root"], guard,
                              extra={"server": lock["listing"]["server"], "lock_id": lock["id"]}))
        keeper = LeaseKeeper(nodes, every=max(1.0, nodes[0].guard["lease_timeout"] / 4)).start()
        changes = []
        for (hs, _resolved, _launch, actions) in prepared:
            patch_done[hs.host.name] = []
            if actions:
                phases.step("patches", ", ".join(f"{a} {p.name}" for a, p in actions))
            changes += patchplan.run(hs, actions, show_diff=diff, done=patch_done[hs.host.name])
        if diff:
            for n in nodes:
                print_script_diff(n.hs, n.root, previous[n.hs.host.name], n.name)
        for n, (_hs, resolved, _launch, _actions), plan in zip(nodes, prepared, plans):
            n.extra["compare"] = [n.name, previous[n.hs.host.name]]  # its start judged against the one it replaces
            if plan.prebuild:  # the kernels built while the old server still serves
                p0 = time.monotonic()
                prebuild.run(n.hs, n.name, resolved, n.meta, plan.caches, plan.prebuild, phases)
                record["prebuild_s"] = round(time.monotonic() - p0, 2)  # single-node only: one a deploy
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            interrupt.request()
        with interrupt.handling():
            try:
                for n in nodes:  # the decision is ours (a guard that took over undoes the patches itself)
                    claim(n, "undo: discard the release")
            except releases.GuardTookOver as took:
                if keeper:
                    keeper.stop()
                return ATTENTION, f"{took}; nothing restarted"
            for hs, _resolved, _launch, _actions in prepared:
                patchplan.undo(hs, patch_done.get(hs.host.name, []))
            for n in nodes:  # its guard stands down when the release goes
                releases.ctl(n.hs, "discard", name=n.name)
        if keeper:
            keeper.stop()
        if isinstance(exc, KeyboardInterrupt):
            record.update(release=None, state="interrupted", reason="before the server was touched")
            return FAILED, "interrupted before the server was touched: nothing changed"
        raise
    return _bring_up_and_conclude(nodes, keeper, phases, variant_name, previous, changes, no_rollback=no_rollback,
                                  keep=keep, gate=gate, bench_opts=bench_opts, push_url=push_url, record=record)


def _bring_up_and_conclude(nodes: list[Node], keeper: LeaseKeeper, phases: Phases, variant_name: str,
                           previous: dict, changes: list[str], *, no_rollback: bool = False, keep: int | None = None,
                           gate: list | None = None, bench_opts: dict | None = None, push_url: str | None = None,
                           record: dict | None = None, verb: str = "deploy") -> tuple[str, str]:
    """The point of no return, for a deploy and for a restart of the current release: from here
    every failure, exception or Ctrl-C ends in a rollback (the guard watching throughout)."""
    n0 = nodes[0]
    hs0 = n0.hs
    record = record if record is not None else {}
    owner = {"name": n0.name, "id": n0.extra["lock_id"]}
    during, interrupted_in = f"the rollback of {n0.name}", None  # what a second Ctrl-C interrupts; where the first did
    try:
        try:
            outcome = bring_up(nodes, phases, n0.name, owner=owner)
            if outcome["state"] == "healthy" and gate:
                phases.step("gate", "bench at " + ", ".join(str(l) for l in sorted({c.level for c in gate})))
                outcome = _metric_gate(hs0, gate, bench_opts or {}, outcome)
            if push_url:
                _push_event(push_url, hs0, variant_name, n0.name, outcome)
        except KeyboardInterrupt:
            interrupt.request()
            interrupted_in = phases.current or verb
            outcome = {"state": "interrupted", "reason": f"Ctrl-C during {interrupted_in}", "excerpt": []}
        except releases.GuardTookOver as took:
            return ATTENTION, str(took)
        except Exception as exc:  # noqa: BLE001 - a failure after stop must still roll back
            outcome = {"state": "failed", "reason": f"{phases.current}: {exc}", "excerpt": []}
        if interrupted_in and verb != "deploy":
            during = f"bringing {n0.name} back up"
            try:
                outcome = _bring_back(nodes, phases, verb, owner, interrupted_in)
            except releases.GuardTookOver as took:
                return ATTENTION, str(took)
            during = f"the rollback of {n0.name}"
        record.update(release=n0.name, state=outcome["state"], reason=outcome["reason"],
                      elapsed=outcome.get("elapsed"), log=outcome.get("log"), start=outcome.get("start"))
        with interrupt.handling():
            try:
                return _conclude(nodes, outcome, phases, variant_name, previous, changes, no_rollback, keep, verb)
            except releases.GuardTookOver as took:
                return ATTENTION, str(took)
    except KeyboardInterrupt:  # a second Ctrl-C, during the rollback: leave, say where things stand
        return ATTENTION, (f"interrupted during {during}; the host may have no server: "
                           f"run `invoke status -H {hs0.host.name}`, then `invoke rollback -H {hs0.host.name}`")
    finally:
        keeper.stop()  # the release is marked by now: its guard has stood down


def _bring_back(nodes: list[Node], phases: Phases, verb: str, owner: dict, interrupted_in: str) -> dict:
    """Ctrl-C during a start or restart: the release that was current comes back up, the same one
    (rolling back to an older one would change what serves, and with none older leave the host
    down). Only when it cannot come up does the caller's rollback follow. Interrupted during the
    health gate its server is already starting: the gate is waited again, nothing restarted twice."""
    n0 = nodes[0]
    why = f"Ctrl-C during {interrupted_in}"
    phases.step("interrupt", f"{why}: a {verb} keeps {n0.name}; bringing it back up (Ctrl-C again to stop waiting)")
    with interrupt.handling():
        try:
            outcome = bring_up(nodes, phases, n0.name, owner=owner, started=interrupted_in == "health")
        except releases.GuardTookOver:
            raise
        except Exception as exc:  # noqa: BLE001 - it cannot come up: the rollback decides
            return {"state": "failed", "reason": f"{why}, then bringing {n0.name} back: {exc}", "excerpt": []}
    return dict(outcome, reason=f"{why}, then {outcome['reason']}")


def _push_event(url: str, hs: HostSession, variant_name: str, release: str, outcome: dict) -> None:
    """Part of the deploy: on a healthy release a failed push fails the deploy (and rolls back)."""
    from .push import push_deploy_event

    try:
        push_deploy_event(url, hs.host.name, variant_name, release, outcome["state"])
    except ServopsError as exc:
        if outcome["state"] == "healthy":
            raise
        err_console.print(f"{hs.host.name}: {exc}", markup=False)


def claim(n: Node, action: str) -> None:
    """Take the release's decision token before acting on it; GuardTookOver when the host's
    guard acted first (this controller was cut off or frozen past its lease)."""
    releases.ctl(n.hs, "claim", name=n.name, id=n.extra["lock_id"], action=action, who=operator())


def _conclude(nodes: list[Node], outcome: dict, phases: Phases, variant_name: str, previous: dict,
              changes: list[str], no_rollback: bool, keep: int | None, verb: str = "deploy") -> tuple[str, str]:
    n0 = nodes[0]
    hs0 = n0.hs
    if outcome["state"] == "healthy":
        started = start_record(outcome, n0.name, phases)
        for n in nodes:
            prev = previous[n.hs.host.name]
            results = releases.batch(
                n.hs, {"op": "claim", "name": n.name, "id": n.extra["lock_id"], "action": "keep", "who": operator()},
                {"op": "mark", "name": n.name, "fields": {"status": "healthy", "healthy_at": _now(), "previous": prev,
                                                          **started["fields"]},
                 "journal": {"action": verb, "who": operator(), "release": n.name, "variant": variant_name,
                             "outcome": "healthy", "detail": outcome["reason"], "previous": prev,
                             **started["journal"]}},
                {"op": "disarm", "name": n.name},
                {"op": "prune", "keep": int(keep or n.hs.host.get("keep_releases", 5)), "protect": prev})
            if results[-1].get("skipped"):  # a damaged pins.json: nothing pruned
                phases.step("warning", f"{n.hs.host.name}: {results[-1]['skipped']}")
        extra = f"; patches: {', '.join(changes)}" if changes else ""
        ranks = f" on {len(nodes)} nodes" if len(nodes) > 1 else ""
        phases.step("done", f"{n0.name} healthy in {outcome['elapsed']:.1f}s: {outcome['reason']}")
        prev = previous[hs0.host.name]
        back = f"; invoke rollback goes back to {prev}" if prev and prev != n0.name and verb == "deploy" else ""
        done = {"deploy": "deployed", "restart": "restarted", "start": "started"}[verb]
        return CHANGED, f"{done} {n0.name}{ranks} (healthy in {outcome['elapsed']:.1f}s){extra}{started['grew']}{back}"
    status = "interrupted" if outcome["state"] == "interrupted" else "failed"
    for n in nodes:
        # the guard stays armed through the rollback: a controller lost mid-way is finished for
        releases.batch(n.hs, {"op": "claim", "name": n.name, "id": n.extra["lock_id"],
                              "action": "leave" if no_rollback else "roll back", "who": operator()},
                       {"op": "mark", "name": n.name, "fields": {"status": status, "failure": outcome["reason"]},
                        "journal": {"action": verb, "who": operator(), "release": n.name, "variant": variant_name,
                                    "outcome": status, "detail": outcome["reason"]}},
                       *([{"op": "disarm", "name": n.name}] if no_rollback else []))
    report_failure(hs0, n0.name, outcome)
    from .diagnose import diagnose_command

    hint = f"; next: {diagnose_command(hs0.host.name)}"
    if no_rollback:
        return ATTENTION, f"{n0.name} {outcome['state']}: {outcome['reason']} (--no-rollback: left as is){hint}"
    try:
        back = _rollback_locked([n.hs for n in nodes], to=None, failed=[n.name for n in nodes], phases=phases,
                                owner={"name": n0.name, "id": n0.extra["lock_id"]},
                                found=[previous.get(n.hs.host.name) for n in nodes])
    except releases.GuardTookOver:
        raise
    except ServopsError as exc:
        return ATTENTION, (f"{n0.name} {outcome['state']}: {outcome['reason']}; {exc}; the host has no healthy "
                           f"server: fix it, then run `invoke rollback -H {hs0.host.name}`{hint}")
    finally:
        for n in nodes:  # done (or reported): the guard stands down
            try:
                releases.ctl(n.hs, "disarm", name=n.name)
            except ServopsError:
                pass
    code = ATTENTION if back.startswith(NO_EARLIER) else RESTORED
    return code, f"{n0.name} {outcome['state']}: {outcome['reason']}; {back}{hint}"


def start_record(outcome: dict, release: str, phases: Phases) -> dict:
    """A healthy start's phases (the gate read them from the log on the host): its phase line and
    the phases that grew beyond their noise against the previous start (the release's own, else
    the last of the release it replaced), and what release.json ("starts", its last starts) and
    the journal keep."""
    start = startup.clean(outcome.get("start"))
    if not start:
        return {"fields": {}, "journal": {}, "grew": ""}
    previous, own, whose = startup.compared(outcome.get("before"), release)
    phases.step("start-up", startup.text(start))
    grew = startup.grown(start, previous)
    if grew:
        phases.step("start-up", f"grew beyond its noise against {whose}: " + "; ".join(grew))
    if outcome.get("cache_problem"):
        phases.step("warning", outcome["cache_problem"])
    return {"fields": {"starts": startup.kept(own, start)}, "journal": {"start": start},
            "grew": f"; start-up grew: {', '.join(g.split(' ', 1)[0] for g in grew)}" if grew else ""}


def _metric_gate(hs: HostSession, gate: list, bench_opts: dict, outcome: dict) -> dict:
    """Bench the healthy release at the gate's levels; a failed condition fails the deploy."""
    from . import bench
    from .gate import bench_options, evaluate, gate_levels

    result = bench.run_bench(hs, gate_levels(gate), **dict(bench_options(gate), **bench_opts))
    bench.print_result(result)
    passed, lines = evaluate(gate, result, lambda v: bench.latest_for_variant(hs.host.name, v))
    for line in lines:
        console.print(f"{hs.host.name}: gate {line}", markup=False)
    if passed:
        return outcome
    failed = "; ".join(l for l in lines if l.startswith("FAIL"))
    return {"state": "gate-failed", "reason": f"metric gate failed: {failed}", "elapsed": outcome["elapsed"], "excerpt": []}


def report_failure(hs: HostSession, name: str, outcome: dict) -> None:
    """The reason, a bounded excerpt (the signature line with its context) and the full log's path."""
    if outcome.get("excerpt"):  # the outcome itself is the recap's line: said once
        err_console.print(f"--- server.log excerpt ({hs.host.name}, {name}) ---", markup=False)
        for line in outcome["excerpt"]:
            err_console.print(hs.redactor(line), markup=False, highlight=False)
        err_console.print(f"--- full log: {hs.host.name}:{outcome.get('log') or name + '/server.log'}", markup=False)


# ---- rollback --------------------------------------------------------------------------------

def release_facts(hs: HostSession) -> tuple[dict, list[patchstore.Patch]]:
    """The releases listing and every stored patch's state, one round trip: what rollback, start
    and restart plan from (plan_patches)."""
    store = patchstore.all_patches()
    state = releases.facts(hs, [p.remote_spec() for p in store])
    if state.get("patches_recovered"):
        err_console.print(f"{hs.host.name}: patch state: {state['patches_recovered']}", markup=False)
    return state, store


def _lock_note(hs: HostSession, facts: dict, break_lock: bool, named: bool = False) -> str:
    """"; <what the real run would meet at the deploy lock>" for a check mode's line, or "";
    `named`: after the host's name (a deploy's line covers every node)."""
    note = check_mode_note(facts.get("lock"), float(hs.host.get("lock_stale_after", DEFAULT_STALE_AFTER)), break_lock)
    return "" if not note else f"; {hs.host.name}: {note}" if named else f"; {note}"


def plan_patches(hs: HostSession, state: dict, store: list[patchstore.Patch], wanted: list[str]) -> list:
    """(action, patch) pairs that make the host's applied set `wanted`, from release_facts (pure)."""
    from . import patching

    return patchplan.actions(hs.host.name, store, patching.status_rows(hs.host.name, store, state["patches"]), wanted)


def _rollback_locked(nodes: list[HostSession], to: str | None, failed: list[str] | None = None,
                     show_diff: bool = False, phases: Phases | None = None, owner: dict | None = None,
                     found: list[str | None] | None = None) -> str:
    """Bring every node back to an earlier release (`to`, or each node's previous healthy one).

    found: after a failed deploy, the release each node ran when the deploy began. It is the one
    to go back to (as the host's guard does), not the newest healthy release: after a `rollback`
    or a campaign's `leave:`, newer healthy releases exist that the operator had moved away from."""
    phases = phases or Phases(nodes[0].host.name, nodes[0].redactor)
    targets = []
    for i, hs in enumerate(nodes):
        state, store = release_facts(hs)
        rels = {r["name"]: r for r in state["releases"]}
        if to:
            if to not in rels:
                raise DeployError(f"{hs.host.name}: no release {to!r} (see invoke releases)")
            target = rels[to]
        else:
            anchor = failed[i] if failed else state["current"]
            was = found[i] if found else None
            if was and was != anchor and rels.get(was, {}).get("status") == "healthy":
                target = rels[was]
            else:
                target = releases.previous_good(state["releases"], anchor)
            if target is None:
                if failed:
                    for other in nodes:
                        releases.stop(other, 10.0)
                    return f"{NO_EARLIER}: server stopped"
                raise DeployError(f"{hs.host.name}: no healthy release before {anchor} to roll back to")
        targets.append((hs, target, state, store))
    phases.step("rollback", f"to {targets[0][1]['name']}")
    for hs, target, state, store in targets:
        actions = plan_patches(hs, state, store, list(target.get("patches") or []))
        if actions:
            phases.step("patches", ", ".join(f"{a} {p.name}" for a, p in actions))
        patchplan.run(hs, actions, show_diff=show_diff)
        if show_diff:
            print_script_diff(hs, state["root"], state["current"], target["name"])
    nodes_up = [Node(hs, t["name"], t, state["root"], extra={"server": state["server"]}) for hs, t, state, _s in targets]
    hs0, t0, *_ = targets[0]
    outcome = bring_up(nodes_up, phases, f"rollback to {t0['name']}", owner=owner)
    if outcome["state"] != "healthy":
        report_failure(hs0, t0["name"], outcome)
        for hs, t, *_ in targets:
            releases.ctl(hs, "journal", entry={"action": "rollback", "who": operator(), "release": t["name"],
                                               "outcome": "failed", "detail": outcome["reason"]})
        raise DeployError(f"{hs0.host.name}: rollback to {t0['name']} failed too: {outcome['reason']}")
    started = start_record(outcome, t0["name"], phases)
    for hs, t, state, _store in targets:
        releases.ctl(hs, "mark", name=t["name"], fields={"status": "healthy", "rolled_back_at": _now(),
                                                         **started["fields"]},
                     journal={"action": "rollback", "who": operator(), "release": t["name"], "outcome": "healthy",
                              "from": state["current"], "detail": "automatic" if failed else "requested",
                              **started["journal"]})
    phases.step("done", f"rolled back to {t0['name']} (healthy in {outcome['elapsed']:.1f}s)")
    return f"rolled back to {t0['name']} (healthy in {outcome['elapsed']:.1f}s)"


def rollback(hs: HostSession, to: str | None = None, dry_run: bool = False, break_lock: bool = False,
             diff: bool = False) -> tuple[str, str]:
    if to is not None:
        releases.check_name(to, "--to")
    if dry_run:
        from . import patching

        state, store = release_facts(hs)
        target = (next((r for r in state["releases"] if r["name"] == to), None) if to
                  else releases.previous_good(state["releases"], state["current"]))
        if target is None:
            raise DeployError(f"{hs.host.name}: " + (f"no release {to!r}" if to else
                              f"no healthy release before {state['current']} to roll back to"))
        plan = plan_patches(hs, state, store, list(target.get("patches") or []))
        if diff:
            print_script_diff(hs, state["root"], state["current"], target["name"])
            for action, patch in plan:
                res = (patching.apply(hs, patch, dry_run=True) if action == "apply"
                       else patching.revert(hs, patch, dry_run=True))
                patching.print_diff(hs.host.name, res["diff"])
        actions = [f"{a} {p.name}" for a, p in plan]
        return CHANGED, (f"would roll back {state['current']} -> {target['name']}"
                         + (f"; patches: {', '.join(actions)}" if actions else "") + " (check mode)"
                         + _lock_note(hs, state, break_lock))
    with host_lock(hs, "rollback", break_lock, supersede=True):
        try:
            return CHANGED, _rollback_locked([hs], to, show_diff=diff)
        except KeyboardInterrupt:
            return FAILED, (f"interrupted during the rollback; the host may have no server: run "
                            f"`invoke status -H {hs.host.name}`, then `invoke rollback -H {hs.host.name}` again")


# ---- shared helpers ----------------------------------------------------------------------------

def print_script_diff(hs: HostSession, root: str, old: str | None, new: str, new_text: str | None = None,
                      old_text: str | None = None) -> None:
    """Unified diff of launch.sh between two releases (`new_text`: a script not yet on the host;
    `old_text`: the old one's, already read)."""
    import difflib

    from . import patching

    before = old_text if old_text is not None else _read_remote(hs, f"{root}/releases/{old}/launch.sh") if old else ""
    after = new_text if new_text is not None else _read_remote(hs, f"{root}/releases/{new}/launch.sh")
    text = "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        f"{old or 'nothing'}/launch.sh", f"{new}/launch.sh"))
    patching.print_diff(hs.host.name, hs.redactor(text))


def _read_remote(hs: HostSession, path: str) -> str:
    from . import shell

    res = hs.run(f"cat -- {shell.remote_path(path)}")
    return res.stdout if res.ok else ""


def stop(hs: HostSession, grace: float | None, dry_run: bool, break_lock: bool = False) -> tuple[str, str]:
    """`invoke stop`: every process of the release (its leader, children that ignore SIGTERM, a
    child still serving after its leader died, setsid() escapees), under the host lock so it
    never races a deploy's health gate."""
    from .bringup import stop_lines

    state = releases.listing(hs)
    server, leftovers = state["server"], state.get("leftovers") or []
    if not server and not leftovers:
        return OK, "no server running"
    what = (f"pid {server['pid']} ({server['release']})" if server else
            f"{len(leftovers)} leftover process(es) of {leftovers[0]['release']} (their server's leader is gone)")
    if dry_run:
        return CHANGED, f"would stop {what} (check mode)"
    with host_lock(hs, "stop", break_lock, supersede=True):
        current = next((r for r in state["releases"] if r["name"] == state["current"]), {})
        wait = grace or float(current.get("stop_grace", 30))
        try:
            res = releases.ctl(hs, "stop", grace=wait, ssh_timeout=int(wait) + 90,
                               journal={"action": "stop", "who": operator()})
        except releases.RemoteError as exc:  # signals were sent: the host is not as it was
            return ATTENTION, f"{exc}; see invoke status -H {hs.host.name}"
    if not res.get("stopped"):
        return OK, "no server running"
    how = "SIGKILL after the grace period" if res.get("killed") else "SIGTERM"
    details = stop_lines(res)
    return CHANGED, f"stopped {what} ({how})" + ("; " + "; ".join(details) if details else "")


# ---- start / restart: the current release, no new one ----------------------------------------

def drift_text(release: str, drift: list[dict]) -> str:
    """How a release's launch files differ from what servops wrote (deploy_ctl release_drift), in
    one clause per file (pure)."""
    def one(d: dict) -> str:
        if d.get("now") is None:
            return f"{d['file']} " + ("is gone" if d.get("kind") == "gone" else f"is no longer the file servops wrote "
                                      f"({hostreply.shown(str(d.get('kind') or 'not a regular file'), 512)})")
        when = f"{d['recorded'][7:19]}..." if d.get("recorded") else "unknown"
        return (f"{d['file']} was changed on the host (sha256 {when} as written, now {d['now'][7:19]}...; "
                f"{d.get('bytes', 0):,} bytes, modified {hostreply.shown(str(d.get('modified')), 40)})")
    return f"{release}: " + "; ".join(one(d) for d in drift[:4]) + (f"; and {len(drift) - 4} more" if len(drift) > 4 else "")


def restart_current(hs: HostSession, verb: str, dry_run: bool = False, break_lock: bool = False,
                    allow_drift: bool = False, record: dict | None = None) -> tuple[str, str]:
    """`start` brings the current release up when its server is down (after a reboot, a stop);
    `restart` stops and starts it. Health-gated and guarded as a deploy is: its patch set is
    made whole first, and a crash rolls back to the previous healthy release. A release whose
    launch files were edited on the host since servops wrote them is refused, naming each file
    and how it differs, unless `allow_drift`."""
    state, store = release_facts(hs)
    cur, server = state["current"], state["server"]
    name = hs.host.name
    if not cur:
        raise DeployError(f"{name}: no release is deployed under {state['root']}: invoke deploy --variant V -H {name}")
    rels = {r["name"]: r for r in state["releases"]}
    if cur not in rels:
        raise hostreply.malformed(name, "deploy_ctl facts", f"current {cur!r} is not among the releases listed")
    target = rels[cur]
    if verb == "start" and server and server.get("release") == cur:
        ident = releases.ctl(hs, "identity", name=cur, files=[])
        if ident.get("healthy"):
            return OK, f"{cur} already running (pid {server['pid']})"
        raise DeployError(f"{name}: {cur} runs (pid {server['pid']}) but is not healthy: invoke restart -H {name}")
    drift = state.get("drift") or []
    if drift and not allow_drift and not dry_run:
        raise DeployError(f"{name}: {verb} refused: {drift_text(cur, drift)}: it would run as edited, not as deployed. "
                          f"Look at it on the host ({state['root']}/releases/{cur}), then {verb} --allow-drift to run it "
                          f"as it is, or deploy again")
    wanted = list(target.get("patches") or [])
    actions = plan_patches(hs, state, store, wanted)
    if dry_run:
        patches = "; patches: " + ", ".join(f"{a} {p.name}" for a, p in actions) if actions else ""
        drifted = (f"; {drift_text(cur, drift)}: the real run would " + ("run it as edited (--allow-drift)"
                   if allow_drift else "refuse (--allow-drift runs it)")) if drift else ""
        return CHANGED, f"would {verb} {cur}{patches}{drifted} (check mode)" + _lock_note(hs, state, break_lock)
    phases = Phases(name, hs.redactor)
    if drift:
        phases.step("warning", f"--allow-drift: {drift_text(cur, drift)}; running it as edited")
    elif state.get("drift") is None:
        phases.step("note", f"{cur} records no digests of its launch files (made by an older servops): "
                            f"not checked for edits on the host")
    with host_lock(hs, verb, break_lock, port=int(target.get("port") or server_port(hs)), supersede=True) as lock:
        port = lock.get("port") or {}
        if port.get("busy") and not port.get("ours"):
            raise DeployError(f"{name}: port {target.get('port')} is already in use by a process servops did not "
                              f"start; free it or change server_port")
        prev = releases.previous_good(state["releases"], cur)
        guard = guard_spec(hs, target, lock, wanted, previous=prev["name"] if prev else "")
        if actions:
            phases.step("patches", ", ".join(f"{a} {p.name}" for a, p in actions))
        changes = patchplan.run(hs, actions)
        releases.ctl(hs, "rearm", name=cur, guard=guard,
                     journal={"action": f"{verb}.begin", "who": operator(), "release": cur,
                              **({"detail": f"--allow-drift: {drift_text(cur, drift)}"} if drift else {})})
        node = Node(hs, cur, target, lock["root"], guard, extra={"server": lock["listing"]["server"],
                                                                "lock_id": lock["id"]})
        keeper = LeaseKeeper([node], every=max(1.0, guard["lease_timeout"] / 4)).start()
        return _bring_up_and_conclude([node], keeper, phases, target.get("variant") or "?",
                                      {name: prev["name"] if prev else None}, changes, verb=verb, record=record)
