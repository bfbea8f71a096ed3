"""audit: every dynamo break of a variant's compiled region, found before the restart, and fixed.

The audit runs the ENGINE's own compile and capture pass (the release's launch, the variant's
resolved flags and all its prefill capture sizes) on a shrunk copy of the host's model, in a child
server beside the serving one (servops/remote/audit_compile.py), with the fix set served from
patched copies. Each break comes back with dynamo's reason and the chain of calls dynamo was
inlining, outermost first, each with the arguments dynamo saw (servops/remote/audit_shim.py).

From a break (pure functions, unit-tested from records):
- the boundary: the last engine frame and the callee it enters (where the engine leaves what
  dynamo can trace);
- the wrap candidates: the chain's module-level functions, innermost first, whose arguments are
  tensors and constants;
- whether a stored patch covers it (a synthesised patch whose `wraps` is one of them).

The fix loop (`--fix`): audit -> for an uncovered break, probe the candidates on the host (the
real function, called at several sizes) until one can be wrapped, synthesise the patch
(servops/synth.py) -> audit again with it, until the audit is clean or N rounds pass. A
synthesised patch is proven only when the audit passes with it AND the compiled prefill of the
shrunk model equals the eager one at every captured size (input-token logprobs, within a stated
tolerance); only then is it written to the patch store, and only a proven patch is deployed.
A break that cannot be wrapped (a Python value returned, a data-dependent size) ends the loop
with the release's workaround flag and why.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import engines, patchstore, synth
from .errors import ServopsError
from .patchstore import Patch
from .provenance import operator
from .releases import deploy_root
from .render import MIN_SECRET_CHARS, Launch, server_argv
from .remote_exec import run_program
from .transport import HostSession

SHIM = Path(__file__).resolve().parent / "remote" / "audit_shim.py"
MODEL = "{SERVOPS_AUDIT_MODEL}"
PORT = "{SERVOPS_AUDIT_PORT}"
MEM = "{SERVOPS_AUDIT_MEM}"     # the host sizes it at launch (the GPU's free memory, the shrunk weights)
DEFAULT_ROUNDS = 4
DEFAULT_TOLERANCE = 0.02     # nats: |compiled - eager| input-token logprob, at every captured size
STDLIB_MARKERS = ("/lib/python3", "/importlib/", "<frozen")


class AuditError(ServopsError):
    pass


# ---- what a break record says ---------------------------------------------------------------------

def _top(module: str | None) -> str:
    return (module or "").split(".", 1)[0]


def _site_relative(path: str | None) -> bool:
    return bool(path) and ("site-packages/" in path or "dist-packages/" in path)


def is_engine_frame(frame: dict, packages: tuple[str, ...]) -> bool:
    return _top(frame.get("module")) in packages


def is_library_frame(frame: dict) -> bool:
    """Code of an installed package other than torch (where a custom op can wrap a call)."""
    top = _top(frame.get("module"))
    return top not in ("torch", "functools", "importlib", "subprocess", "threading") and (
        _site_relative(frame.get("file")) or not any(m in (frame.get("file") or "") for m in STDLIB_MARKERS))


CALLEE = re.compile(r"(?:function|builtin) `([^`]+?)\.?`(?: in file `([^`]+)`)?")


def one_line(text: object, limit: int = 300) -> str:
    """A host's text as one line of printable characters (it goes into reports, the journal and the
    synthesised patch's comments, where a newline would start a line of its own)."""
    return "".join(c if c.isprintable() else " " for c in " ".join(str(text).split()))[:limit]


def _reason_line(record: dict) -> str:
    """Dynamo's first line, with the callee it named ("import_module in __init__.py", "posix.stat")."""
    message = str(record.get("message") or "")[:20000]
    first = message.strip().splitlines()[0] if message.strip() else str(record.get("type") or "dynamo break")
    m = CALLEE.search(message)
    callee = f" ({m[1]}{' in ' + m[2].rsplit('/', 1)[-1] if m[2] else ''})" if m else ""
    return one_line(first + callee)


def _callee(record: dict) -> str | None:
    m = CALLEE.search(str(record.get("message") or "")[:20000])
    return m[1] if m else None


