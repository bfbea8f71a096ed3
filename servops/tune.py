"""`invoke tune CAMPAIGN -H HOST`: the optimisation campaign, unattended and resumable.

Each trial: deploy (launch preflight, patches, health gate, auto-rollback) -> bench -> record.
A crash is diagnosed; when its known issue names a patch and `auto_patch` is on, the trial is
retried once with that patch. A trial whose launch script and patch set equal a finished
trial's is not run again. The base is re-benched at the end of a long campaign (drift).

Every phase is written, before and after, to `results/<host>/campaigns/<name>/trials.jsonl`
here (chained lines, servops.remote.jsonl: a damaged line is skipped and named, never a
traceback) AND to the host's journal. `--resume` reads the local log: finished trials are not
repeated; the interrupted one is finished (its release is current and healthy: bench it) or
run again (the deploy it was in was rolled back, by the controller or the host's guard).

A trial takes the lead only when it beats the incumbent by more than `min_gain` (the campaign's
objective.min_gain; by default the noise measured by benching the base twice, or 2% without
that): a smaller difference is a tie, and the incumbent stays.

Output: one line per trial phase (deploy, bench, diagnose, done) with the elapsed time and an
ETA (the mean trial time x the trials left), a summary table at the end; `-v` adds what the
deploy and the bench print themselves.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

from . import bench, interrupt, localfiles, releases, startup, threadout, verdict
from .campaign import Campaign, Trial, _layer
from .campaignrecord import (DEFAULT_MIN_GAIN, TrialState, TuneError, diagnosis_line, fleet_repeat_decision,
                             fleet_winner, is_number, log_path, min_gain, objective_text, read_log, rebench_finalists,
                             rebench_runs, repeat_decision, repeat_text, standings, trial_runs,
                             trial_states)
from .campaignrecord import done_entries as logged_done
from .deploy import deploy_group, launch_identity, preflight, restart_current
from .deploystages import LAUNCH_FILES
from .errors import ServopsError
from .gate import num
from .output import CHANGED, console, err_console, is_tty, make_console
from .provenance import git_sha, operator
from .redact import redact_values, variant_secrets
from .remote import jsonl
from .render import render_launch
from .transport import HostSession
from .tunereport import print_summary

CRASHES = ("crashed", "timeout")  # deploy states whose server ran, so its log can be diagnosed


class Journal:
    """Appends to the local trials.jsonl and the host's journal, each phase before and after."""

    def __init__(self, hs: HostSession, camp: Campaign, path: Path):
        self.hs, self.camp, self.path = hs, camp, path
        localfiles.private_dir(path.parent)

    def write(self, entry: dict) -> dict:
        entry = dict(entry, at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), campaign=self.camp.name)
        try:
            entry = jsonl.append_entry(str(self.path), redact_values(entry, self.hs.redactor))
        except jsonl.FileProblem as exc:
            raise TuneError(str(exc)) from None
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
    """Elapsed time and the ETA: the mean time of the trials run so far x the trials left."""

    def __init__(self, prior: list[dict]):
        self.started = time.monotonic()
        runs = [e["seconds"] for e in prior if e.get("phase") == "done" and e.get("outcome") != "duplicate"
                and e.get("seconds")]
        self.prior_s = sum(runs)
        self.trial_s = list(runs)

    def elapsed(self) -> float:
        return self.prior_s + time.monotonic() - self.started

    def trial_done(self, seconds: float) -> None:
        self.trial_s.append(seconds)

    def eta(self, remaining: int) -> str:
        if not self.trial_s:
            return "ETA after the first trial"
        per = sum(self.trial_s) / len(self.trial_s)
        return f"ETA {_clock(per * remaining)} ({remaining} left x {_clock(per)})" if remaining else "last trial"


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# -- output for people ----------------------------------------------------------------------------

@contextlib.contextmanager
def held_back(verbose: bool, status: str = ""):
    """Unless -v, what deploy and bench print themselves (their phase lines, the health wait, a
    crash excerpt) is held back: the campaign prints one line per phase. It is printed after all
    when the phase ends in an error tune does not handle. On a terminal `status` shows meanwhile."""
    if verbose:
        yield
        return
    live = None
    if status and is_tty() and not threadout.active():  # several workers: no spinner of one
        from rich.live import Live
        from rich.spinner import Spinner

        # bound to the terminal itself, and not redirecting it: the redirect below is ours
        live = Live(Spinner("dots", status), console=make_console(file=sys.stdout), transient=True,
                    redirect_stdout=False, redirect_stderr=False)
        live.start()
    buf = io.StringIO()
    try:
        with contextlib.ExitStack() as stack:
            if threadout.active():  # a fleet campaign's workers hold back their output at once: each its own
                stack.enter_context(threadout.capture(buf))
            else:
                stack.enter_context(contextlib.redirect_stdout(buf))
                stack.enter_context(contextlib.redirect_stderr(buf))
            yield
    except Exception:
        sys.stderr.write(buf.getvalue())
        raise
    finally:
        if live:
            live.stop()


def evaluate(camp: Campaign, result: dict, base_result: dict | None, start: dict | None = None) -> dict:
    """Feasibility (constraints, failures and the start-up's bounds included) and the objective's
    value (with its 95% interval where repeats gave one), for one bench. `violations`: what
    failed, measured against its bound (`p99_ttft_ms@16 = 742.2 > 300`, `start_s <= 900
    (start_s = 950.0)`); `constraints`: every condition's line."""
    from .gate import verdicts, violation

    lookup = lambda name: base_result if name == "base" else None  # noqa: E731
    try:
        vs = verdicts(camp.constraints, result, lookup)
        passed = all(v.ok for v in vs)
        lines = [f"{'pass' if v.ok else 'FAIL'}: {v.cond} ({v.detail})" for v in vs]
        failed = [violation(v) for v in vs if not v.ok]
    except ServopsError as exc:
        passed, lines, failed = False, [f"FAIL: {exc}"], [str(exc)]
    for cond in camp.start_constraints:
        ok, line = cond.check(start or {})
        lines.append(f"{'pass' if ok else 'FAIL'}: {line}")
        if not ok:
            passed = False
            failed.append(line)
    value = camp.objective.value(result, start)
    lv = next((l for l in result.get("levels", []) if l.get("concurrency") == camp.objective.level), {})
    ci = (lv.get("ci95") or {}).get(camp.objective.metric)
    if ci and value is not None and lv.get(camp.objective.metric):  # (net of start-up: scaled alike)
        ci = [c * value / lv[camp.objective.metric] for c in ci]
    return {"feasible": bool(passed and value is not None), "objective": value,
            "objective_ci": ci, "constraints": lines, "violations": failed}


def key_metrics(result: dict) -> dict:
    """Per level: the numbers the report shows (with 95% intervals when repeated)."""
    keep = ("output_tps", "request_rate", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99",
            "e2e_p50", "e2e_p99", "goodput", "error_rate", "completed", "failed")
    out = {}
    for lv in result.get("levels", []):
        row = {k: lv.get(k) for k in keep if lv.get(k) is not None}
        for k in keep:
            ci = (lv.get("ci95") or {}).get(k)
            if ci:
                row[f"{k}_ci"] = ci
        out[str(lv["concurrency"])] = row
    return out


