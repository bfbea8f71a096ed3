"""`invoke tune CAMPAIGN -H HOST`: the optimisation campaign, unattended and resumable.

Each trial: deploy (launch preflight, patches, health gate, auto-rollback) -> bench -> record.
A crash is diagnosed; when its known issue names a patch and `auto_patch` is on, the trial is
retried once with that patch. A trial whose launch script and patch set equal a finished
trial's is not run again. The base is re-benched at the end of a long campaign (drift).

Every phase is written, before and after, to `results/<host>/campaigns/<name>/trials.jsonl`
here AND to the host's journal. `--resume` reads the local log: finished trials are not
repeated; the interrupted one is finished (its release is current and healthy: bench it) or
run again (the deploy it was in was rolled back, by the controller or the host's guard).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import bench, interrupt, localfiles, releases
from .campaign import Campaign, Trial, _layer
from .deploy import deploy_group, preflight
from .errors import ServopsError
from .output import console
from .provenance import git_sha, operator
from .redact import variant_secrets
from .render import render_launch
from .transport import HostSession


class TuneError(ServopsError):
    pass


def campaign_dir(host: str, name: str) -> Path:
    return bench.RESULTS_ROOT / host / "campaigns" / name


def log_path(host: str, name: str) -> Path:
    return campaign_dir(host, name) / "trials.jsonl"


def read_log(path: Path) -> list[dict]:
    entries = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a line cut by a kill mid-write
            if isinstance(entry, dict):  # a hand-edited or damaged line is skipped, not a traceback
                entries.append(entry)
    return entries


@dataclass
class TrialState:
    """What the log says about one trial."""
    id: str
    entries: list[dict] = field(default_factory=list)

    @property
    def done(self) -> dict | None:
        return next((e for e in reversed(self.entries) if e["phase"] == "done"), None)

    def last(self, phase: str) -> dict | None:
        return next((e for e in reversed(self.entries) if e["phase"] == phase), None)


def trial_states(entries: list[dict]) -> dict[str, TrialState]:
    states: dict[str, TrialState] = {}
    for e in entries:
        if "trial" in e:
            states.setdefault(e["trial"], TrialState(e["trial"])).entries.append(e)
    return states


class Journal:
    """Appends to the local trials.jsonl and the host's journal, each phase before and after."""

    def __init__(self, hs: HostSession, camp: Campaign, path: Path):
        self.hs, self.camp, self.path = hs, camp, path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, entry: dict) -> dict:
        entry = dict(entry, at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), campaign=self.camp.name)
        line = self.hs.redactor(json.dumps(entry, sort_keys=True))
        localfiles.append_text(self.path, line + "\n")
        host_entry = {"action": "tune." + entry["phase"], "who": operator(), "campaign": self.camp.name,
                      "trial": entry.get("trial"), "release": entry.get("release"), "outcome": entry.get("outcome"),
                      "detail": entry.get("label") or entry.get("reason")}
        try:
            releases.ctl(self.hs, "journal", entry={k: self.hs.redactor(v) if isinstance(v, str) else v
                                                    for k, v in host_entry.items() if v is not None})
        except ServopsError:
            pass  # the local log is the source of truth for --resume; the host's is the audit
        return entry


class Clock:
    """Elapsed time, the measured cost of a restart and of a bench, and the ETA they give."""

    def __init__(self, prior: list[dict]):
        self.started = time.monotonic()
        self.prior_s = sum(e.get("seconds", 0.0) for e in prior if e.get("phase") == "done")
        self.deploys = [e["deploy_s"] for e in prior if e.get("phase") == "done" and e.get("deploy_s")]
        self.benches = [e["bench_s"] for e in prior if e.get("phase") == "done" and e.get("bench_s")]

    def elapsed(self) -> float:
        return self.prior_s + time.monotonic() - self.started

    def eta(self, remaining: int) -> float | None:
        if not self.deploys:
            return None
        per = sum(self.deploys) / len(self.deploys) + (sum(self.benches) / len(self.benches) if self.benches else 0.0)
        return per * remaining