def sizes_of(chain: list[dict]) -> list[int]:
    """The captured sizes a break was met at: the hints of the symbolic dims dynamo traced."""
    hints = set()
    for frame in chain[:1]:
        for value in list(frame.get("args") or []) + list((frame.get("kwargs") or {}).values()):
            for d in (value.get("shape") or []) if isinstance(value, dict) else []:
                if isinstance(d, dict) and isinstance(d.get("hint"), int):
                    hints.add(d["hint"])
    return sorted(hints)


def _where(frame: dict) -> str:
    return one_line(f"{frame.get('module')}.{frame.get('qualname')}", 200)


def _frame(frame: dict) -> dict:
    """A chain frame as the shim records one, its parts of the types the analysis reads (the record
    comes from the host: a part of another type is dropped, never a crash of the controller)."""
    out = dict(frame)
    args, kwargs = frame.get("args"), frame.get("kwargs")
    out["args"] = [a for a in args if isinstance(a, dict)] if isinstance(args, list) else []
    out["kwargs"] = {str(k): v for k, v in kwargs.items() if isinstance(v, dict)} if isinstance(kwargs, dict) else {}
    if not isinstance(frame.get("called_from"), dict):
        out.pop("called_from", None)
    for value in out["args"] + list(out["kwargs"].values()):
        shape = value.get("shape")
        if shape is not None and not isinstance(shape, list):
            value["shape"] = []
    return out


def analyse(record: dict, packages: tuple[str, ...]) -> dict:
    """One break record -> reason, frames, the boundary (the last engine frame and the callee it
    enters), the captured size, and the wrap candidates (innermost first)."""
    chain = record.get("chain") if isinstance(record.get("chain"), list) else []
    chain = [_frame(f) for f in chain[:200] if isinstance(f, dict)]
    engine_at = [i for i, f in enumerate(chain) if is_engine_frame(f, packages)]
    callee = _callee(record)
    if engine_at:
        last = chain[engine_at[-1]]
        nxt = chain[engine_at[-1] + 1] if engine_at[-1] + 1 < len(chain) else None
        enters = _where(nxt) if nxt else (callee or "an untraceable builtin")
        boundary = {"engine": _where(last), "enters": enters,
                    "line": (nxt or {}).get("called_from", {}).get("line") if nxt else None}
    else:
        last = chain[-1] if chain else {}
        boundary = {"engine": _where(last) if last else (record.get("root") or {}).get("function"),
                    "enters": callee or "an untraceable builtin", "line": None}
    candidates = []
    for frame in reversed(chain):
        if not is_library_frame(frame) and not is_engine_frame(frame, packages):
            continue
        name = frame.get("qualname") or ""
        if not synth.IDENT.fullmatch(name):  # a method or a closure: no module-level name to rebind
            continue
        kinds = [a.get("kind") for a in list(frame.get("args") or []) + list((frame.get("kwargs") or {}).values())]
        if any(k == "object" for k in kinds):
            continue
        candidates.append(frame)
    return {"reason_type": record.get("type"), "reason_line": _reason_line(record), "chain": chain,
            "frames": [_where(f) for f in chain], "boundary": boundary,
            "boundary_text": f"{boundary['engine']} -> {boundary['enters']}", "sizes": sizes_of(chain),
            "candidates": candidates, "callee": callee}


def distinct(breaks: list[dict]) -> list[dict]:
    """One break per boundary (TP ranks and recompiles repeat it)."""
    seen, out = set(), []
    for b in breaks:
        key = (b["boundary_text"], b["reason_line"])
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out


def covering(brk: dict, store: list[Patch], already: list[str]) -> list[Patch]:
    """Stored patches made for this break's boundary (a synthesised patch wrapping one of its
    candidate functions), not yet in the set."""
    wraps = {f"{f.get('module')}:{f.get('qualname')}" for f in brk["candidates"]}
    return [p for p in store if p.synthesised and p.synthesised.get("wraps") in wraps and p.name not in already
            and p.proven()]


# ---- the audit server's launch -------------------------------------------------------------------------