def diagnose_release(hs: HostSession, release: str) -> list[dict]:
    """The failed release's findings, each with its best known-issue match and its last frames."""
    from . import diagnose as dg

    res = dg.diagnose(hs, release)
    issues = dg.known_issues()
    out = []
    found = res["scan"]["findings"]
    facts = dg.HostFacts.of(res, [fr["path"] for f in found for fr in dg.finding_frames(f)])
    for f, hits in zip(found, dg.match_log(found, issues)[0]):
        top = hits[0] if hits else None
        frames = [f"{fr['func']} ({fr['path']}:{fr['line']})" for fr in dg.finding_frames(f)[-3:]]
        out.append({"entry": top and top["id"], "category": top and top["category"],
                    "title": top and top["title"], "suggest": (top or {}).get("suggest") or {},
                    # (a category too weak to show names no step: the crash's line says what is known)
                    "action": dg.finding_action(hits, None if top else dg.categorize([f]), facts),
                    "root_exception": hs.redactor(str(f.get("root_exception") or "")),
                    "final_exception": hs.redactor(str(f.get("final_exception") or "")),
                    "last_frames": [hs.redactor(x) for x in frames], "ranks": f.get("ranks") or []})
    return out


def bench_kwargs(camp: Campaign) -> dict:
    b = camp.bench
    dataset = bench.load_dataset(b.get("dataset", "random"), b.get("dataset_path", ""), b.get("seed", 42))
    kwargs = {"requests": b.get("requests", 0), "input_len": b.get("input_len", 128), "output_len": b.get("output_len", 128),
              "dataset": dataset, "repeat": b.get("repeat", 1), "warmup": bench.parse_warmup(b.get("warmup", "auto")),
              "seed": b.get("seed", 42), "range_ratio": b.get("range_ratio", 1.0), "request_rate": b.get("request_rate")}
    if b.get("slo"):
        kwargs["slo"] = bench.parse_slo(b["slo"])
    return kwargs


