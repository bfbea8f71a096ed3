"""`invoke tune CAMPAIGN -H gpu1,gpu2,...`: one campaign over several alike hosts at once.

One worker thread per host, each a tune.Runner that runs one trial at a time; all of them share
the fleet's one Optuna study (ask/tell under one lock: the budget's check and the ask are one
step, so max_trials holds across hosts) and its fixed trials (each claimed by one host; every
host runs its own base, so its results compare against that host's base). Before the first
trial every host's facts are compared (servops.hostfacts) and unlike hosts are refused, exit 2,
nothing changed. A host that drops out (unreachable, an SSH error) has its running trial marked
failed (in its trials.jsonl and in the study) and the campaign goes on with the rest. At the end
each host re-benches its base when the campaign ran long (drift), the fleet's winner -- its
objective relative to its own host's base -- is left as `leave:` says on every host still
there, `--serial N` hosts at a time, and one summary table shows which host ran each trial.

Local files: each host's own results/<host>/campaigns/<name>/trials.jsonl (as a one-host
campaign) and the fleet's results/_fleet/<name>/ (fleet.json: its hosts; study.db: the study,
unless --storage). --resume continues every host's log and the study: nothing finished repeats.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

from . import hostfacts, interrupt, localfiles, releases, threadout, verdict
from .campaign import Campaign, Trial
from .campaignrecord import (TuneError, fleet_dir, fleet_runs, fleet_winner, log_path, read_log, rebench_finalists,
                             rebench_runs, trial_states)
from .errors import ServopsError, TransportError
from .gate import num
from .output import CHANGED, FAILED, OK, Failed, Recap, console, err_console
from .tune import Runner
from .tunereport import print_fleet_summary

GOOD = ("ok", "infeasible", "pruned", "duplicate")  # outcomes that say nothing against the host


def fleet_hosts(name: str, selected: list[str] | None) -> list[str] | None:
    """The hosts that ran campaign `name` together, when several of them are selected (else None);
    selected None: all of them."""
    try:
        hosts = json.loads((fleet_dir(name) / "fleet.json").read_text()).get("hosts") or []
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        return None
    ran = hosts if selected is None else [h for h in selected if h in hosts]
    return ran if len(ran) > 1 or selected is None else None


def fixed_run(camp: Campaign, entries: list[dict]) -> int:
    """The fixed trials (and their retries) a host's log says ran: what the budget counts besides the study."""
    fixed = {t.id for t in camp.trials}
    return sum(1 for tid, st in trial_states(entries).items() if isinstance(tid, str) and st.done
               and st.done.get("outcome") != "duplicate" and (tid in fixed or tid.split("-with-")[0] in fixed))


# -- pure: the fleet's standings --------------------------------------------------------------------