def flag_name(key: str) -> str:
    """A server arg's key as a flag name: `--tp_size`, `tp-size` -> `tp-size`."""
    return key.lstrip("-").replace("_", "-")


def audit_argv(engine: engines.Engine, launch: Launch, overrides: dict) -> list[str]:
    """The release's launch argv with the audit's overrides (model, port, host, dummy load, memory)
    replacing the variant's own values of those flags."""
    drop = {flag_name(k) for k in overrides}
    # A flag carrying a secret (--api-key) is left out: the audit server is a local child nobody
    # else calls, and a value on its command line is readable by every user of the host (ps).
    secrets = {v for v in launch.secret_env.values() if len(v) >= MIN_SECRET_CHARS}
    args = {k: v for k, v in launch.args.items()
            if flag_name(k) not in drop and not (isinstance(v, (str, int, float)) and str(v) in secrets)}
    args.update(overrides)
    return server_argv(args)


def audit_launch(hs: HostSession, engine: engines.Engine, launch: Launch, *, eager: dict | None = None) -> dict:
    """The audit server's launch: the release's own, with the audit's overrides (and, for the eager
    reference, the release's flags that turn the prefill graph off)."""
    overrides = engine.audit_args(MODEL, PORT, MEM)
    overrides.update(eager or {})
    return {"module": engine.server_module(hs.host), "argv": audit_argv(engine, launch, overrides),
            "mem_of": engine.audit_mem_of,
            "env": dict(launch.env, **launch.secret_env), "health": engine.health.get("endpoint", "/health")}


def server_files(hs: HostSession, variant: dict, launch: Launch) -> dict[str, str]:
    """Files the host's launch runs beside its script (the lab's SGLang double), as deploy ships them."""
    from .deploystages import launch_files
    return {name: spec["text"] for name, spec in launch_files(hs.host, variant, launch).items()
            if name not in ("launch.sh", "secrets.env")}


@dataclass
class Round:
    number: int
    state: str                     # healthy | exited | broke | timeout | not-audited
    breaks: list[dict] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    detail: str = ""
    captured: list[int] = field(default_factory=list)


def run_audit(hs: HostSession, launch: dict, patches: list[Patch], *, variant: str, files: dict[str, str],
              round_no: int, compare: dict | None = None, timeout: int = 1800, packages: tuple[str, ...] = (),
              reuse: bool = False) -> dict:
    device = str(hs.host.get("audit_device") or "cuda")
    tp = int(hs.host.get("tp") or 1)
    args = {"op": "audit", "launch": launch, "model_path": str(hs.host.get("model_path") or ""),
            "patches": [p.remote_spec() for p in patches], "shim": SHIM.read_text(),
            "server_files": files, "device": device, "gpus_needed": tp,
            "mem_fraction": float(hs.host.get("audit_mem_fraction") or 0.05),
            "overhead_mib": int(hs.host.get("audit_overhead_mib") or 3072),
            "timeout_s": int(hs.host.get("audit_timeout") or 900), "compare": compare,
            "journal": f"{deploy_root(hs.host)}/journal.jsonl",
            # every round's verdict is kept by what decides it (servops/remote/audit_verdicts.py)
            "verdicts": f"{deploy_root(hs.host)}/audit-verdicts.json", "reuse": reuse, "packages": list(packages),
            "journal_entry": {"action": "audit", "who": operator(), "variant": variant, "round": round_no,
                              "patches": [p.name for p in patches]}}
    return run_program(hs, "audit_compile", args, timeout=timeout)