class Runner:
    """One host's campaign. `fleet` (servops.tunefleet.Fleet): one of several hosts running the
    campaign at once -- the study, the fixed trials' claims, the budget and the duplicates are
    the fleet's, and every line this host prints starts with its name."""

    def __init__(self, hs: HostSession, camp: Campaign, resume: bool, verbose: bool = False,
                 storage: str | None = None, fleet=None, warm_start: bool = False):
        self.hs, self.camp, self.verbose, self.resume = hs, camp, verbose, resume
        self.warm_start = warm_start
        self.warm_from: dict[str, str] = {}   # trial id -> the earlier campaign its point came from
        self.starts: dict[str, dict] = {}     # trial id -> its start-up (objective.starts_per_day weighs it)
        self.fleet = fleet
        self.executed = 0
        self.current: tuple | None = None   # (trial, its study trial or None) while one runs
        self.path = log_path(hs.host.name, camp.name)
        problems: list[str] = []
        prior = read_log(self.path, problems)
        for line in problems:
            err_console.print(f"warning: {line}", markup=False, highlight=False)
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
        self.rendered_args: dict[str, dict] = {}  # what the report shows ({{ templates }} rendered)
        self.id_width = min(max(len(t.id) for t in self.trials), 28)  # one column for the phase lines
        self.study = self.storage = None
        self.search_trials: list[Trial] = []   # the study's points this host ran (search: random / tpe)
        if camp.search != "grid":
            from . import study as studymod

            localfiles.private_dir(self.path.parent)
            if fleet is not None:  # the fleet's one study, opened once
                self.storage_url, self.study, self.storage = fleet.storage_url, fleet.study, fleet.storage
            else:
                self.storage_url = storage or studymod.default_url(self.path.parent)
                self.study, self.storage = studymod.open_study(camp.name, self.storage_url, camp.search,
                                                               camp.objective.sense, camp.seed, camp.max_trials)
            hs.redactor.add(studymod.url_secrets(self.storage_url))  # trials.jsonl, the journal, the report
            self.id_width = max(self.id_width, 12)
            self._rebuild_search_trials()
        fixed = {t.id for t in self.trials}   # the fixed trials this host ran (the study counts its own)
        self.executed = sum(1 for s in self.states.values() if s.done and s.done.get("outcome") != "duplicate"
                            and (self.study is None or s.id in fixed or "-with-" in s.id and s.id.split("-with-")[0] in fixed))

    @property
    def total(self) -> int | str:
        """The counter's denominator: the trials of a grid, the budget of a search. A fleet
        counts every host's trials against one budget (k = the fleet's count), each host with
        its own base: the grid's trials plus the other hosts' bases, at most the budget."""
        if self.study is not None:
            return self.camp.max_trials or "?"
        runs = len(self.trials) + (len(self.fleet.runners) - 1 if self.fleet is not None else 0)
        return min(runs, self.camp.max_trials) if self.fleet is not None and self.camp.max_trials else runs

    def _rebuild_search_trials(self) -> None:
        """--resume: the points this host ran before, as trials (the winner may be one of them)."""
        from optuna.trial import TrialState

        from . import search as searchmod
        from .campaign import point_trial

        for ft in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
            tid = ft.user_attrs.get("tid")
            if ft.user_attrs.get("host") != self.hs.host.name or not tid or not ft.params:
                continue
            got = searchmod.point_of(self.camp.spaces, ft.params)
            if got and not any(x.id == tid for x in self.search_trials):
                t = point_trial(self.camp.name, got[0], got[1], tid, ft.user_attrs.get("label") or tid)
                self.hs.redactor.add(variant_secrets(t.variant, self.hs.host.get("secret_vars") or ()))
                self.search_trials.append(t)
    # -- up front: every candidate passes the launch preflight before the first restart --------

    def preflight_all(self) -> None:
        t0 = time.monotonic()
        with held_back(self.verbose, f"launch preflight of {len(self.trials)} trial(s) on {self.hs.host.name}"):
            for t in self.trials:
                self._check(t)
        done = self.done_entries()
        gain, how = min_gain(self.camp, done)
        later = self.camp.min_gain is None and not any(e.get("trial") == "base" for e in done)
        fixed = "fixed " if self.study is not None else ""  # a search's points are preflighted as they are asked
        if self.camp.sequential:
            rule = (f"verdicts on {self.camp.confidence * 100:g}% intervals: a trial is benched again while unsure, "
                    f"up to {self.camp.max_repeats} runs ({repeat_text(self.camp)}); the top {self.camp.rebench_top} "
                    f"re-benched at the end")
        else:
            rule = "min_gain: the base's noise (it is benched twice)" if later else f"min_gain {gain * 100:.1f}% ({how})"
        self.say(f"tune {self.camp.name} on {self.hs.host.name}: {len(self.trials)} {fixed}trial(s), every launch preflighted "
                 f"in {time.monotonic() - t0:.1f}s; {self.camp.objective.sense} {self.camp.objective.written}; {rule}")

    def _check(self, t: Trial) -> None:
        try:
            _resolved, launch, _check = preflight(self.hs, t.variant)
        except ServopsError as exc:
            raise TuneError(f"{self.camp.path}: trial {t.id} ({t.label}): {exc}") from None
        self.hs.redactor.add(launch.secret_env.values())  # as rendered (a value may be a template)
        self.identities[t.id] = t.identity(self.hs.host, render_launch)
        self.scripts[t.id] = launch.script
        self.rendered_args[t.id] = json.loads(self.hs.redactor(json.dumps(launch.args, default=str)))

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

    # -- output: one line per trial phase ----------------------------------------------------------

    def say(self, text: str) -> None:
        """A line of the campaign's output; in a fleet, after the host's name."""
        if self.fleet is not None:
            text = f"{self.hs.host.name:<{self.fleet.name_width}} {text}"
        console.print(text, markup=False, highlight=False)

    def phase(self, t: Trial | None, k: int, name: str, text: str) -> None:
        """`[2/7] grid-8   deploy   healthy in 4.5s (...)`; campaign-wide phases leave the trial out."""
        counter = f"[{k}/{self.total}]" if t else ""
        self.say(f"{counter:<7} {t.id if t else '':<{self.id_width}} {name:<8} {text}")

    def used(self) -> int:
        """Trials the budget has counted: this host's fixed ones run, and the study's (a fleet:
        every host's)."""
        if self.fleet is not None:
            return self.fleet.used()
        return self.executed + (0 if self.study is None else _study_counted(self.study))

    def remaining(self, k: int, executed: int) -> int:
        """Trials left to run after trial k (not done yet), within max_trials."""
        left = sum(1 for t in self.trials[k:] if not (self.states.get(t.id) and self.states[t.id].done))
        if self.camp.max_trials is not None:
            left = min(left, max(0, self.camp.max_trials - executed))
        return left

    def done_text(self, done: dict, verdicts: dict[str, str]) -> str:
        outcome = done["outcome"]
        if outcome == "ok":
            return (f"feasible, {objective_text(self.camp, done.get('objective'), done.get('objective_ci'))}: "
                    f"{verdicts.get(done['trial'], '')}")
        if outcome == "infeasible":
            return "violates " + "; ".join(done.get("violations") or [])
        if outcome == "crashed":
            return "crashed" + (f"; retried with patch {done['retry_patch']}" if done.get("retry_patch")
                                and self.camp.auto_patch else "")
        return f"{outcome}: {done.get('reason') or ''}"

    # -- the loop -------------------------------------------------------------------------------

    # -- releases the campaign relies on are pinned on the host: never pruned ---------------------

    def pin(self, release: str | None, role: str, unpin: bool = False) -> None:
        if not release:
            return
        try:
            releases.ctl(self.hs, "pin", name=release, why=f"campaign {self.camp.name}: {role}", unpin=unpin)
        except ServopsError as exc:
            console.print(f"tune: warning: could not {'un' if unpin else ''}pin {release} ({role}): {exc}",
                          markup=False)

    def pin_best(self) -> None:
        """The best feasible trial's release is pinned as `best` (and the previous best unpinned)."""
        best = self.best()
        release = best and best.get("release")
        if release != self._best_release:
            self.pin(self._best_release, "best", unpin=True)
            self.pin(release, "best")
            self._best_release = release

    def run(self) -> dict:
        self.run_trials()
        return self.finish()

    def run_trials(self) -> None:
        """Every trial this host runs (a fleet: the fixed trials it claims, then the study's points
        it asks for), until the budget is spent; the campaign's end (drift, leave) is finish()."""
        self._best_release = (self.best() or {}).get("release") if self.prior else None
        self.ran_now = 0
        if not self.prior:
            # the host answers before anything is journaled: a first run that cannot reach it
            # leaves no log that would make the next plain run ask for --resume
            current = releases.ctl(self.hs, "status").get("current")
            self.journal.write({"phase": "campaign", "outcome": "started", "servops_git": git_sha(),
                                "trials": [{"trial": t.id, "label": t.label} for t in self.trials],
                                "objective": self.camp.objective.written, "facts": self._facts()})
            self.pin(current, "current when it started")
        self.preflight_all()
        stopped = False
        i = 0
        while i < len(self.trials):
            t = self.trials[i]
            i += 1
            state = self.states.get(t.id)
            if state and state.done:
                self._maybe_queue_retry(t, state.done)
                continue
            if self.fleet is not None and not self.fleet.claim(self, t):
                continue  # another host's trial (the base: every host runs its own)
            used = self.used()
            if self.fleet is None and self.camp.max_trials is not None and used >= self.camp.max_trials:
                self.say(f"tune: budget: {used} trials run (max_trials {self.camp.max_trials}); stopping")
                stopped = True
                break
            if self.camp.max_wall_s is not None and self.clock.elapsed() >= self.camp.max_wall_s:
                self.say(f"tune: budget: {_clock(self.clock.elapsed())} spent (max_wall_time); stopping")
                stopped = True
                break
            twin = self._finished_twin(t)
            if twin:
                self.journal.write({"trial": t.id, "phase": "done", "label": t.label, "outcome": "duplicate",
                                    "same_as": twin, "identity": self.identities.get(t.id)})
                self.phase(t, i, "done", f"same launch script and patches as {twin}: not run again")
                continue
            if self.fleet is None:
                k = i
                self.executed += 1
            else:  # the fleet's budget: checked and counted for every host at once
                k = self.fleet.begin(self, t)
                if k is None:
                    self.say(f"tune: budget: {self.used()} trials run (max_trials {self.camp.max_trials}); stopping")
                    stopped = True
                    break
            self.current = (t, None)
            done = self.run_trial(t, k, state)
            self.current = None
            self.ran_now += 1
            self.clock.trial_done(done.get("seconds") or 0.0)
            if t.id == "base" and done.get("release"):
                self.pin(done["release"], "base")
            self.pin_best()
            self._maybe_queue_retry(t, done)
            self.states[t.id] = TrialState(t.id, [done])
            if self.fleet is not None:
                self.fleet.finished(self, t, done)
            verdicts = self._verdicts_now()
            self.phase(t, k, "done", f"{self.done_text(done, verdicts)} · elapsed {_clock(self.clock.elapsed())} · "
                                     f"{self.clock.eta(self.remaining(i, self.used()))}")
            if interrupt.requested():
                raise TuneError(f"interrupted after trial {t.id}; continue with invoke tune {self.camp.name} "
                                f"-H {self._hosts_flag()} --resume")
            if self.fleet is not None:
                self.fleet.still_there(self, done)
        if self.study is not None and not stopped:
            self._search()

    def _hosts_flag(self) -> str:
        return self.fleet.hosts_flag if self.fleet is not None else self.hs.host.name

    def _finished_twin(self, t: Trial) -> str | None:
        ident = self.identities.get(t.id)
        for other_id, s in trial_states(read_log(self.path)).items():
            d = s.done
            if d and other_id != t.id and d.get("identity") == ident and d.get("outcome") != "duplicate":
                return other_id
        return None

    def _retry_trial(self, t: Trial, done: dict) -> Trial | None:
        """auto_patch: a crash whose known issue names a patch the trial lacks -> its retry with it."""
        patch = done.get("retry_patch")
        if not (self.camp.auto_patch and patch and not t.retry_of):
            return None
        rid = f"{t.id}-with-{patch}"
        return Trial(rid, f"{t.label} + patch {patch}",
                     _layer(t.variant, {"patches": [patch]}, f"{self.camp.name}-{rid}",
                            f"campaigns/{self.camp.name}.yml trial {rid}"),
                     dict(t.overrides, patches=list(t.overrides.get("patches") or []) + [patch]), retry_of=t.id)

    def _maybe_queue_retry(self, t: Trial, done: dict) -> None:
        """auto_patch: a crash whose known issue names a patch the trial lacks -> one retry with it."""
        retry = self._retry_trial(t, done)
        if retry is None or any(x.id == retry.id for x in self.trials):
            return
        self._check(retry)
        self.trials.insert(self.trials.index(t) + 1, retry)

    # -- search: random / tpe, through the Optuna study ---------------------------------------------

    def _search(self) -> None:
        """Ask the study for points until the budget is spent: each one deployed, benched (pruned
        at a failing level) and told back. A crash that survives auto_patch is a violated constraint
        the sampler learns from (study.tell_outcome), never a measured value."""
        from . import search as searchmod
        from . import study as studymod
        from .campaign import point_trial

        if self.resume:
            with self._study_lock():
                reclaimed = studymod.reclaim_own(self.study, self.storage, self.hs.host.name)
            for n in reclaimed:
                self.say(f"tune: study trial #{n} was cut off mid-trial (its controller stopped): marked failed, "
                         "its point asked again")
        self.say(f"tune: search {self.camp.search} (seed {self.camp.seed if self.camp.seed is not None else 'none'}) "
                 f"over {', '.join(s.name for s in self.camp.spaces)}; study {self.camp.name} in "
                 f"{studymod._shown(self.storage_url)}")
        if self.warm_start and not self.study.get_trials(deepcopy=False):
            with self._study_lock():
                self._enqueue_warm()
        dupes = predicted = 0
        while True:
            if self.camp.max_wall_s is not None and self.clock.elapsed() >= self.camp.max_wall_s:
                self.say(f"tune: budget: {_clock(self.clock.elapsed())} spent (max_wall_time); stopping")
                return
            with self._study_lock():  # a fleet: the budget's check and the ask, one host at a time
                used = self.used()
                if self.camp.max_trials is not None and used >= self.camp.max_trials:
                    self.say(f"tune: budget: {used} trials run (max_trials {self.camp.max_trials}); stopping")
                    return
                ot = studymod.ask_owned(self.study, {"host": self.hs.host.name})
                space, point = searchmod.suggest(self.camp.spaces, ot)
                tid = ot.user_attrs.get("tid") or f"s{ot.number:03d}"
                label = searchmod.point_label(space, point)
                for key, value in (("tid", tid), ("label", label)):
                    ot.set_user_attr(key, value)
                if ot.user_attrs.get("warm_from"):
                    self.warm_from[tid] = ot.user_attrs["warm_from"]
            self.current = (None, ot)
            t = point_trial(self.camp.name, space, point, tid, label)
            self.hs.redactor.add(variant_secrets(t.variant, self.hs.host.get("secret_vars") or ()))
            k = used + 1
            if tid in self.warm_from:
                self.phase(t, k, "warm", f"asked first: {self.warm_from[tid]}")
            finished = self._done_anywhere(tid) if ot.user_attrs.get("reclaims") is not None else None
            if finished and finished.get("outcome") != "duplicate" and self._retry_trial(t, finished) is None:
                # it finished and was journaled (no auto_patch retry owed), its controller stopped
                # before the study was told
                self._tell(ot, finished)
                self.current = None
                self.phase(t, k, "done", f"had finished before its controller stopped ({finished.get('outcome')}): "
                                         "told to the study, not run again")
                continue
            why = None if finished else searchmod.predicted_crash(point, self._crash_history())
            if why:
                predicted += 1
                ot.set_user_attr("predicted", why)
                self.journal.write({"trial": tid, "phase": "done", "label": label, "outcome": "predicted-crash",
                                    "reason": why, "study_trial": ot.number})
                self._tell(ot, {"outcome": "predicted-crash", "reason": why})
                self.current = None
                self.phase(t, k, "skip", f"not deployed: {why}")
                if predicted >= 20:
                    self.say("tune: the sampler asked 20 points in a row that would crash; stopping")
                    return
                continue
            predicted = 0
            try:
                self._check(t)
            except TuneError as exc:
                done = self.journal.write({"trial": tid, "phase": "done", "label": label, "outcome": "refused",
                                           "reason": str(exc), "study_trial": ot.number})
                self._tell(ot, done)
                self.current = None
                self.phase(t, k, "done", f"refused by the launch preflight: {exc}")
                if self.fleet is not None:
                    self.fleet.still_there(self, done)  # a host gone refuses every point: it drops out
                continue
            twin = self._finished_twin(t) or (self.fleet.twin(self, t) if self.fleet is not None else None)
            if twin:
                dupes += 1
                ot.set_user_attr("same_as", twin)
                self.journal.write({"trial": tid, "phase": "done", "label": label, "outcome": "duplicate",
                                    "same_as": twin, "identity": self.identities.get(tid), "study_trial": ot.number})
                self._tell(ot, self._done_anywhere(twin) or {})
                self.current = None
                self.phase(t, k, "done", f"same launch script and patches as {twin}: not run again")
                if dupes >= 20:
                    self.say("tune: the sampler asked 20 points in a row that had run already: the space is "
                             "exhausted; stopping")
                    return
                continue
            dupes = 0
            self.search_trials.append(t)
            self.current = (t, ot)
            if self.fleet is not None:
                self.fleet.started(self, t)
            from optuna.storages._heartbeat import get_heartbeat_thread

            with get_heartbeat_thread(ot._trial_id, self.storage):
                done = self.run_trial(t, k, self.states.get(tid), prune=True)
                self.states[tid] = TrialState(tid, [done])
                retry = self._retry_trial(t, done)
                if retry is not None:
                    self.phase(t, k, "done", self.done_text(done, {}))
                    self._check(retry)
                    self.search_trials.append(retry)
                    self.current = (retry, ot)
                    done = self.run_trial(retry, k, self.states.get(retry.id), prune=True)
                    self.states[retry.id] = TrialState(retry.id, [done])
                    t = retry
            self._tell(ot, done)
            self.current = None
            self.ran_now += 1
            self.clock.trial_done(done.get("seconds") or 0.0)
            self.pin_best()
            if self.fleet is not None:
                self.fleet.finished(self, t, done)
            verdicts = self._verdicts_now()
            left = None if self.camp.max_trials is None else max(0, self.camp.max_trials - k)
            self.phase(t, k, "done", f"{self.done_text(done, verdicts)} · elapsed {_clock(self.clock.elapsed())} · "
                                     + (self.clock.eta(left) if left is not None else "until max_wall_time"))
            if interrupt.requested():
                raise TuneError(f"interrupted after trial {t.id}; continue with invoke tune {self.camp.name} "
                                f"-H {self._hosts_flag()} --resume")
            if self.fleet is not None:
                self.fleet.still_there(self, done)

    def _crash_history(self) -> list[tuple[dict, bool]]:
        """(point, crashed) of every study trial that ran (a fleet: on any host)."""
        from optuna.trial import TrialState

        from . import search as searchmod

        out = []
        for ft in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            got = ft.params and searchmod.point_of(self.camp.spaces, ft.params)
            if got and not ft.user_attrs.get("same_as"):
                out.append((got[1], ft.user_attrs.get("outcome") == "crashed"))
        return out

    def _facts(self) -> dict:
        """The engine, its version and the model the campaign runs on (what --warm-start matches)."""
        from . import hostfacts
        from .campaignrecord import WARM_FACTS

        try:
            facts = hostfacts.gather(self.hs, self.trials[0].variant)
        except ServopsError:
            return {}
        return {k: str(facts.get(k)) for k in WARM_FACTS if facts.get(k)}

    def _enqueue_warm(self) -> None:
        """--warm-start: the earlier campaigns' best points on this engine, version and model (their
        trials logs, every host's, archived ones too) asked first, each marked with where it came from."""
        from . import search as searchmod
        from .campaignrecord import warm_points

        head = next((e for e in read_log(self.path) if e.get("phase") == "campaign"), {})
        logs = []
        for path in sorted(bench.RESULTS_ROOT.glob("*/campaigns/*/trials*.jsonl")):
            if path.resolve() == self.path.resolve():
                continue
            try:
                logs.append((path.parts[-4], f"{path.parent.name}/{path.name}", read_log(path)))
            except TuneError:
                continue
        queued = set()
        points, skipped = warm_points(logs, head.get("facts") or {}, self.camp.objective.written,
                                      self.camp.objective.sense)
        for line in skipped:
            self.say(f"tune: warm start: {line}")
        for p in points:
            params = searchmod.params_of(self.camp.spaces, p)
            key = json.dumps(params, sort_keys=True, default=str)
            if params is None or key in queued:
                continue
            queued.add(key)
            self.study.enqueue_trial(params, user_attrs={"host": self.hs.host.name, "warm_from": p["from"]})
            self.say(f"tune: warm start: {searchmod.point_label(*searchmod.point_of(self.camp.spaces, params))} "
                     f"asked first, from {p['from']}")
        if not queued:
            self.say("tune: warm start: no earlier campaign of this objective ran on "
                     + (" ".join(str(v) for v in (head.get("facts") or {}).values()) or "these unknown facts")
                     + " with a point in this search space")

    def _study_lock(self):
        return self.fleet.lock if self.fleet is not None else contextlib.nullcontext()

    def _verdicts_now(self) -> dict[str, str]:
        """Each finished trial's verdict for its done line: the campaign's standings (a fleet with
        max_repeats: the fleet's, against the fleet's incumbent, as its table shows them)."""
        if self.fleet is not None and self.camp.sequential:
            host = self.hs.host.name
            return {tid: v for (h, tid), v in fleet_winner(self.camp, self.fleet.done_by_host())[1].items() if h == host}
        done = self.done_entries()
        return standings(self.camp, done, min_gain(self.camp, done)[0])[1]

    def _done_of(self, tid: str) -> dict | None:
        return next((e for e in self.done_entries() if e["trial"] == tid), None)

    def _done_anywhere(self, tid: str) -> dict | None:
        """Trial tid's done entry, from this host's log or (a fleet) any host's."""
        return self._done_of(tid) or (self.fleet.done_of(tid) if self.fleet is not None else None)

    def _tell(self, ot, done: dict) -> None:
        """The trial's outcome, told to the study (study.tell_outcome: a crash teaches the sampler)."""
        with self._study_lock():
            self._tell_now(ot, done)

    def _tell_now(self, ot, done: dict) -> None:
        from . import study as studymod

        outcome = done.get("outcome")
        reason = (diagnosis_line(done.get("findings") or [], done.get("reason") or "crashed") if outcome == "crashed"
                  else done.get("reason") or "")
        studymod.tell_outcome(self.study, ot, outcome, done.get("objective"), done.get("constraints") or [], reason)

    def _bench_staged(self, t: Trial, k: int) -> tuple[dict | None, str | None, float, dict | None]:
        """The bench in the order that fails fastest (search.bench_order): a constraint violated at
        a level below the objective's stops the trial there. (result, why it failed, seconds,
        None or {level, violations, reason} when pruned)."""
        from . import search as searchmod
        from .gate import verdicts, violation

        runs = searchmod.bench_order(self.camp.bench["levels"], self.camp.constraints, self.camp.objective.level)
        if len(runs) <= 1:
            return (*self._bench(t, k), None)
        b0, parts = time.monotonic(), []
        for levels in runs:
            with held_back(self.verbose, f"[{k}/{self.total}] {t.id}: benching at {', '.join(map(str, levels))}"):
                try:
                    parts.append(bench.run_bench(self.hs, levels, **self.kwargs))
                except ServopsError as exc:
                    seconds = time.monotonic() - b0
                    self.phase(t, k, "bench", f"failed after {seconds:.1f}s: {exc}")
                    return None, str(exc), seconds, None
            if len(levels) == 1 and levels[0] < self.camp.objective.level:
                vs = verdicts(searchmod.level_conditions(self.camp.constraints, levels[0]), parts[-1], lambda _n: None)
                bad = [violation(v) for v in vs if not v.ok]
                if bad:
                    seconds = time.monotonic() - b0
                    reason = (f"{'; '.join(bad)} at concurrency {levels[0]}, below the objective's "
                              f"{self.camp.objective.level}: higher load can only make it worse")
                    self.phase(t, k, "prune", f"{reason}; trial stopped after {seconds:.1f}s")
                    return self._merge(parts), None, seconds, {"level": levels[0], "violations": bad, "reason": reason}
        seconds = time.monotonic() - b0
        result = self._merge(parts)
        self.phase(t, k, "bench", self._bench_text(t.id, result, None, seconds))
        return result, None, seconds, None

    def _merge(self, parts: list[dict]) -> dict:
        """The staged benches' results as one result file (the parts removed)."""
        import os

        if len(parts) == 1:
            return parts[0]
        levels = [lv for p in parts for lv in (p.get("config") or {}).get("levels") or []]
        path = bench.new_result_path(self.hs.host.name, parts[0]["path"] and Path(parts[0]["path"]).parent.name)
        lines = []
        for p in parts:
            for raw in Path(p["path"]).read_text().splitlines():
                if raw.strip():
                    line = json.loads(raw)
                    ((line.setdefault("servops", {})).setdefault("config", {}))["levels"] = levels
                    lines.append(json.dumps(line) + "\n")
        localfiles.append_text(path, "".join(lines))
        for p in parts:
            os.unlink(p["path"])
        merged = bench.load_result(path)
        return merged if merged is not None else parts[-1]

    def _deploy(self, t: Trial, k: int, base: dict, state: TrialState | None) -> tuple[dict, float]:
        """The trial's release, deployed (or found still healthy from before an interruption)."""
        resumed = self._resumable(state)
        if resumed:
            self.phase(t, k, "resume", f"interrupted after a healthy deploy of {resumed['release']}: benching it")
            return resumed, resumed.get("deploy_s") or 0.0
        if state:
            self.phase(t, k, "resume", "interrupted before it finished: running it again")
        self.journal.write(dict(base, phase="start", spec={"variant": t.variant["name"], "overrides": t.overrides,
                                                         "retry_of": t.retry_of,
                                                         "server_args": t.variant["server_args"],
                                                         "rendered_args": self.rendered_args.get(t.id) or {},
                                                         "env": self.hs.redactor(json.dumps(t.variant["env"])),
                                                         "patches": t.variant["patches"]},
                                script=self.hs.redactor(self.scripts.get(t.id, ""))))
        record: dict = {}
        d0 = time.monotonic()
        with held_back(self.verbose, f"[{k}/{self.total}] {t.id}: deploying"):
            try:
                deploy_group([self.hs], t.variant, record=record)
            except ServopsError as exc:
                record.update(state="failed", reason=str(exc))
        if interrupt.requested():  # Ctrl-C in the deploy: it rolled back; the trial is not done
            raise TuneError(f"interrupted in trial {t.id} ({record.get('reason')}); continue with "
                            f"invoke tune {self.camp.name} -H {self.hs.host.name} --resume")
        deploy_s = time.monotonic() - d0
        if record.get("state") == "healthy":
            record["start"] = self._start_times(record)
        before_stop = {name: record[name] for name in ("audit_s", "prebuild_s") if is_number(record.get(name))}
        self.journal.write(dict(base, phase="deployed", release=record.get("release"), outcome=record.get("state"),
                                reason=record.get("reason"), deploy_s=round(deploy_s, 2), start=record.get("start"),
                                patches=record.get("patches"), **before_stop))
        # where the deploy's time went before the old server stopped: the audit, the pre-build
        spent = ", ".join(f"{'audit' if name == 'audit_s' else 'pre-build'} {s:.1f}s" for name, s in before_stop.items())
        # a crash's reason is its diagnosis, on the next line; other failures say theirs here
        self.phase(t, k, "deploy", f"{record.get('state')} in {deploy_s:.1f}s"
                   + (f" ({spent} before the old server stopped)" if spent else "")
                   + f" ({record.get('release') or 'no release'})"
                   + (f"; {startup.text(record['start'])}" if record.get("start") else "")
                   + ("" if record.get("state") in ("healthy",) + CRASHES else f": {record.get('reason')}"))
        return record, deploy_s

    @staticmethod
    def _start_times(record: dict) -> dict:
        """The start-up as measured: start_s, the time the health gate waited for the server
        (start to healthy), and the phases the engine's log timed (weights_s, jit_s, compile_s,
        capture_s, other_s: servops/remote/startlog.py, read by the gate on the host)."""
        times = {"start_s": round(float(record["elapsed"]), 2)} if is_number(record.get("elapsed")) else {}
        return dict(times, **startup.clean(record.get("start")))  # the host's phases, plausible ones only

    def _bench(self, t: Trial, k: int, label: str | None = "bench") -> tuple[dict | None, str | None, float]:
        """(result, why it failed, seconds) of one bench of the current release; its phase line
        under `label` (None: the caller prints its own)."""
        b0 = time.monotonic()
        with held_back(self.verbose, f"[{k}/{self.total}] {t.id}: benching at "
                                     f"{', '.join(map(str, self.camp.bench['levels']))}"):
            try:
                result, why = bench.run_bench(self.hs, self.camp.bench["levels"], **self.kwargs), None
            except ServopsError as exc:
                result, why = None, str(exc)
        seconds = time.monotonic() - b0
        if label is not None:
            self.phase(t, k, label, self._bench_text(t.id, result, why, seconds))
        return result, why, seconds

    def _value(self, tid: str, result: dict) -> float | None:
        """The objective of one bench of trial `tid` (with start-up as a cost: at the start-up its
        deploy in the campaign measured)."""
        if tid not in self.starts:
            self.starts[tid] = (self._done_anywhere(tid) or {}).get("start") or {}
        return self.camp.objective.value(result, self.starts[tid])

    def _bench_text(self, tid: str, result: dict | None, why: str | None, seconds: float) -> str:
        if result is None:
            return f"failed after {seconds:.1f}s: {why}"
        lv = next((l for l in result["levels"] if l["concurrency"] == self.camp.objective.level), {})
        runs = lv.get("repeats") or 1
        value = objective_text(self.camp, self._value(tid, result),
                               (lv.get("ci95") or {}).get(self.camp.objective.metric))
        return (f"{value} ({runs} run{'s' if runs > 1 else ''}; {sum(l['completed'] for l in result['levels'])} "
                f"requests ok, {sum(l['failed'] for l in result['levels'])} failed, in {seconds:.1f}s)")

    def _noise(self, t: Trial, k: int, result: dict, value: float | None) -> dict | None:
        """The base's noise band, unless the campaign sets min_gain: the 95% interval of its
        repeats, or (one run each) the spread of a second bench of the same release."""
        if self.camp.min_gain is not None or t.id != "base" or not value:
            return None
        lv = next((l for l in result["levels"] if l["concurrency"] == self.camp.objective.level), {})
        ci = (lv.get("ci95") or {}).get(self.camp.objective.metric)
        if ci:
            band = (ci[1] - ci[0]) / 2 / abs(value)
            return {"band": band, "how": f"the 95% interval of the base's {lv.get('repeats')} runs: ±{band * 100:.1f}%"}
        failed = self._fresh_start(t, k)
        again, why, _s = (None, failed, 0.0) if failed else self._bench(t, k, None)
        second = again and self._value(t.id, again)
        if not second:
            self.phase(t, k, "noise", f"benched again: {why or 'no objective measured'}; min_gain "
                                      f"{DEFAULT_MIN_GAIN * 100:g}%")
            return None
        band = abs(second - value) / ((abs(second) + abs(value)) / 2)
        self.phase(t, k, "noise", f"benched again: {objective_text(self.camp, second, None)}; two runs of the base "
                                  f"differ by {band * 100:.1f}%: min_gain {band * 100:.1f}%")
        return {"band": band, "values": [value, second], "result_path": again["path"],
                "how": f"two runs of the base: {num(value)} and {num(second)}, {band * 100:.1f}% apart"}

    def _fresh_start(self, t: Trial, k: int) -> str | None:
        """objective.repeat_by: restart: the trial's release is stopped and started again before a
        repeat, so its runs differ by a start as two trials do (on a real GPU two benches of one
        start can agree to 0.1% while starts differ by far more: bench/evidence/tune-h100/). None,
        or why the restart failed (the restart has then rolled back, as `invoke restart` does)."""
        if self.camp.repeat_by != "restart":
            return None
        t0 = time.monotonic()
        record: dict = {}
        try:
            code, text = restart_current(self.hs, "restart", record=record)
        except ServopsError as exc:
            code, text = "failed", str(exc)
        if code != CHANGED:
            return f"the restart before the repeat failed: {text}"
        # each fresh start's phases, beside the deploy's: the start-up's own interval (bench/piecewise_value.py)
        self.journal.write({"trial": t.id, "label": t.label, "phase": "restarted", "release": record.get("release"),
                            "start": self._start_times(record)})
        self.phase(t, k, "restart", f"a fresh start for the repeat: {text} ({time.monotonic() - t0:.1f}s)")
        return None

    def _repeats(self, t: Trial, k: int, first: float) -> dict:
        """max_repeats >= 2: the trial is benched again (no restart) while its verdict against the
        incumbent is unsure and could matter, up to max_repeats runs (servops.verdict.next_step);
        the first feasible trial (the base) twice, to measure the campaign's noise."""
        done = self.done_entries()
        runs, level = [first], self.camp.confidence
        while True:
            if self.fleet is not None:  # against the fleet's incumbent, relative to each host's base
                again, why, noise = fleet_repeat_decision(self.camp, self.fleet.done_by_host(), self.hs.host.name,
                                                          t.id, runs)
            else:
                again, why, noise = repeat_decision(self.camp, done, t.id, runs)
            if not again:
                break
            self.phase(t, k, "repeat", why)
            failed = self._fresh_start(t, k)
            result, failed, _s = (None, failed, 0.0) if failed else self._bench(t, k, None)
            value = result and self._value(t.id, result)
            if value is None:
                why = f"a repeat failed ({failed or 'no objective measured'}): {len(runs)} run(s) kept"
                break
            runs.append(value)
        m, lo, hi = verdict.interval(runs, noise, level)
        shown = f"[{num(lo)}, {num(hi)}] ({level * 100:g}%)" if noise else "(no noise measured)"
        self.phase(t, k, "verdict", f"{self.camp.objective.written} = {num(m)} {shown} over {len(runs)} "
                                    f"run{'s' if len(runs) > 1 else ''}: {why}")
        return {"runs": runs, "objective": m, "objective_ci": [lo, hi] if noise else None, "repeat_stop": why}

    def run_trial(self, t: Trial, k: int, state: TrialState | None, prune: bool = False) -> dict:
        t0 = time.monotonic()
        base = {"trial": t.id, "label": t.label, "identity": self.identities.get(t.id)}
        if self.warm_from.get(t.id):
            base["warm_from"] = self.warm_from[t.id]
        record, deploy_s = self._deploy(t, k, base, state)
        self.starts[t.id] = record.get("start") or {}
        done = dict(base, phase="done", release=record.get("release"), deploy_s=round(deploy_s, 2))
        if record.get("start"):
            done["start"] = record["start"]
        if record.get("patches") is not None:  # the set deployed: the audit stage may have added to the variant's
            done["patches"] = record["patches"]
        if record.get("state") == "healthy":
            pruned = None
            if prune:
                result, why, bench_s, pruned = self._bench_staged(t, k)
            else:
                result, why, bench_s = self._bench(t, k)
            if result is None and self._died_under_load(record):  # diagnosed below, as a crash at start is
                record = dict(record, state="crashed", reason=f"the server died under load: {why}")
            elif result is None:
                done.update(outcome="bench-failed", reason=why)
            elif pruned:
                done.update(outcome="pruned", result_path=result["path"], metrics=key_metrics(result),
                            bench_s=round(bench_s, 2), violations=pruned["violations"], pruned_at=pruned["level"],
                            reason=pruned["reason"], objective=None)
                self.journal.write(dict(base, phase="benched", release=record.get("release"),
                                        result_path=result["path"], bench_s=round(bench_s, 2)))
            else:
                ev = evaluate(self.camp, result, self._base_result(), record.get("start") or {})
                done.update(outcome="ok" if ev["feasible"] else "infeasible", result_path=result["path"],
                            metrics=key_metrics(result), bench_s=round(bench_s, 2), **ev)
                self.journal.write(dict(base, phase="benched", release=record.get("release"),
                                        result_path=result["path"], bench_s=round(bench_s, 2)))
                if ev["feasible"] and self.camp.sequential:
                    done.update(self._repeats(t, k, ev["objective"]))
                elif ev["feasible"]:
                    noise = self._noise(t, k, result, ev["objective"])
                    if noise:
                        done["noise"] = noise
        if record.get("state") != "healthy":
            findings = []
            if record.get("release") and record.get("state") in CRASHES:  # the server ran: its log says why
                try:
                    findings = diagnose_release(self.hs, record["release"])
                except ServopsError as exc:
                    findings = [{"error": str(exc)}]
                self.phase(t, k, "diagnose", f"{diagnosis_line(findings, record.get('reason') or '')}; see: invoke "
                                             f"diagnose --release {record['release']} -H {self.hs.host.name}")
            done.update(outcome="crashed" if record.get("state") in CRASHES else record.get("state") or "failed",
                        reason=record.get("reason"), findings=findings)
            self.journal.write(dict(base, phase="diagnosed", release=record.get("release"), findings=findings))
            patch = next((f["suggest"].get("patch") for f in findings if (f.get("suggest") or {}).get("patch")), None)
            if patch and patch not in t.variant["patches"]:
                done["retry_patch"] = patch
        done["seconds"] = round(time.monotonic() - t0, 2)
        return self.journal.write(done)

    def _died_under_load(self, record: dict) -> bool:
        """After a failed bench: is the trial's server gone (it crashed under load, its log says why)?"""
        try:
            st = releases.ctl(self.hs, "status")
        except ServopsError:
            return False
        return st.get("current") == record.get("release") and not st.get("healthy") and not st.get("server")

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
            return {"release": deployed["release"], "state": "healthy", "deploy_s": deployed.get("deploy_s"),
                    "start": deployed.get("start"), "patches": deployed.get("patches")}
        return None

    # -- results -----------------------------------------------------------------------------------

    def done_entries(self) -> list[dict]:
        return logged_done(self.path)

    def _base_result(self) -> dict | None:
        d = next((e for e in self.done_entries() if e["trial"] == "base" and e.get("result_path")), None)
        return bench.load_result(Path(d["result_path"])) if d else None

    def best(self) -> dict | None:
        done = self.done_entries()
        return standings(self.camp, done, min_gain(self.camp, done)[0], rebench_runs(read_log(self.path)))[0]

    def finish(self) -> dict:
        entries = read_log(self.path)
        summary = {"campaign": self.camp.name, "host": self.hs.host.name}
        if self.camp.sequential and not any(e.get("phase") == "rebench" and e.get("outcome") == "finished"
                                            for e in entries):
            self._rebench(entries)
        if not any(e.get("phase") == "drift" for e in entries):
            self._drift_check()
        winner = self.best()
        summary["winner"] = winner and winner["trial"]
        left_now = not any(e.get("phase") == "leave" for e in entries)
        if left_now:
            self._leave(winner)
        summary["log"] = str(self.path)
        summary["changed"] = bool(self.ran_now or left_now)
        summary["current"] = releases.ctl(self.hs, "status").get("current")
        print_summary(self.hs.host.name, self.camp)
        return summary

    def _rebench(self, entries: list[dict]) -> None:
        """max_repeats >= 2: the end re-bench. The finalists (the best few by mean, none separated
        below the leader) are deployed again and benched once more each, round by round
        (verdict.final_rounds); the winner is then the one with the best lower bound."""
        done, rebenched = self.done_entries(), rebench_runs(entries)
        rounds = len(verdict.final_rounds(self.camp.rebench_top))
        first = 1 + max((e.get("round") or 0 for e in entries if e.get("phase") == "rebench"), default=0)
        why = "every round ran"
        for r in range(first, rounds + 1):
            names, why = rebench_finalists(self.camp, trial_runs(done, rebenched), r)
            if not names:
                break
            why = why or "every round ran"
            for tid in names:
                value = self.rebench_one(tid, r, rounds)
                if value is None:
                    continue
                rebenched.setdefault(tid, []).append(value)
                all_runs = trial_runs(done, rebenched)
                m, lo, hi = verdict.interval(all_runs[tid], verdict.pooled_noise(all_runs), self.camp.confidence)
                self.say(f"{'':<7} {tid:<{self.id_width}} {'rebench':<8} round {r}/{rounds} of {len(names)}: "
                         f"{self.camp.objective.written} = {num(value)}; now {num(m)} [{num(lo)}, {num(hi)}] over "
                         f"{len(all_runs[tid])} runs")
        self.journal.write({"phase": "rebench", "outcome": "finished", "reason": why})
        winner = standings(self.camp, done, 0.0, rebenched)[0]
        self.phase(None, 0, "rebench", f"{why}; the winner, by the best lower bound: "
                                       f"{winner['trial'] if winner else 'none'}")

    def rebench_one(self, tid: str, r: int, rounds: int) -> float | None:
        """Re-bench round `r` of trial `tid`: deployed again, benched once, logged (phase rebench).
        Its value, or None (it did not come up healthy or its bench failed: said and logged)."""
        trial = next((x for x in self.trials + self.search_trials if x.id == tid), None)
        if trial is None:
            return None
        with held_back(self.verbose, f"re-bench round {r}: deploying {tid} again"):
            try:
                record = self._switch_to(tid, trial)
            except ServopsError as exc:
                record = {"state": "failed", "reason": str(exc)}
        value, failed = None, f"{record.get('state')}: {record.get('reason')}"
        if record.get("state") == "healthy":
            result, failed, _s = self._bench(trial, r, None)
            value = result and self._value(tid, result)
            self.journal.write({"phase": "rebench", "trial": tid, "round": r, "release": record.get("release"),
                                "outcome": "measured" if value is not None else "bench-failed",
                                "runs": [] if value is None else [value],
                                "result_path": result and result["path"], "reason": failed})
            failed = f"bench failed: {failed}"
        else:
            self.journal.write({"phase": "rebench", "trial": tid, "round": r, "outcome": record.get("state"),
                                "release": record.get("release"), "reason": record.get("reason")})
        if value is None:
            self.say(f"{'':<7} {tid:<{self.id_width}} {'rebench':<8} round {r}/{rounds}: {failed}")
        if interrupt.requested():
            raise TuneError(f"interrupted in the re-bench; continue with invoke tune {self.camp.name} "
                            f"-H {self._hosts_flag()} --resume")
        return value

    def _switch_to(self, tid: str, trial: Trial) -> dict:
        """Trial `tid` deployed: its earlier release switched back to when it is still on the host
        and unchanged (no upload), else deployed afresh. The deploy's record."""
        record: dict = {}
        earlier = self._release_of(tid, trial)
        if earlier:
            from .deploy import rollback

            _status, message = rollback(self.hs, to=earlier)
            record.update(release=earlier, state="healthy", reason=message)
        else:
            deploy_group([self.hs], trial.variant, record=record)
        return record

    def _drift_check(self) -> None:
        after = self.camp.drift_after_s
        base = next((e for e in self.done_entries() if e["trial"] == "base" and e.get("result_path")), None)
        if after is None or base is None or self.clock.elapsed() < after:
            return
        t = self.trials[0]
        record: dict = {}
        with held_back(self.verbose, f"drift: deploying the base again (the campaign ran {_clock(self.clock.elapsed())})"):
            deploy_group([self.hs], self.camp.trials[0].variant, record=record)
        if record.get("state") != "healthy":
            self.journal.write({"phase": "drift", "outcome": "base unhealthy", "reason": record.get("reason")})
            self.phase(None, 0, "drift", f"the base, deployed again, is {record.get('state')}: {record.get('reason')}")
            return
        result, why, _s = self._bench(t, 1, None)
        if result is None:
            self.journal.write({"phase": "drift", "outcome": "bench failed", "reason": why})
            self.phase(None, 0, "drift", f"the base's bench failed: {why}")
            return
        before, now = base.get("objective"), self._value("base", result)
        drift = None if not before or now is None else (now - before) / before * 100.0
        self.journal.write({"phase": "drift", "outcome": "measured", "release": record.get("release"),
                            "result_path": result["path"], "before": before, "after": now,
                            "drift_pct": None if drift is None else round(drift, 2), "metrics": key_metrics(result)})
        self.phase(None, 0, "drift", f"the campaign ran {_clock(self.clock.elapsed())} (> drift_check_after): the base "
                   + (f"drifted {drift:+.1f}% on {self.camp.objective.written} ({num(before)} -> {num(now)})"
                      if drift is not None else "drift not measurable"))

    def _leave(self, winner: dict | None, trial: Trial | None = None) -> None:
        """Leave the winner (or the base) deployed. `trial`: the winner's, when another host of the
        fleet ran it (this host deploys it afresh)."""
        want = "base" if self.camp.leave == "base" or winner is None else winner["trial"]
        if want == "base" or trial is None:
            trial = next((t for t in self.trials + self.search_trials if t.id == want), self.camp.trials[0])
        status = releases.ctl(self.hs, "status")
        rel = status.get("release") or {}
        if rel.get("variant") == trial.variant["name"] and status.get("healthy"):
            self.journal.write({"phase": "leave", "trial": None, "outcome": "kept", "release": status.get("current"),
                                "label": f"{want} already deployed"})
            self.phase(None, 0, "leave", f"{want} stays deployed ({status.get('current')})")
            return
        with held_back(self.verbose, f"leaving {want} deployed"):
            record = self._switch_to(want, trial)
        self.journal.write({"phase": "leave", "trial": None, "outcome": record.get("state"),
                            "release": record.get("release"), "label": f"left {want} deployed"})
        self.phase(None, 0, "leave", f"left {want} deployed ({record.get('release')}, {record.get('state')})")

    def _release_of(self, trial_id: str, trial: Trial) -> str | None:
        """The release a finished trial ran, when it is still on the host and its launch files
        equal what the trial renders to now."""
        done = next((e for e in self.done_entries() if e["trial"] == trial_id and e.get("release")), None)
        if not done:
            return None
        resolved, launch, _check = preflight(self.hs, trial.variant)
        ours = launch_identity(self.hs, resolved, launch)
        names = sorted(set(ours) | set(LAUNCH_FILES))
        theirs = releases.ctl(self.hs, "identity", name=done["release"], files=names)
        if theirs.get("name") != done["release"] or any((theirs.get("files") or {}).get(n) != ours.get(n) for n in names):
            return None
        return done["release"]


def _study_counted(study) -> int:
    from . import study as studymod

    return studymod.counted(study)


def run_campaign(hs: HostSession, camp: Campaign, resume: bool = False, verbose: bool = False,
                 storage: str | None = None, warm_start: bool = False) -> dict:
    return Runner(hs, camp, resume, verbose, storage, warm_start=warm_start).run()


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
    head = Path(jsonl.head_path(str(path)))
    if head.exists():  # the chain's head goes with its log: the new one starts at entry 1
        head.rename(jsonl.head_path(str(moved)))
    study = path.with_name("study.db")
    if study.exists():  # the default study goes with it (a --storage study is the team's: kept)
        study.rename(moved.with_suffix(".study.db"))
    return moved
