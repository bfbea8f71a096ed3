"""A campaign's record: its trials log (trials.jsonl) and what is read from it -- each trial's
state, the noise band (min_gain), the standings and the winner, one host's or a fleet's.

The lowest of the campaign's modules: tune (which writes the log), tunefleet and tunereport
(which read it) import from here, and this module imports none of them, so each depends
downward only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from . import bench, verdict
from .campaign import Campaign
from .errors import ServopsError
from .gate import num
from .remote import jsonl

DEFAULT_MIN_GAIN = 0.02  # without a repeat of the base, a smaller difference is a tie

class TuneError(ServopsError):
    pass


def campaign_dir(host: str, name: str) -> Path:
    return bench.RESULTS_ROOT / host / "campaigns" / name


def log_path(host: str, name: str) -> Path:
    return campaign_dir(host, name) / "trials.jsonl"


# What tune reads from a trials.jsonl entry, by type: a line of another shape (hand-edited,
# damaged, planted) is skipped and named, not a KeyError in the middle of --resume.
_TEXT = ("trial", "label", "outcome", "reason", "release", "result_path", "same_as", "identity", "retry_patch",
         "script", "campaign", "repeat_stop", "warm_from")
_NUMBERS = ("seconds", "deploy_s", "bench_s", "before", "after", "drift_pct", "pruned_at", "study_trial", "round")
_LISTS = ("violations", "constraints", "findings", "objective_ci", "runs")


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def entry_problem(e: dict) -> str | None:
    """Why a trials.jsonl entry is not one tune writes (None: it is one)."""
    if not isinstance(e.get("phase"), str):
        return "no phase"
    for keys, test, what in ((_TEXT, lambda v: isinstance(v, str), "text"), (_NUMBERS, is_number, "a number"),
                             (_LISTS, lambda v: isinstance(v, list), "a list"),
                             (("metrics", "spec", "noise", "start", "facts"), lambda v: isinstance(v, dict), "an object")):
        for k in keys:
            if e.get(k) is not None and not test(e[k]):
                return f"{k} is not {what}"
    for lv, m in (e.get("metrics") or {}).items():
        if not isinstance(m, dict) or not all(is_number(v) or (isinstance(v, list) and all(map(is_number, v)))
                                              for v in m.values()):
            return f"metrics.{str(lv)[:20]} is not an object of numbers"
    for f in e.get("findings") or []:
        if not isinstance(f, dict) or not isinstance(f.get("suggest") or {}, dict) or not all(
                isinstance(f.get(k) or "", str) for k in ("entry", "category", "title", "root_exception",
                                                        "final_exception", "error")):
            return "a finding is not an object of text"
    if not all(map(is_number, (e.get("runs") or []) + (e.get("objective_ci") or [])
                   + list((e.get("start") or {}).values()))):
        return "runs/objective_ci/start are not numbers"
    if not all(isinstance(v, str) for v in (e.get("violations") or []) + (e.get("constraints") or [])):
        return "violations/constraints are not text"
    spec = e.get("spec") or {}
    if not (isinstance(spec.get("server_args") or {}, dict) and isinstance(spec.get("rendered_args") or {}, dict)
            and isinstance(spec.get("env") or "", str)
            and isinstance(spec.get("patches") or [], list)):
        return "spec is not what tune writes"
    if e.get("noise") is not None and not is_number(e["noise"].get("band")):
        return "noise.band is not a number"
    if e["phase"] != "campaign" and e.get("objective") is not None and not is_number(e["objective"]):
        return "objective is not a number"  # (the campaign's first entry names it: text)
    return None


def read_log(path: Path, problems: list[str] | None = None) -> list[dict]:
    """The log's entries (damaged lines skipped); `problems` receives what was skipped or broken,
    as sentences."""
    try:
        entries, report = jsonl.read_entries(str(path), entry_problem)
    except jsonl.FileProblem as exc:
        raise TuneError(str(exc)) from None
    if problems is not None:
        problems.extend(f"{path}: {line}" for line in jsonl.describe(report))
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


FLEET_DIR = "_fleet"


def fleet_dir(name: str) -> Path:
    return bench.RESULTS_ROOT / FLEET_DIR / name


# -- the incumbent and ties ---------------------------------------------------------------------

def improvement(camp: Campaign, value: float, incumbent: float) -> float:
    """How much better `value` is than `incumbent` on the objective, as a share (negative: worse)."""
    if incumbent == 0:
        return 0.0 if value == 0 else (float("inf") if camp.objective.better(value, incumbent) else float("-inf"))
    change = (value - incumbent) / abs(incumbent)
    return change if camp.objective.sense == "maximize" else -change


def min_gain(camp: Campaign, done: list[dict]) -> tuple[float, str]:
    """(the share a trial must beat the incumbent by, where it comes from)."""
    if camp.min_gain is not None:
        return camp.min_gain, "the campaign's min_gain"
    base = next((e for e in done if e.get("trial") == "base" and e.get("noise")), None)
    if base:
        return float(base["noise"]["band"]), base["noise"].get("how") or "the base's noise"
    return DEFAULT_MIN_GAIN, "no repeat of the base measured the noise"


def standings(camp: Campaign, done: list[dict], gain: float,
              rebenched: dict[str, list[float]] | None = None) -> tuple[dict | None, dict[str, str]]:
    """Replay the feasible trials in the order they ran: a trial takes the lead only when it
    beats the incumbent by more than `gain`; a smaller difference is a tie the incumbent keeps.
    Returns (the winner's done entry, each feasible trial's verdict when it finished).
    A campaign with max_repeats >= 2: sequential_standings."""
    if camp.sequential:
        return sequential_standings(camp, done, rebenched or {})
    best, verdicts = None, {}
    for e in done:
        if e.get("outcome") != "ok" or e.get("objective") is None or str(e.get("trial")).startswith("drift"):
            continue
        if best is None:
            best, verdicts[e["trial"]] = e, "first feasible trial: the incumbent"
            continue
        g = improvement(camp, e["objective"], best["objective"])
        if g > gain:
            verdicts[e["trial"]] = f"{g * 100:+.1f}% over {best['trial']}: the new best"
            best = e
        elif g >= -gain:
            verdicts[e["trial"]] = (f"tie: {g * 100:+.1f}% vs {best['trial']}, within min_gain {gain * 100:.1f}%; "
                                    f"{best['trial']} stays best")
        else:
            verdicts[e["trial"]] = f"{g * 100:+.1f}% vs {best['trial']}"
    return best, verdicts


def rebench_runs(entries: list[dict]) -> dict[str, list[float]]:
    """The end re-bench's runs of each finalist (phase "rebench")."""
    out: dict[str, list[float]] = {}
    for e in entries:
        if e.get("phase") == "rebench" and isinstance(e.get("trial"), str) and e.get("runs"):
            out.setdefault(e["trial"], []).extend(e["runs"])
    return out