def probe_request(frame: dict, captured: list[int]) -> dict:
    """Cases for the probe: the sizes seen at capture, other captured sizes for the symbolic dims,
    and each static dim value doubled on its own (which input dims an output follows)."""
    values = list(frame.get("args") or []) + list((frame.get("kwargs") or {}).values())
    symbols: dict[str, int] = {}
    statics: list[int] = []
    for v in values:
        for d in (v.get("shape") or []) if v.get("kind") == "tensor" else []:
            if isinstance(d, dict) and isinstance(d.get("hint"), int) and isinstance(d.get("sym"), str):
                symbols.setdefault(d["sym"], int(d["hint"]))
            elif isinstance(d, int) and d > 1 and d not in statics:
                statics.append(d)
    base = dict(symbols)
    cases = [{"sizes": base}]
    others = [s for s in sorted(set(captured)) if s not in base.values()] or [max(base.values() or [4]) * 2]
    picks = sorted({others[0], others[len(others) // 2], others[-1]})[:3]
    for size in picks:
        cases.append({"sizes": {k: size for k in symbols}})
    for value in statics[:6]:
        cases.append({"sizes": base, "scale": {str(value): value * 2}})
    return {"module": frame["module"], "qualname": frame["qualname"], "args": frame.get("args") or [],
            "kwargs": frame.get("kwargs") or {}, "cases": cases}


def run_probe(hs: HostSession, request: dict, patches: list[Patch], env: dict) -> dict:
    return run_program(hs, "audit_compile", {"op": "probe", "request": request, "shim": SHIM.read_text(),
                                             "patches": [p.remote_spec() for p in patches], "env": env,
                                             "timeout_s": int(hs.host.get("audit_timeout") or 600)},
                       timeout=int(hs.host.get("audit_timeout") or 600) + 60)


def candidate_patch(s: synth.Synthesis, where: Path) -> Patch:
    """A synthesised patch as a Patch (written under `where`, not yet in the store)."""
    dist_dir = where / s.distribution
    dist_dir.mkdir(parents=True, exist_ok=True)
    (dist_dir / f"{s.name}.patch").write_text(s.text)
    (dist_dir / f"{s.name}.yml").write_text(yaml.safe_dump(s.meta, sort_keys=False, width=100))
    return patchstore.load_patch(dist_dir / f"{s.name}.patch")


def compare_logprobs(compiled: dict, eager: dict, tolerance: float) -> dict:
    """Per captured size: max |compiled - eager| over the prompt's input-token logprobs."""
    rows, worst = [], 0.0
    for size in sorted(compiled, key=int):
        a, b = compiled.get(size), eager.get(size)
        if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
            rows.append({"size": int(size), "ok": False, "why": f"compiled {_what(a)}, eager {_what(b)}"})
            continue
        diffs = [abs(x - y) for x, y in zip(a, b) if isinstance(x, (int, float)) and isinstance(y, (int, float))]
        spread = max((abs(x) for x in b if isinstance(x, (int, float))), default=0.0)
        d = max(diffs, default=0.0)
        worst = max(worst, d)
        rows.append({"size": int(size), "ok": bool(diffs) and d <= tolerance, "max_abs_diff": d, "spread": spread,
                     "why": "" if diffs else "no logprobs"})
    return {"sizes": rows, "max_abs_diff": worst, "tolerance": tolerance,
            "ok": bool(rows) and all(r["ok"] for r in rows)}


def _lines(value) -> list:
    return value if isinstance(value, list) else []


def why_it_ended(log_tail) -> str:
    """What the end of an audit server's log says it died of: the root error diagnose would show
    (sglang's scheduler traceback, not the "Received sigquit" and kill_process_tree lines that
    close every such log), else its last lines."""
    from .diagnose import shows_a_cause
    from .remote.tracebacks import scan

    lines = [str(x) for x in _lines(log_tail)]
    cause = next((f for f in scan("\n".join(lines)).get("findings") or [] if shows_a_cause(f)), None)
    if cause:
        return one_line(cause["root_exception"], 1000)
    return " | ".join(map(one_line, lines[-3:]))


def _what(value) -> str:
    if isinstance(value, list):
        return f"{len(value)} logprobs"
    if isinstance(value, dict):
        return str(value.get("error"))[:200]
    return "nothing"


@dataclass
class Outcome:
    verdict: str          # clean | fixed | uncovered | cannot-fix | not-audited | failed | rounds-exhausted
    rounds: list[Round] = field(default_factory=list)
    added: list[Patch] = field(default_factory=list)       # stored or synthesised patches the set needs
    written: list[str] = field(default_factory=list)       # synthesised patches proven and stored
    why: str = ""
    workaround: str = ""
    uncovered: list[dict] = field(default_factory=list)


def _seconds(value) -> float:
    """A host's elapsed seconds (0 for anything that is not a finite non-negative number)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9
    return float(value) if ok else 0.0


def _sizes(value) -> list[int]:
    """The captured sizes a host reported: whole positive numbers only, each once, in order."""
    items = value if isinstance(value, list) else []
    return sorted({v for v in items if isinstance(v, int) and not isinstance(v, bool) and v > 0})


def record_breaks(res: dict, packages: tuple[str, ...]) -> list[dict]:
    return distinct([analyse(r, packages) for r in res.get("breaks") or [] if isinstance(r, dict) and "chain" in r])


# ---- the loop -----------------------------------------------------------------------------------------

@dataclass
class Plan:
    """What one host's audit runs: the launch (rendered), the fix set, the engine and its version."""
    hs: HostSession
    variant: str
    resolved: dict                 # the variant as the host's rules resolved it
    engine: engines.Engine
    launch: Launch
    fix_set: list[Patch]
    version: str | None
    reuse: bool = False            # a round whose launch, set and installation were audited before
                                   # takes that verdict (deploy's stage); the verb runs every round


def synthesise_for(plan: Plan, brk: dict, patches: list[Patch], captured: list[int], audit_id: str,
                   say) -> tuple[synth.Synthesis | None, list[str]]:
    """Probe the break's candidates, innermost first, until one can be wrapped."""
    reasons = []
    env = dict(plan.launch.env, **plan.launch.secret_env)
    for frame in brk["candidates"]:
        where = f"{frame['module']}.{frame['qualname']}"
        try:
            probe = run_probe(plan.hs, probe_request(frame, captured), patches, env)
        except ServopsError as exc:
            reasons.append(f"{where}: the probe failed: {exc}")
            continue
        if probe.get("error") or not probe.get("rel") or not probe.get("dist"):
            reasons.append(f"{where}: " + (probe.get("error") or "its file is not part of an installed distribution"))
            continue
        try:
            s = synth.synthesise(brk, frame, probe, audit_id)
        except synth.CannotWrap as exc:
            reasons.append(f"{where}: {exc}")
            say(f"cannot wrap {where}: {exc}")
            continue
        return s, reasons
    return None, reasons


def audit_and_fix(plan: Plan, *, fix: bool, rounds: int = DEFAULT_ROUNDS, tolerance: float = DEFAULT_TOLERANCE,
                  store: list[Patch] | None = None, work: Path, say=lambda line: None) -> Outcome:
    """Audit; with `fix`, synthesise and prove patches for uncovered breaks, round after round."""
    store = patchstore.all_patches() if store is None else store
    # the engine's code: its packages, and the modules the host's launch ships beside it (the lab's double)
    packages = plan.engine.packages + (str(plan.engine.server_module(plan.hs.host)).split(".")[0],) + tuple(
        Path(f).stem for f in plan.engine.server_files(plan.hs.host))
    audit_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{plan.hs.host.name}"
    added: list[Patch] = []
    unproven: list[Patch] = []
    outcome = Outcome(verdict="rounds-exhausted")
    launch = audit_launch(plan.hs, plan.engine, plan.launch)
    files = server_files(plan.hs, plan.resolved, plan.launch)
    compare = {"context_length": plan.launch.args.get("context-length") or plan.launch.args.get("max-model-len")}
    for number in range(1, rounds + 1):
        patches = plan.fix_set + added
        res = run_audit(plan.hs, launch, patches, variant=plan.variant, files=files, round_no=number,
                        packages=packages, reuse=plan.reuse,
                        compare=dict(compare, lengths="captured") if unproven else None)
        rnd = Round(number, one_line(res.get("state", "?"), 40), patches=[p.name for p in patches],
                    elapsed_s=_seconds(res.get("elapsed_s")), captured=_sizes(res.get("captured")))
        outcome.rounds.append(rnd)
        if res.get("journal_problem"):
            say(f"round {number}: warning: {one_line(res['journal_problem'], 300)}")
        if isinstance(res.get("kept"), dict):
            say(f"round {number}: the same launch, fix set and installation were audited at "
                f"{one_line(res['kept'].get('at'), 40)} ({_seconds(res['kept'].get('elapsed_s')):.0f} s): "
                f"its verdict stands, no audit server started")
        if rnd.state == "not-audited":
            outcome.verdict, outcome.why = "not-audited", one_line(res.get("why"), 1500)
            rnd.detail = outcome.why
            say(f"round {number}: not audited: {outcome.why}")
            return outcome
        rnd.breaks = record_breaks(res, packages)
        if not rnd.breaks:
            if rnd.state != "healthy":
                outcome.verdict = "failed"
                outcome.why = (f"the audit server ended {rnd.state} (exit {res.get('exit_code')}) without a dynamo "
                               f"break: " + why_it_ended(res.get("log_tail")))[:1500]
                rnd.detail = outcome.why
                say(f"round {number}: {outcome.why}")
                return outcome
            rnd.detail = f"clean: {len(rnd.captured)} prefill size(s) compiled and captured"
            say(f"round {number}: {rnd.detail} ({rnd.elapsed_s:.0f} s)")
            if unproven:
                if not prove(plan, files, compare, patches, unproven, res, tolerance, outcome, say):
                    return outcome
                outcome.written = write_to_store(unproven)
            outcome.verdict = "fixed" if added else "clean"
            outcome.added = added
            return outcome
        say(f"round {number}: {len(rnd.breaks)} break(s) ({rnd.elapsed_s:.0f} s)")
        for brk in rnd.breaks:
            at = f" at {brk['sizes']} tokens" if brk["sizes"] else ""
            say(f"  break{at}: {brk['reason_line']}")
            say(f"    boundary: {brk['boundary_text']}")
            stored = covering(brk, store, [p.name for p in patches])
            if stored:
                added += stored[:1]
                say(f"    covered by the stored patch {stored[0].name}")
                continue
            if not fix:
                outcome.verdict = "uncovered"
                outcome.uncovered.append(brk)
                continue
            s, reasons = synthesise_for(plan, brk, patches, rnd.captured, audit_id, say)
            if s is None:
                outcome.verdict, outcome.uncovered = "cannot-fix", [brk]
                outcome.why = "; ".join(reasons) or "no frame of the break's chain is a function servops can wrap"
                outcome.workaround = plan.engine.workaround(plan.version)
                return outcome
            patch = candidate_patch(s, work)
            added.append(patch)
            unproven.append(patch)
            say(f"    synthesised {s.name}: {s.meta['synthesised']['wraps']} as {s.op} {s.schema}")
        if outcome.verdict == "uncovered":
            outcome.why = "; ".join(f"{b['reason_line']} at {b['boundary_text']}" for b in outcome.uncovered)
            outcome.workaround = plan.engine.workaround(plan.version)
            return outcome
    outcome.why = f"breaks remain after {rounds} rounds"
    outcome.workaround = plan.engine.workaround(plan.version)
    return outcome


def prove(plan: Plan, files: dict[str, str], compare: dict, patches: list[Patch], unproven: list[Patch], res: dict,
          tolerance: float, outcome: Outcome, say) -> bool:
    """The compiled prefill equals the eager one at every captured size: the eager reference is
    the same audit server with the prefill graph off."""
    compiled = res.get("logprobs")
    if isinstance(compiled, dict):  # keyed by the sizes as text; any other key is not a size
        compiled = {str(k): v for k, v in compiled.items() if str(k).isdigit() and len(str(k)) <= 9}
    if not isinstance(compiled, dict) or not compiled:
        outcome.verdict = "failed"
        outcome.why = ("the audit passed with the synthesised patches, but the engine gave no prefill logprobs to "
                       f"compare ({plan.engine.name}): not proven, nothing deployed")
        say(outcome.why)
        return False
    eager_flags = plan.engine.eager_prefill_args(plan.version)
    eager_launch = audit_launch(plan.hs, plan.engine, plan.launch, eager=eager_flags)
    reference = [p for p in patches if p not in unproven]  # the functions as they were, run eagerly
    ref = run_audit(plan.hs, eager_launch, reference, variant=plan.variant, files=files,
                    round_no=len(outcome.rounds), compare=dict(compare, lengths=sorted(int(k) for k in compiled)))
    eager = ref.get("logprobs") if ref.get("state") == "healthy" else None
    if not isinstance(eager, dict):
        outcome.verdict = "failed"
        outcome.why = (f"the eager reference server ended {ref.get('state')}: not proven, nothing deployed; "
                       + why_it_ended(ref.get("log_tail")))[:1500]
        say(outcome.why)
        return False
    result = compare_logprobs(compiled, eager, tolerance)
    bad = [r for r in result["sizes"] if not r["ok"]]
    skipped = list(res.get("compare_skipped") or [])
    say(f"proof: compiled vs eager prefill at {len(result['sizes'])} size(s): max |logprob diff| "
        f"{result['max_abs_diff']:.3g} (tolerance {tolerance})" + (f"; {len(bad)} size(s) differ" if bad else "")
        + (f"; sizes past the context not compared: {skipped}" if skipped else ""))
    for p in unproven:
        meta = dict(p.synthesised or {})
        meta["proven"] = {"audit_rounds": len(outcome.rounds), "captured_sizes": sorted(int(k) for k in compiled),
                          "max_abs_logprob_diff": result["max_abs_diff"], "tolerance": tolerance,
                          "not_compared": skipped,
                          "eager_reference": " ".join(f"--{k}" + ("" if v is True else f" {v}")
                                                      for k, v in eager_flags.items() if v is not None),
                          "ok": result["ok"]}
        p.synthesised = meta
    if not result["ok"]:
        outcome.verdict = "failed"
        outcome.why = "the compiled prefill differs from the eager one: " + ", ".join(
            f"{r['size']} tokens ({r.get('max_abs_diff', r.get('why'))})" for r in bad[:8])
        return False
    return True


def write_to_store(patches: list[Patch], root: Path | None = None) -> list[str]:
    """Proven synthesised patches into the patch store (patches/<dist>/): servops' cache of fixes."""
    root = root or patchstore.PATCH_ROOT
    names = []
    for p in patches:
        dest = root / p.distribution
        dest.mkdir(parents=True, exist_ok=True)
        meta = yaml.safe_load(p.path.with_suffix(".yml").read_text())
        meta["synthesised"] = p.synthesised
        # metadata first, each file whole by rename: a deploy reading the store meanwhile (another
        # audit's, racing) sees the old patch or the new one, never a half-written file
        _write_whole(dest / f"{p.name}.yml", yaml.safe_dump(meta, sort_keys=False, width=100))
        _write_whole(dest / f"{p.name}.patch", p.text)
        p.path = dest / f"{p.name}.patch"
        names.append(p.name)
    return names


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def describe(outcome: Outcome) -> str:
    n = len(outcome.rounds)
    return {"clean": f"clean after {n} round(s)",
            "fixed": f"fixed in {n} round(s): " + ", ".join(p.name for p in outcome.added),
            "uncovered": f"{len(outcome.uncovered)} break(s) no stored patch covers",
            "cannot-fix": "a break servops cannot wrap",
            "not-audited": "not audited",
            "failed": "failed",
            "rounds-exhausted": f"breaks remain after {n} round(s)"}.get(outcome.verdict, outcome.verdict)


def outcome_json(outcome: Outcome) -> dict:
    return {"verdict": outcome.verdict, "why": outcome.why, "workaround": outcome.workaround,
            "added": [p.name for p in outcome.added], "written": outcome.written,
            "rounds": [{"round": r.number, "state": r.state, "patches": r.patches, "elapsed_s": r.elapsed_s,
                        "captured": r.captured, "detail": r.detail,
                        "breaks": [{k: b[k] for k in ("reason_line", "boundary_text", "frames", "sizes")} for b in r.breaks]}
                       for r in outcome.rounds]}


def dump(outcome: Outcome, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(outcome_json(outcome), indent=1))


__all__ = ["Plan", "Outcome", "audit_and_fix", "analyse", "covering", "describe"]