def _clock(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def evaluate(camp: Campaign, result: dict, base_result: dict | None) -> dict:
    """Feasibility (constraints, failures included) and the objective's value, for one bench."""
    from .gate import evaluate as gate_evaluate

    lookup = lambda name: base_result if name == "base" else None  # noqa: E731
    try:
        passed, lines = gate_evaluate(camp.constraints, result, lookup)
    except ServopsError as exc:
        passed, lines = False, [f"FAIL: {exc}"]
    value = camp.objective.value(result)
    return {"feasible": bool(passed and value is not None), "objective": value,
            "constraints": lines, "violations": [l for l in lines if l.startswith("FAIL")]}


def key_metrics(result: dict) -> dict:
    """Per level: the numbers the report shows (with 95% intervals when repeated)."""
    keep = ("output_tps", "request_rate", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99",
            "e2e_p50", "e2e_p99", "goodput", "error_rate", "completed", "failed")
    out = {}
    for lv in result.get("levels", []):
        row = {k: lv.get(k) for k in keep if lv.get(k) is not None}
        for k in ("output_tps", "ttft_p99"):
            ci = (lv.get("ci") or {}).get(k)
            if ci:
                row[f"{k}_ci"] = ci
        out[str(lv["concurrency"])] = row
    return out


def diagnose_release(hs: HostSession, release: str) -> list[dict]:
    """The failed release's findings, each with its best known-issue match."""
    from . import diagnose as dg

    res = dg.diagnose(hs, release)
    issues = dg.known_issues()
    out = []
    for f in res["scan"]["findings"]:
        hits = dg.match(f, issues)
        top = hits[0] if hits else None
        out.append({"entry": top and top["id"], "category": top and top["category"],
                    "title": top and top["title"], "suggest": (top or {}).get("suggest") or {},
                    "root_exception": hs.redactor(str(f.get("root_exception") or "")),
                    "final_exception": hs.redactor(str(f.get("final_exception") or "")),
                    "ranks": f.get("ranks") or []})
    return out


def bench_kwargs(camp: Campaign) -> dict:
    b = camp.bench
    dataset = bench.load_dataset(b.get("dataset", "random"), b.get("dataset_path", ""), b.get("seed", 42))
    kwargs = {"requests": b.get("requests", 0), "input_len": b.get("input_len", 128), "output_len": b.get("output_len", 128),
              "dataset": dataset, "repeat": b.get("repeat", 1), "warmup": b.get("warmup", 1), "seed": b.get("seed", 42),
              "range_ratio": b.get("range_ratio", 1.0), "request_rate": b.get("request_rate")}
    if b.get("slo"):
        kwargs["slo"] = bench.parse_slo(b["slo"])
    return kwargs


class Runner:
    def __init__(self, hs: HostSession, camp: Campaign, resume: bool):
        self.hs, self.camp = hs, camp
        self.path = log_path(hs.host.name, camp.name)
        prior = read_log(self.path)
        if prior and not resume:
            raise TuneError(f"{self.path} already holds {len(prior)} entries of campaign {camp.name}: continue with "
                            f"--resume, or start over with --restart")
        self.prior = prior
        self.states = trial_states(prior)
        self.journal = Journal(hs, camp, self.path)
        self.clock = Clock(prior)
        self.kwargs = bench_kwargs(camp)
        self.trials: list[Trial] = list(camp.trials)
        # Every trial's secrets (a candidate's HF_TOKEN, --api-key) are masked from the first
        # journal entry on: the trials.jsonl, the host's journal and the report never hold them.
        for t in self.trials:
            hs.redactor.add(variant_secrets(t.variant, hs.host.get("secret_vars") or ()))
        self.identities: dict[str, str] = {}
        self.scripts: dict[str, str] = {}

    # -- up front: every candidate passes the launch preflight before the first restart --------

    def preflight_all(self) -> None:
        console.print(f"tune {self.camp.name}: {len(self.trials)} trial(s); launch preflight of every candidate "
                      f"on {self.hs.host.name}", markup=False)
        for t in self.trials:
            self._check(t)

    def _check(self, t: Trial) -> None:
        try:
            _resolved, launch, _check = preflight(self.hs, t.variant)
        except ServopsError as exc:
            raise TuneError(f"{self.camp.path}: trial {t.id} ({t.label}): {exc}") from None
        self.hs.redactor.add(launch.secret_env.values())  # as rendered (a value may be a template)
        self.identities[t.id] = t.identity(self.hs.host, render_launch)
        self.scripts[t.id] = launch.script

    def plan(self) -> list[dict]:
        """Check mode: every trial preflighted and deduplicated; nothing deployed or benched."""
        self.preflight_all()
        finished = {tid for tid, st in self.states.items() if st.done}
        first: dict[str, str] = {}
        rows = []
        for t in self.trials:
            ident = self.identities[t.id]
            twin = first.setdefault(ident, t.id)
            state = "done" if t.id in finished else ("duplicate of " + twin if twin != t.id else "would run")
            rows.append({"trial": t.id, "label": t.label, "state": state, "patches": ", ".join(t.variant["patches"]) or "-"})
        return rows

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> dict:
        if not self.prior:
            self.journal.write({"phase": "campaign", "outcome": "started", "servops_git": git_sha(),
                                "trials": [{"trial": t.id, "label": t.label} for t in self.trials],
                                "objective": self.camp.objective.written})
        self.preflight_all()
        executed = sum(1 for s in self.states.values() if s.done and s.done.get("outcome") != "duplicate")
        i = 0
        while i < len(self.trials):
            t = self.trials[i]
            i += 1
            state = self.states.get(t.id)
            if state and state.done:
                self._maybe_queue_retry(t, state.done)
                continue
            if self.camp.max_trials is not None and executed >= self.camp.max_trials:
                console.print(f"tune: budget: {executed} trials run (max_trials {self.camp.max_trials}); stopping",
                              markup=False)
                break
            if self.camp.max_wall_s is not None and self.clock.elapsed() >= self.camp.max_wall_s:
                console.print(f"tune: budget: {_clock(self.clock.elapsed())} spent (max_wall_time); stopping", markup=False)
                break
            twin = self._finished_twin(t)
            if twin:
                self.journal.write({"trial": t.id, "phase": "done", "label": t.label, "outcome": "duplicate",
                                    "same_as": twin, "identity": self.identities.get(t.id)})
                console.print(f"tune: {t.id}: same launch script and patches as {twin}; not run again", markup=False)
                continue
            done = self.run_trial(t, i, state)
            executed += 1
            self._maybe_queue_retry(t, done)
            if interrupt.requested():
                raise TuneError(f"interrupted after trial {t.id}; continue with invoke tune {self.camp.name} "
                                f"-H {self.hs.host.name} --resume")
        return self.finish()

    def _finished_twin(self, t: Trial) -> str | None:
        ident = self.identities.get(t.id)
        for other_id, s in trial_states(read_log(self.path)).items():
            d = s.done
            if d and other_id != t.id and d.get("identity") == ident and d.get("outcome") != "duplicate":
                return other_id
        return None

    def _maybe_queue_retry(self, t: Trial, done: dict) -> None:
        """auto_patch: a crash whose known issue names a patch the trial lacks -> one retry with it."""
        patch = done.get("retry_patch")
        if not (self.camp.auto_patch and patch and not t.retry_of):
            return
        rid = f"{t.id}-with-{patch}"
        if any(x.id == rid for x in self.trials):
            return
        retry = Trial(rid, f"{t.label} + patch {patch}",
                      _layer(t.variant, {"patches": [patch]}, f"{self.camp.name}-{rid}",
                             f"campaigns/{self.camp.name}.yml trial {rid}"),
                      dict(t.overrides, patches=list(t.overrides.get("patches") or []) + [patch]), retry_of=t.id)
        self._check(retry)
        self.trials.insert(self.trials.index(t) + 1, retry)

    def _progress(self, t: Trial, k: int, phase: str) -> None:
        remaining = max(0, len(self.trials) - k + 1)
        best = self.best()
        best_text = (f"best so far: {best['trial']} {self.camp.objective.written} = {best['objective']:.4g}"
                     if best else "no feasible trial yet")
        console.print(f"tune  trial {k}/{len(self.trials)} {t.id}  {phase:<8} elapsed {_clock(self.clock.elapsed())}"
                      f"  ETA {_clock(self.clock.eta(remaining))}  {best_text}", markup=False, highlight=False)

    def run_trial(self, t: Trial, k: int, state: TrialState | None) -> dict:
        t0 = time.monotonic()
        base = {"trial": t.id, "label": t.label, "identity": self.identities.get(t.id)}
        resumed = self._resumable(state)
        if resumed:
            console.print(f"tune: {t.id} was interrupted after a healthy deploy of {resumed['release']}: "
                          f"finishing it (bench)", markup=False)
            record, deploy_s = resumed, resumed.get("deploy_s", 0.0)
        else:
            if state:
                console.print(f"tune: {t.id} was interrupted; running it again", markup=False)
            self.journal.write(dict(base, phase="start", spec={"variant": t.variant["name"], "overrides": t.overrides,
                                                             "retry_of": t.retry_of,
                                                             "server_args": t.variant["server_args"],
                                                             "env": self.hs.redactor(json.dumps(t.variant["env"])),
                                                             "patches": t.variant["patches"]},
                                    script=self.hs.redactor(self.scripts.get(t.id, ""))))
            self._progress(t, k, "deploy")
            record: dict = {}
            d0 = time.monotonic()
            try:
                deploy_group([self.hs], t.variant, record=record)
            except ServopsError as exc:
                record.update(state="failed", reason=str(exc))
            if interrupt.requested():  # Ctrl-C in the deploy: it rolled back; the trial is not done
                raise TuneError(f"interrupted in trial {t.id} ({record.get('reason')}); continue with "
                                f"invoke tune {self.camp.name} -H {self.hs.host.name} --resume")
            deploy_s = time.monotonic() - d0
            self.journal.write(dict(base, phase="deployed", release=record.get("release"), outcome=record.get("state"),
                                    reason=record.get("reason"), deploy_s=round(deploy_s, 2)))
        done = dict(base, phase="done", release=record.get("release"), deploy_s=round(deploy_s, 2))
        if record.get("state") == "healthy":
            self._progress(t, k, "bench")
            b0 = time.monotonic()
            try:
                result = bench.run_bench(self.hs, self.camp.bench["levels"], **self.kwargs)
            except ServopsError as exc:
                result = None
                done.update(outcome="bench-failed", reason=str(exc))
            bench_s = time.monotonic() - b0
            if result is not None:
                ev = evaluate(self.camp, result, self._base_result())
                done.update(outcome="ok" if ev["feasible"] else "infeasible", result_path=result["path"],
                            metrics=key_metrics(result), bench_s=round(bench_s, 2), **ev)
                self.journal.write(dict(base, phase="benched", release=record.get("release"),
                                        result_path=result["path"], bench_s=round(bench_s, 2)))
        else:
            findings = []
            if record.get("release"):
                self._progress(t, k, "diagnose")
                try:
                    findings = diagnose_release(self.hs, record["release"])
                except ServopsError as exc:
                    findings = [{"error": str(exc)}]
            done.update(outcome="crashed" if record.get("state") in ("crashed", "timeout") else record.get("state") or "failed",
                        reason=record.get("reason"), findings=findings)
            self.journal.write(dict(base, phase="diagnosed", release=record.get("release"), findings=findings))
            patch = next((f["suggest"].get("patch") for f in findings if (f.get("suggest") or {}).get("patch")), None)
            if patch and patch not in t.variant["patches"]:
                done["retry_patch"] = patch
        done["seconds"] = round(time.monotonic() - t0, 2)
        entry = self.journal.write(done)
        verdict = {"ok": "feasible", "infeasible": "violates: " + "; ".join(done.get("violations") or [])}.get(
            done["outcome"], f"{done['outcome']}: {done.get('reason') or ''}")
        value = done.get("objective")
        console.print(f"tune: {t.id}: {verdict}" + (f"; {self.camp.objective.written} = {value:.4g}" if value is not None
                                                    else ""), markup=False, highlight=False)
        return entry

    def _resumable(self, state: TrialState | None) -> dict | None:
        """An interrupted trial whose healthy release is still current: bench it instead of redeploying."""
        if not state or state.done:
            return None
        deployed = state.last("deployed")
        if not deployed or deployed.get("outcome") != "healthy":
            return None
        st = releases.ctl(self.hs, "status")
        rel = st.get("release") or {}
        if st.get("current") == deployed.get("release") and st.get("healthy") and rel.get("status") in ("healthy", "unconfirmed"):
            return {"release": deployed["release"], "state": "healthy", "deploy_s": deployed.get("deploy_s")}
        return None

    # -- results -----------------------------------------------------------------------------------

    def done_entries(self) -> list[dict]:
        return [s.done for s in trial_states(read_log(self.path)).values() if s.done]

    def _base_result(self) -> dict | None:
        d = next((e for e in self.done_entries() if e["trial"] == "base" and e.get("result_path")), None)
        return bench.load_result(Path(d["result_path"])) if d else None

    def best(self) -> dict | None:
        best = None
        for e in self.done_entries():
            if e.get("outcome") != "ok" or e.get("objective") is None or e["trial"].startswith("drift"):
                continue
            if best is None or self.camp.objective.better(e["objective"], best["objective"]):
                best = e
        return best

    def finish(self) -> dict:
        entries = read_log(self.path)
        summary = {"campaign": self.camp.name, "host": self.hs.host.name}
        if not any(e.get("phase") == "drift" for e in entries):
            self._drift_check()
        winner = self.best()
        summary["winner"] = winner and winner["trial"]
        if not any(e.get("phase") == "leave" for e in entries):
            self._leave(winner)
        summary["log"] = str(self.path)
        return summary

    def _drift_check(self) -> None:
        after = self.camp.drift_after_s
        base = next((e for e in self.done_entries() if e["trial"] == "base" and e.get("result_path")), None)
        if after is None or base is None or self.clock.elapsed() < after:
            return
        console.print(f"tune: the campaign ran {_clock(self.clock.elapsed())} (> drift_check_after): re-benching the base",
                      markup=False)
        record: dict = {}
        deploy_group([self.hs], self.camp.trials[0].variant, record=record)
        if record.get("state") != "healthy":
            self.journal.write({"phase": "drift", "outcome": "base unhealthy", "reason": record.get("reason")})
            return
        result = bench.run_bench(self.hs, self.camp.bench["levels"], **self.kwargs)
        before, now = base.get("objective"), self.camp.objective.value(result)
        drift = None if not before or now is None else (now - before) / before * 100.0
        self.journal.write({"phase": "drift", "outcome": "measured", "release": record.get("release"),
                            "result_path": result["path"], "before": before, "after": now,
                            "drift_pct": None if drift is None else round(drift, 2), "metrics": key_metrics(result)})
        console.print(f"tune: base drifted {drift:+.1f}% on {self.camp.objective.written}" if drift is not None
                      else "tune: base drift not measurable", markup=False)

    def _leave(self, winner: dict | None) -> None:
        want = "base" if self.camp.leave == "base" or winner is None else winner["trial"]
        trial = next((t for t in self.trials if t.id == want), self.camp.trials[0])
        status = releases.ctl(self.hs, "status")
        rel = status.get("release") or {}
        if rel.get("variant") == trial.variant["name"] and status.get("healthy"):
            self.journal.write({"phase": "leave", "trial": None, "outcome": "kept", "release": status.get("current"),
                                "label": f"{want} already deployed"})
            console.print(f"tune: leaving {want} deployed ({status.get('current')})", markup=False)
            return
        record: dict = {}
        deploy_group([self.hs], trial.variant, record=record)
        self.journal.write({"phase": "leave", "trial": None, "outcome": record.get("state"),
                            "release": record.get("release"), "label": f"left {want} deployed"})
        console.print(f"tune: left {want} deployed ({record.get('release')}, {record.get('state')})", markup=False)


def run_campaign(hs: HostSession, camp: Campaign, resume: bool = False) -> dict:
    return Runner(hs, camp, resume).run()


def plan_campaign(hs: HostSession, camp: Campaign) -> list[dict]:
    return Runner(hs, camp, resume=True).plan()


def print_plan(host: str, camp: Campaign, rows: list[dict]) -> None:
    from .output import print_table, table

    t = table(f"{host}: campaign {camp.name} (check mode: every launch preflighted, nothing deployed)",
              ["trial", "setting", "patches", "state"])
    for r in rows:
        t.add_row(r["trial"], r["label"], r["patches"], r["state"])
    print_table(t)


def archive_log(host: str, name: str) -> Path | None:
    """--restart: the earlier log is kept beside the new one, never overwritten."""
    path = log_path(host, name)
    if not path.exists():
        return None
    moved = path.with_name(f"trials-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.jsonl")
    path.rename(moved)
    return moved