def trial_runs(done: list[dict], rebenched: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Every feasible trial's runs of the objective (its own, then the end re-bench's), in the
    order the trials finished."""
    out = {}
    for e in done:
        if e.get("outcome") != "ok" or e.get("objective") is None or str(e.get("trial")).startswith("drift"):
            continue
        out[e["trial"]] = list(e.get("runs") or [e["objective"]]) + list((rebenched or {}).get(e["trial"], []))
    return out


def repeat_decision(camp: Campaign, done: list[dict], tid: str,
                    runs: list[float]) -> tuple[bool, str, verdict.Noise | None]:
    """max_repeats >= 2: bench trial `tid` (its `runs` so far) again, without a restart? Against
    the incumbent of the finished trials `done` (verdict.next_step); the first feasible trial
    twice, to measure the noise. (again?, why, the noise pooled with these runs). tune.Runner
    and bench/tune_verdict.py both decide here."""
    incumbent, _v = standings(camp, done, 0.0)
    return _repeat_step(camp, trial_runs(done), incumbent and incumbent["trial"], tid, runs)


def fleet_repeat_decision(camp: Campaign, done_by_host: dict[str, list[dict]], host: str, tid: str,
                          runs: list[float]) -> tuple[bool, str, verdict.Noise | None]:
    """repeat_decision in a fleet: against the fleet's incumbent, every run relative to its own
    host's base (fleet_runs); each host's base twice."""
    others = fleet_runs(done_by_host, {})
    base = trial_runs(done_by_host.get(host) or []).get("base")
    if tid == "base" or not base:  # (the noise is relative: the base's own runs measure it as they are)
        return _repeat_step(camp, others, None, (host, tid), runs)
    ref = math.fsum(base) / len(base)
    incumbent, _v = interval_verdicts(camp, others, set(), str)
    return _repeat_step(camp, others, incumbent, (host, tid), [v / ref for v in runs])


def _repeat_step(camp: Campaign, others: dict, incumbent, key, runs: list[float]
                 ) -> tuple[bool, str, verdict.Noise | None]:
    noise = verdict.pooled_noise({**others, key: runs})
    if incumbent is None:
        again = len(runs) < 2
        return again, ("the first feasible trial: benched again to measure the noise" if again else
                       f"the campaign's noise: {noise.how}" if noise else "no noise measured"), noise
    again, why = verdict.next_step(others[incumbent], runs, noise, camp.objective.sense,
                                   camp.max_repeats, camp.min_gain or 0.0, camp.confidence)
    return again, why, noise


def rebench_finalists(camp: Campaign, runs: dict, round_no: int) -> tuple[list, str]:
    """The end re-bench's round `round_no` (from 1) over `runs` (trial_runs, or a fleet's
    fleet_runs): the finalists to bench once more each, or none and why the re-bench stops
    (verdict.final_rounds / finalists)."""
    rounds = verdict.final_rounds(camp.rebench_top)
    if round_no > len(rounds):
        return [], "every round ran"
    names = verdict.finalists(runs, verdict.pooled_noise(runs), camp.objective.sense, rounds[round_no - 1],
                              camp.confidence)
    if len(names) < 2:
        return [], ("one finalist left: the others are separated below it" if len(runs) > 1
                    else "fewer than two feasible trials")
    return names, ""


def sequential_standings(camp: Campaign, done: list[dict],
                         rebenched: dict[str, list[float]]) -> tuple[dict | None, dict[str, str]]:
    """Replay the feasible trials in order, each compared with the incumbent on the intervals of
    their runs (interval_verdicts); after the end re-bench the winner is the finalist with the
    best lower bound."""
    by_id = {e["trial"]: e for e in done}
    best, verdicts = interval_verdicts(camp, trial_runs(done, rebenched), set(rebenched), str)
    return (by_id[best] if best else None), verdicts


def interval_verdicts(camp: Campaign, runs: dict, finals: set, name) -> tuple[object | None, dict]:
    """`runs` (key -> the objective's runs, in the order the trials finished) replayed: each
    compared with the incumbent, "better"/"worse" once the gain's interval leaves zero, else a
    tie within noise (the incumbent: the higher mean); the noise pooled over every key benched
    more than once. The keys in `finals` (re-benched at the end) then decide: the best lower
    bound wins. `name(key)` is how a key reads. (the winner's key, each key's verdict)"""
    noise = verdict.pooled_noise(runs)
    sense, level = camp.objective.sense, camp.confidence
    best, verdicts = None, {}
    for key, values in runs.items():
        if best is None:
            best, verdicts[key] = key, "first feasible trial: the incumbent"
            continue
        c = verdict.compare(runs[best], values, noise, sense, level)
        if c.state == "better":
            verdicts[key], best = f"better: {c.text()} vs {name(best)}: the new best", key
        elif c.state == "worse":
            verdicts[key] = f"worse: {c.text()} vs {name(best)}"
        elif c.gain > 0:
            verdicts[key], best = f"tie within noise: {c.text()} vs {name(best)}; ahead on the mean", key
        else:
            verdicts[key] = f"tie within noise: {c.text()} vs {name(best)}; {name(best)} stays ahead"
    finalists = {k: runs[k] for k in runs if k in finals}
    if finalists:
        best = verdict.choose(finalists, noise, sense, level)
        for k, values in finalists.items():
            m, lo, hi = verdict.interval(values, noise, level)
            what = "the best lower bound: chosen" if k == best else "finalist"
            verdicts[k] += f"; re-benched: {num(m)} [{num(lo)}, {num(hi)}] over {len(values)} runs, {what}"
    return best, verdicts


def repeat_text(camp: Campaign) -> str:
    """What a campaign's repeats hold, so an interval is read for what it covers."""
    return ("each repeat on a fresh start: the noise holds start-to-start variation" if camp.repeat_by == "restart"
            else "repeats bench the same start: start-to-start variation is not in the noise")


def objective_text(camp: Campaign, value: float | None, ci: list | None) -> str:
    """`output_tps@16 = 1,234 ±12` (the 95% interval's half-width, where repeats gave one)."""
    if value is None:
        return f"{camp.objective.written} not measured"
    spread = f" ±{num((ci[1] - ci[0]) / 2)}" if ci else ""
    return f"{camp.objective.written} = {num(value)}{spread}"


def diagnosis_line(findings: list[dict], fallback: str) -> str:
    """A crash in one line: the known issue and the exception, or what is known of it."""
    f = next((f for f in findings if f.get("entry")), findings[0] if findings else None)
    if f is None:
        return fallback
    if f.get("error"):
        return f"not diagnosed ({f['error']})"
    exception = f.get("final_exception") or f.get("root_exception") or ""
    if f.get("entry"):
        return f"{f['entry']} ({f['category']}): {exception}"
    return f"no known issue matched: {exception}"


def relative_entries(done_by_host: dict[str, list[dict]]) -> list[dict]:
    """Every host's finished trials, each objective relative to its own host's base (1.0: the
    base), in the order they finished; a host whose base has no objective has no comparable
    trials. Each entry keeps `host` and its `raw` objective."""
    out = []
    for host, done in done_by_host.items():
        base = next((e for e in done if e.get("trial") == "base" and e.get("outcome") == "ok"
                     and e.get("objective")), None)
        if base is None:
            continue
        for e in done:
            rel = dict(e, host=host, raw=e.get("objective"))
            if e.get("objective") is not None:
                rel["objective"] = e["objective"] / base["objective"]
            out.append(rel)
    return sorted(out, key=lambda e: (e.get("at") or "", e.get("host")))


def fleet_gain(camp: Campaign, done_by_host: dict[str, list[dict]]) -> tuple[float, str]:
    """min_gain across the fleet: the campaign's, else the widest noise band of the hosts' bases."""
    if camp.min_gain is not None:
        return camp.min_gain, "the campaign's min_gain"
    bands = [(float(e["noise"]["band"]), h) for h, done in done_by_host.items() for e in done
             if e.get("trial") == "base" and e.get("noise")]
    if bands:
        band, host = max(bands)
        return band, f"the widest noise of the hosts' bases ({host})"
    return DEFAULT_MIN_GAIN, "no repeat of a base measured the noise"


def fleet_winner(camp: Campaign, done_by_host: dict[str, list[dict]],
                 rebenched_by_host: dict[str, dict[str, list[float]]] | None = None
                 ) -> tuple[dict | None, dict, float, str]:
    """(the winner's relative entry, verdicts by (host, trial), min_gain, its source). A campaign
    with max_repeats >= 2: fleet_runs' intervals (the gain 0 and the noise's source instead)."""
    entries = relative_entries(done_by_host)
    if camp.sequential:
        runs = fleet_runs(done_by_host, rebenched_by_host or {})
        finals = {(h, t) for h, r in (rebenched_by_host or {}).items() for t in r}
        best, verdicts = interval_verdicts(camp, runs, finals, lambda k: f"{k[1]}@{k[0]}")
        noise = verdict.pooled_noise(runs)
        winner = next((e for e in entries if (e["host"], e["trial"]) == best), None)
        return winner, verdicts, 0.0, (noise.how if noise else "no trial benched twice: no noise measured")
    gain, how = fleet_gain(camp, done_by_host)
    best, verdicts = None, {}
    for e in entries:
        if e.get("outcome") != "ok" or e.get("objective") is None or str(e.get("trial")).startswith("drift"):
            continue
        key = (e["host"], e["trial"])
        if best is None:
            best, verdicts[key] = e, "first feasible trial: the incumbent"
            continue
        g = improvement(camp, e["objective"], best["objective"])
        where = f"{best['trial']}@{best['host']}"
        if g > gain:
            verdicts[key], best = f"{g * 100:+.1f}% over {where}: the new best", e
        elif g >= -gain:
            verdicts[key] = f"tie: {g * 100:+.1f}% vs {where}, within min_gain {gain * 100:.1f}%"
        else:
            verdicts[key] = f"{g * 100:+.1f}% vs {where}"
    return best, verdicts, gain, how


def fleet_runs(done_by_host: dict[str, list[dict]],
               rebenched_by_host: dict[str, dict[str, list[float]]]) -> dict[tuple[str, str], list[float]]:
    """Every host's feasible trials' runs (their own, then the end re-bench's), each relative to
    its own host's base (the mean of the base's runs: 1.0), keyed (host, trial), in the order
    they finished: one fleet's runs compare across unlike-speed hosts, and their noise pools."""
    out, order = {}, []
    for host, done in done_by_host.items():
        runs = trial_runs(done, rebenched_by_host.get(host))
        base = runs.get("base")
        if not base or not math.fsum(base):
            continue
        ref = math.fsum(base) / len(base)
        at = {e["trial"]: e.get("at") or "" for e in done}
        for tid, values in runs.items():
            order.append((at.get(tid, ""), host, tid, [v / ref for v in values]))
    for _at, host, tid, values in sorted(order, key=lambda x: (x[0], x[1])):
        out[(host, tid)] = values
    return out


def done_entries(path: Path) -> list[dict]:
    """Each trial's last done entry, from the log at `path`, in the order the trials began."""
    return [s.done for s in trial_states(read_log(path)).values() if s.done]


WARM_FACTS = ("engine", "engine_version", "model_path")  # what makes an earlier campaign's best point apply


def warm_points(logs: list[tuple[str, str, list[dict]]], facts: dict, objective: str,
                sense: str) -> tuple[list[dict], list[str]]:
    """--warm-start: each earlier campaign's best point (`logs`: (host, log name, entries)) that
    ran on the same engine, engine version and model for the same objective: its setting
    (server_args, env) and where it came from, best first; and a line for each point passed over
    because its objective is not a finite number (Infinity, NaN: a hand edit, a damaged log), so
    it never wins the ranking."""
    out, skipped = [], []
    for host, name, entries in logs:
        head = next((e for e in entries if e.get("phase") == "campaign"), None) or {}
        ran_on = head.get("facts") or {}
        if head.get("objective") != objective or any(ran_on.get(k) != facts.get(k) or not facts.get(k)
                                                      for k in WARM_FACTS):
            continue
        states = trial_states(entries)
        ok = []
        for s in states.values():
            if not (s.done and s.done.get("outcome") == "ok" and is_number(s.done.get("objective"))):
                continue
            if math.isfinite(s.done["objective"]):
                ok.append(s.done)
            else:
                skipped.append(f"campaign {head.get('campaign') or name} on {host} ({name}): trial "
                               f"{s.done.get('trial')}'s {objective} is {s.done['objective']}, not a finite number: "
                               f"skipped")
        if not ok:
            continue
        best = (max if sense == "maximize" else min)(ok, key=lambda e: e["objective"])
        spec = (states[best["trial"]].last("start") or {}).get("spec") or {}
        try:
            env = json.loads(spec.get("env") or "{}")
        except ValueError:
            env = {}
        out.append({"server_args": spec.get("server_args") or {}, "env": env if isinstance(env, dict) else {},
                    "objective": best["objective"],
                    "from": f"campaign {head.get('campaign') or name} on {host} ({name}): its best trial "
                            f"{best['trial']}, {objective} = {num(best['objective'])}"})
    return sorted(out, key=lambda p: p["objective"], reverse=sense == "maximize"), skipped
