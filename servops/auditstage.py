"""The audit of the compiled region as deploy's stage and as the `audit` verb.

deploy: validate -> facts -> resolve -> render -> check -> AUDIT -> plan -> transaction. For a
variant whose launch compiles (the engine says which flags of which release compile), before
anything stops: the audit with the resolved fix set; a break a stored proven patch covers adds
that patch; an uncovered break refuses the deploy (with --fix: the fix loop synthesises, proves
and stores patches, and the deploy takes them). A round whose launch, fix set and installation the
host audited before takes that verdict without starting a server (servops/remote/audit_verdicts.py);
`invoke audit` runs every round afresh. A host that cannot run the audit (no GPU, too
little free GPU memory, no model config) says "not audited" and what it would need, never
"proven", and the deploy goes on as before.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import audit, engines, patchstore
from .audit import Outcome, Plan
from .bench import RESULTS_ROOT
from .errors import ServopsError
from .launchcheck import engine_version
from .output import CHANGED, EXIT_NOTHING, OK, Failed, console
from .progress import Phases
from .render import Launch
from .transport import HostSession


class AuditRefused(ServopsError):
    """The audit found a break no patch covers: the deploy stops before anything changed."""


def _flag(args: dict, name: str):
    return next((value for key, value in args.items() if audit.flag_name(key) == name), None)


def launch_compiles(engine: engines.Engine, args: dict, version: str | None) -> bool:
    """Does this launch run torch.compile (dynamo) at start? From the engine's own rules."""
    for flag, value in engine.compile_flags:
        got = _flag(args, flag)
        if got is not None and got is not False and (got == value or str(value) in str(got)):
            return True
    by_default = engine.by_version(engine.compiles_by_default, version)
    return by_default is not None and not _flag(args, by_default)


def results_dir(host: str) -> Path:
    """This audit's own directory (made here): two audits of a host in one second (two deploys
    racing, a deploy beside `invoke audit`) once shared one, their candidates and audit.json mixed."""
    base = RESULTS_ROOT / "audit" / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{host}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise ServopsError(f"{base}: a thousand audits of {host} this second; not one more")


def run(plan: Plan, *, fix: bool, rounds: int, tolerance: float, phases: Phases) -> tuple[Outcome, Path]:
    out = results_dir(plan.hs.host.name)
    outcome = audit.audit_and_fix(plan, fix=fix, rounds=rounds, tolerance=tolerance, work=out / "candidates",
                                  say=lambda line: phases.step("audit", f"{plan.hs.host.name}: {line}"))
    audit.dump(outcome, out / "audit.json")
    return outcome, out


def deploy_stage(hs: HostSession, variant_name: str, resolved: dict, launch: Launch, facts: dict,
                 wanted: list[str], *, fix: bool, skip: bool, phases: Phases) -> list[str] | None:
    """The patches the audit adds to the deploy's set (stored ones that cover its breaks, and
    those the fix loop proved); refuses an uncovered break. None: no audit (a launch that does
    not compile, --skip-audit)."""
    engine = engines.of_variant(resolved)
    version = engine_version(facts)
    if not launch_compiles(engine, launch.args, version):
        return None
    if skip:
        phases.step("audit", f"{hs.host.name}: skipped (--skip-audit): the compiled region is not audited")
        return None
    fix_set = [patchstore.find_patch(n) for n in wanted]
    plan = Plan(hs=hs, variant=variant_name, resolved=resolved, engine=engine, launch=launch, fix_set=fix_set,
                version=version, reuse=True)
    phases.step("audit", f"{hs.host.name}: the engine's compile and capture pass on a shrunk copy of the model, "
                         f"beside the serving server" + (" (fix loop on)" if fix else ""))
    outcome, out = run(plan, fix=fix, rounds=audit.DEFAULT_ROUNDS, tolerance=audit.DEFAULT_TOLERANCE, phases=phases)
    if outcome.verdict == "not-audited":
        phases.step("audit", f"{hs.host.name}: NOT audited: {outcome.why}")
        return []
    if outcome.verdict in ("clean", "fixed"):
        if outcome.added:
            phases.step("audit", f"{hs.host.name}: the set gains " + ", ".join(p.name for p in outcome.added))
        return [p.name for p in outcome.added]
    hint = "" if fix else f"; invoke audit --fix --variant {variant_name} -H {hs.host.name} writes and proves the fix"
    raise AuditRefused(f"{hs.host.name}: the audit refused the deploy ({audit.describe(outcome)}): {outcome.why}"
                       + (f"; the release's workaround: {outcome.workaround}" if outcome.workaround else "")
                       + hint + f"; nothing was changed (details: {out / 'audit.json'})")


def audit_host(hs: HostSession, variant: dict, *, fix: bool, rounds: int, tolerance: float) -> tuple[str, str, dict]:
    """`invoke audit` on one host: facts, resolve, render, check as deploy runs them, then the audit."""
    from .launchcheck import check_missing_branch, raise_if_refused, read_facts, resolve, verdict
    from .releases import deploy_root
    from .render import render_launch

    phases = Phases(hs.host.name, hs.redactor)
    facts = read_facts(hs, variant, deploy_root=deploy_root(hs.host))
    resolved, applied = resolve(variant, facts)
    launch = render_launch(hs.host, resolved)
    check_missing_branch(hs, variant, facts, launch)
    raise_if_refused(verdict(hs.host, variant, resolved, applied, launch, facts, hs.redactor), hs.host.name)
    engine = engines.of_variant(resolved)
    version = engine_version(facts)
    if not launch_compiles(engine, launch.args, version):
        return OK, f"{variant['name']}: the launch compiles nothing on {engine.label(version)}: nothing to audit", {}
    plan = Plan(hs=hs, variant=variant["name"], resolved=resolved, engine=engine, launch=launch,
                fix_set=[patchstore.find_patch(n) for n in resolved.get("patches") or []], version=version)
    outcome, out = run(plan, fix=fix, rounds=rounds, tolerance=tolerance, phases=phases)
    data = dict(audit.outcome_json(outcome), host=hs.host.name, variant=variant["name"], details=str(out))
    line = f"{variant['name']}: {audit.describe(outcome)}"
    if outcome.verdict in ("clean", "fixed"):
        written = f"; stored {', '.join(outcome.written)}" if outcome.written else ""
        return (CHANGED if outcome.written else OK), line + written, data
    if outcome.verdict == "not-audited":
        return OK, f"{variant['name']}: NOT audited: {outcome.why}", data
    detail = f": {outcome.why}" + (f"; the release's workaround: {outcome.workaround}" if outcome.workaround else "")
    return Failed(EXIT_NOTHING), line + detail, data  # breaks found and left: exit 1, the host untouched


def print_breaks(data: dict) -> None:
    from .output import print_table, table
    t = table(f"{data['host']}: audit of {data['variant']}", ["round", "state", "size", "break", "boundary"])
    for r in data["rounds"]:
        if not r["breaks"]:
            t.add_row(str(r["round"]), r["state"], "-", r["detail"] or "-", "-")
        for b in r["breaks"]:
            t.add_row(str(r["round"]), r["state"], ",".join(map(str, b["sizes"])) or "-", b["reason_line"],
                      b["boundary_text"])
    print_table(t)
    console.print(f"details: {data['details']}", markup=False, highlight=False)