def point_key(server_args: dict, env_text: str, patches: list) -> str:
    """A trial's setting, whatever host renders it: its server args, env and patches."""
    blob = json.dumps([server_args, env_text, sorted(patches)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def batches(hosts: list[str], serial: int | None) -> list[list[str]]:
    """--serial N: N hosts changed at a time (None or 0: all at once)."""
    if not serial:
        return [hosts] if hosts else []
    return [hosts[i:i + serial] for i in range(0, len(hosts), serial)]


# -- the coordinator ------------------------------------------------------------------------------------

def drain_reason(done: dict) -> str | None:
    """A crash whose known issue says "drain host" (NCCL on this host, its limits, its driver): the
    host leaves the study, since every point would fail there alike. (A category guessed from the
    evidence alone never takes a host out.)"""
    f = next((f for f in done.get("findings") or [] if f.get("entry") and f.get("action") == "drain host"), None)
    if f is None:
        return None
    return f"its crash says drain host: {f['entry']}: {f.get('root_exception') or ''}".rstrip(": ")


class HostDropped(ServopsError):
    exit_code = 3


class Fleet:
    """What the hosts' runners share: the study, the claims on fixed trials, the budget, the
    settings run or running (a point another host ran is a duplicate), the trials by id."""

    def __init__(self, camp: Campaign, hosts: list[str], storage_url: str | None):
        self.camp, self.hosts = camp, hosts
        self.hosts_flag = ",".join(hosts)
        self.name_width = max(len(h) for h in hosts)
        self.lock = threading.RLock()
        self.runners: dict[str, Runner] = {}
        self.claims: dict[str, str] = {}       # fixed trial id -> the host that runs it
        self.keys: dict[str, str] = {}         # point_key -> trial id (run or running)
        self.dones: dict[str, dict] = {}       # trial id -> its done entry (with its host)
        self.trials: dict[str, Trial] = {}
        self.dropped: dict[str, str] = {}
        self.elsewhere = 0   # fixed trials run by hosts of this campaign not in this run (resume)
        self.storage_url = storage_url
        self.study = self.storage = None
        if camp.search != "grid":
            from . import study as studymod

            self.study, self.storage = studymod.open_study(camp.name, storage_url, camp.search, camp.objective.sense,
                                                           camp.seed, camp.max_trials)

    def add(self, runner: Runner) -> None:
        """A host's runner, and what its log says it ran (resume)."""
        host = runner.hs.host.name
        self.runners[host] = runner
        for tid, st in runner.states.items():
            if not isinstance(tid, str):  # (campaign-wide entries: leave, drift)
                continue
            start = st.last("start") or {}
            if tid != "base" and not tid.startswith("base-with-"):
                self.claims.setdefault(tid, host)
            spec = start.get("spec")
            if spec:
                self.keys.setdefault(point_key(spec.get("server_args") or {}, spec.get("env") or "",
                                               spec.get("patches") or []), tid)
            if st.done and st.done.get("outcome") != "duplicate":
                self.dones[tid] = dict(st.done, host=host)
        for t in runner.trials + runner.search_trials:
            self.trials.setdefault(t.id, t)

    def key_of(self, runner: Runner, t: Trial) -> str:
        return point_key(t.variant["server_args"], runner.hs.redactor(json.dumps(t.variant["env"])),
                         t.variant["patches"])

    def claim(self, runner: Runner, t: Trial) -> bool:
        """Whether this host runs fixed trial t: every host its own base (and the base's retry),
        each other fixed trial one host, the first to ask (or the one that started it before)."""
        if t.id == "base" or t.retry_of == "base":
            return True
        host = runner.hs.host.name
        with self.lock:
            return self.claims.setdefault(t.id, host) == host

    def begin(self, runner: Runner, t: Trial) -> int | None:
        """A fixed trial starts: its number, counted against the budget (None: spent)."""
        with self.lock:
            used = self.used()
            if self.camp.max_trials is not None and used >= self.camp.max_trials:
                if self.claims.get(t.id) == runner.hs.host.name and t.id not in self.dones:
                    self.claims.pop(t.id, None)
                return None
            runner.executed += 1
            self.started(runner, t)
            return used + 1

    def used(self) -> int:
        from . import study as studymod

        with self.lock:
            return (self.elsewhere + sum(r.executed for r in self.runners.values())
                    + (studymod.counted(self.study) if self.study is not None else 0))

    def started(self, runner: Runner, t: Trial) -> None:
        with self.lock:
            self.keys.setdefault(self.key_of(runner, t), t.id)
            self.trials[t.id] = t

    def twin(self, runner: Runner, t: Trial) -> str | None:
        """Another trial of the fleet with t's setting (run or running on any host)."""
        with self.lock:
            other = self.keys.get(self.key_of(runner, t))
        return other if other and other != t.id else None

    def done_of(self, tid: str) -> dict | None:
        with self.lock:
            return self.dones.get(tid)

    def finished(self, runner: Runner, t: Trial, done: dict) -> None:
        with self.lock:
            self.dones[t.id] = dict(done, host=runner.hs.host.name)
            self.trials[t.id] = t

    def still_there(self, runner: Runner, done: dict) -> None:
        """After a trial that failed: is its host still reachable, and fit to go on? If not, it drops out."""
        if done.get("outcome") in GOOD:
            return
        reason = drain_reason(done)
        if reason:
            raise HostDropped(reason)
        try:
            releases.ctl(runner.hs, "status")
        except ServopsError as exc:
            raise HostDropped(str(exc)) from None

    def drop(self, runner: Runner, reason: str) -> None:
        """A host dropped out: its running trial is marked failed, here and in the study."""
        host = runner.hs.host.name
        with self.lock:
            self.dropped[host] = reason
        t, ot = runner.current or (None, None)
        runner.current = None
        if t is not None:
            states = trial_states(read_log(runner.path))
            if not (states.get(t.id) and states[t.id].done):
                done = runner.journal.write({"trial": t.id, "phase": "done", "label": t.label, "outcome": "failed",
                                             "reason": f"{host} dropped out of the campaign: {reason}",
                                             **({"study_trial": ot.number} if ot is not None else {})})
                self.finished(runner, t, done)
                runner.phase(t, 0, "done", f"failed: {host} dropped out of the campaign ({reason})")
        if ot is not None:
            try:
                runner._tell(ot, {"outcome": "failed", "reason": f"{host} dropped out: {reason}"})
            except Exception as exc:  # already told: nothing left to mark
                err_console.print(f"tune: {host}: study trial #{ot.number}: {exc}", markup=False)

    def rebenched(self) -> dict[str, dict[str, list[float]]]:
        """Each host's end re-bench runs, by trial."""
        return {n: rebench_runs(read_log(r.path)) for n, r in self.runners.items()}

    def done_by_host(self) -> dict[str, list[dict]]:
        return {h: r.done_entries() for h, r in self.runners.items()}


# -- the campaign over the fleet -----------------------------------------------------------------------

def check_alike(sessions: dict, camp: Campaign) -> dict[str, dict[str, str]]:
    """Every host's facts, gathered at once; unlike hosts are refused (the table, then one line)."""
    facts: dict[str, dict[str, str]] = {}
    errors: dict[str, str] = {}

    def one(name):
        try:
            facts[name] = hostfacts.gather(sessions[name], camp.trials[0].variant)
        except ServopsError as exc:
            errors[name] = str(exc)

    _threads(one, list(sessions))
    if errors:
        raise TransportError("the fleet's hosts could not all be read, nothing was changed: "
                             + "; ".join(f"{h}: {e}" for h, e in errors.items()))
    facts = {h: facts[h] for h in sessions}
    diffs = hostfacts.differences(facts)
    if diffs:
        hostfacts.print_table(facts, diffs)
        raise hostfacts.HostsDiffer(hostfacts.refusal(diffs))
    return facts


def _threads(fn, items: list) -> list:
    """fn(item) for every item in its own thread; the first Ctrl-C asks each to stop after its
    step (servops.interrupt)."""
    if not items:
        return []
    pool = ThreadPoolExecutor(max_workers=len(items))
    futures = [pool.submit(fn, x) for x in items]
    try:
        while not all(f.done() for f in futures):
            try:
                wait(futures, timeout=0.2)
            except KeyboardInterrupt:
                interrupt.request()
                err_console.print("interrupted: each host finishes its step", markup=False)
    finally:
        pool.shutdown(wait=True)
    return [f.result() for f in futures]


def archive(name: str) -> None:
    """--restart of a fleet campaign: its fleet directory is kept beside the new one."""
    d = fleet_dir(name)
    if d.exists():
        d.rename(d.with_name(f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"))


def run_fleet(inv, hosts: list, camp: Campaign, resume: bool = False, verbose: bool = False,
              storage: str | None = None, serial: int | None = None) -> Recap:
    from . import study as studymod
    from .transport import Session

    names = [h.name for h in hosts]
    recap = Recap()
    recap.expect(names)
    d = fleet_dir(camp.name)
    record = d / "fleet.json"
    if record.exists() and not resume:
        raise TuneError(f"{record}: campaign {camp.name} already ran on this fleet: continue with --resume, "
                        f"or start over with --restart")
    before = (fleet_hosts(camp.name, None) or []) if resume else []  # every host that ran it before
    with Session(inv) as session:
        sessions = {h.name: session.host(h) for h in hosts}
        facts = check_alike(sessions, camp)
        localfiles.private_dir(d)
        url = None
        if camp.search != "grid":
            url = storage or studymod.default_url(d)
        fleet = Fleet(camp, names, url)
        for name in names:
            fleet.add(Runner(sessions[name], camp, resume, verbose, storage, fleet=fleet))
        fleet.elsewhere = sum(fixed_run(camp, read_log(log_path(h, camp.name))) for h in before if h not in names)
        localfiles.write_new(record, (json.dumps({"campaign": camp.name, "hosts": before + [n for n in names if n not in before],
                                                  "facts": facts[names[0]]}, indent=1) + "\n").encode())
        f0 = facts[names[0]]
        console.print(f"tune {camp.name} on {len(names)} alike hosts ({', '.join(names)}): {f0['gpus']}, "
                      f"{f0['engine']} {f0['engine_version']}, model {f0['model_path']}; one trial per host at a time",
                      markup=False, highlight=False)
        with threadout.threads():
            _threads(lambda n: _work(fleet, fleet.runners[n]), names)
            alive = [n for n in names if n not in fleet.dropped]
            if camp.sequential and not interrupt.requested():
                _rebench(fleet, alive)
            done_by_host = fleet.done_by_host()
            winner, verdicts, gain, how = fleet_winner(camp, done_by_host, fleet.rebenched())
            trial = fleet.trials.get(winner["trial"]) if winner else None
            for batch in batches(alive, serial):
                if interrupt.requested():
                    break
                _threads(lambda n: _leave(fleet.runners[n], winner, trial), batch)
        print_fleet_summary(names, camp)
        for n in names:
            if n in fleet.dropped:
                recap.mark(n, Failed(3), f"dropped out of the campaign: {fleet.dropped[n]}")
                continue
            r = fleet.runners[n]
            if getattr(r, "left_error", None):
                recap.mark(n, FAILED, r.left_error)
                continue
            try:
                current = releases.ctl(r.hs, "status").get("current")
            except ServopsError as exc:
                recap.mark(n, Failed(exc.exit_code), str(exc))
                continue
            where = f" (ran on {winner['host']})" if winner else ""
            recap.mark(n, CHANGED if r.ran_now or getattr(r, "left_now", False) else OK,
                       f"winner {winner['trial'] if winner else 'none'}{where}, deployed: {current}; log {r.path}")
    return recap


def _work(fleet: Fleet, runner: Runner) -> None:
    """One host's part: its trials, then its drift check. A host gone drops out; the rest go on."""
    runner.ran_now = 0
    try:
        runner.run_trials()
        if not any(e.get("phase") == "drift" for e in read_log(runner.path)):
            runner._drift_check()
    except ServopsError as exc:
        if interrupt.requested():
            fleet.dropped[runner.hs.host.name] = f"interrupted: continue with invoke tune {fleet.camp.name} " \
                                                  f"-H {fleet.hosts_flag} --resume"
            return
        fleet.drop(runner, str(exc))
        runner.say(f"tune: {runner.hs.host.name} dropped out of the campaign: {exc}; the others go on")


def _rebench(fleet: Fleet, alive: list[str]) -> None:
    """max_repeats >= 2: the fleet's end re-bench, as one host's (tune.Runner._rebench): the
    finalists across the fleet (fleet_runs: each relative to its own host's base) deployed again
    on the host that ran them and benched once more a round, the hosts at once; each host's log
    says when it ended (a --resume goes on from the next round)."""
    camp = fleet.camp
    logs = {n: read_log(fleet.runners[n].path) for n in alive}
    if not alive or any(e.get("phase") == "rebench" and e.get("outcome") == "finished"
                        for entries in logs.values() for e in entries):
        return
    rounds = len(verdict.final_rounds(camp.rebench_top))
    first = 1 + max((e.get("round") or 0 for entries in logs.values() for e in entries
                     if e.get("phase") == "rebench"), default=0)
    why = "every round ran"
    for r in range(first, rounds + 1):
        names, why = rebench_finalists(camp, fleet_runs(fleet.done_by_host(), fleet.rebenched()), r)
        keys = [k for k in names if k[0] in alive]
        if len(keys) < 2:
            why = why or "the other finalists' hosts dropped out"
            break
        why = "every round ran"

        def host_part(host: str) -> None:
            runner = fleet.runners[host]
            for h, tid in keys:
                value = runner.rebench_one(tid, r, rounds) if h == host else None
                if value is not None:
                    now = fleet_runs(fleet.done_by_host(), fleet.rebenched())
                    m, lo, hi = verdict.interval(now[(h, tid)], verdict.pooled_noise(now), camp.confidence)
                    runner.say(f"{'':<7} {tid:<{runner.id_width}} {'rebench':<8} round {r}/{rounds} of {len(keys)}: "
                               f"{camp.objective.written} = {num(value)}; now {m:.3f}x its host's base "
                               f"[{lo:.3f}, {hi:.3f}] over {len(now[(h, tid)])} runs")

        _threads(host_part, sorted({h for h, _t in keys}))
        if interrupt.requested():
            return
    for n in alive:
        fleet.runners[n].journal.write({"phase": "rebench", "outcome": "finished", "reason": why})
    winner = fleet_winner(camp, fleet.done_by_host(), fleet.rebenched())[0]
    fleet.runners[alive[0]].phase(None, 0, "rebench", f"{why}; the winner, by the best lower bound: "
                                                     f"{winner['trial'] + '@' + winner['host'] if winner else 'none'}")


def _leave(runner: Runner, winner: dict | None, trial: Trial | None) -> None:
    runner.left_now = False
    if any(e.get("phase") == "leave" for e in read_log(runner.path)):
        return  # (a --resume of a campaign that had finished)
    try:
        runner._leave(winner, trial)
        runner.left_now = True
    except ServopsError as exc:
        runner.left_error = f"could not leave {winner['trial'] if winner else 'base'} deployed: {exc}"
        runner.say(f"tune: {runner.left_error}")
