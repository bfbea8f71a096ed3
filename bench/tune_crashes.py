"""Crashes that teach the search: crashed trials per 24-trial TPE budget, told as a FAIL (before
issue 40) against told as a violated constraint (servops.study.tell_outcome, what tune does now).

The surface is bench/tune_search.py's: the SGLang double's own speed model over a 4-flag grid.
The crash region is the double's (servops/lab/sglang_double.py crash_region, the knobs
SGLANG_DOUBLE_CRASH_IF / _CRASH_UNDER_LOAD_IF): the fastest memory setting's CUDA-graph capture
runs out of memory at start, and the highest concurrency cap runs out under load -- the corner
a throughput search is drawn to. Each trial is asked and told as tune's search loop does it
(a point asked again is a duplicate: told its twin's outcome, not counted). 10 seeds.

    .venv/bin/python bench/tune_crashes.py       # last line: crashed trials new/today (goal <= 0.5)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tune_search  # noqa: E402  (sets the double's speed knobs, as the lab campaigns do)

from servops import search  # noqa: E402
from servops import study as studymod  # noqa: E402
from servops.lab.sglang_double import crash_region  # noqa: E402

CRASH_IF = "mem-fraction-static>=0.9"              # SGLANG_DOUBLE_CRASH_IF: the capture's OOM at start
CRASH_UNDER_LOAD_IF = "max-running-requests>=256"  # SGLANG_DOUBLE_CRASH_UNDER_LOAD_IF
BUDGET = 24
SEEDS = range(10)


def crashes(point: dict) -> bool:
    args = SimpleNamespace(**{k.replace("-", "_"): v for (_s, k), v in point.items()})
    return bool(crash_region(args, CRASH_IF) or crash_region(args, CRASH_UNDER_LOAD_IF))


def campaign(seed: int, crash_teaches: bool, predict: bool = True) -> tuple[int, float]:
    """(crashed trials, the best feasible value found) of one TPE campaign of BUDGET trials; as
    tune's search loop: a point whose flag value has only ever crashed (search.predicted_crash)
    is told as a crash without running (not counted) when crashes teach."""
    import optuna

    sp = tune_search.spaces()
    study = optuna.create_study(direction="maximize", sampler=studymod.make_sampler("tpe", seed, BUDGET))
    outcome_of: dict = {}
    crashed, best, counted = 0, 0.0, 0
    for _ in range(20 * BUDGET):
        if counted >= BUDGET:
            break
        ot = study.ask()
        _space, point = search.suggest(sp, ot)
        key = tuple(sorted(point.items()))
        history = [(dict(k), o == "crashed") for k, (o, _v) in outcome_of.items()]
        if crash_teaches and predict and key not in outcome_of and search.predicted_crash(point, history):
            studymod.tell_outcome(study, ot, "predicted", None, [], search.predicted_crash(point, history))
            continue
        if key not in outcome_of:
            counted += 1
            outcome_of[key] = ("crashed", None) if crashes(point) else ("ok", tune_search.value(point))
            crashed += outcome_of[key][0] == "crashed"
            best = max(best, outcome_of[key][1] or 0.0)
        outcome, value = outcome_of[key]
        studymod.tell_outcome(study, ot, outcome, value, ["pass: (all)"] if value else [],
                              "cuda-oom-graph-capture (cuda-oom): Exception: Capture cuda graph failed",
                              crash_teaches=crash_teaches)
    return crashed, best


def main() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.monotonic()
    points = tune_search.grid_points()
    region = [p for p in points if crashes(p)]
    feasible_best = max(tune_search.value(p) for p in points if not crashes(p))
    print(f"surface: {len(points)} points, {len(region)} in the crash region ({CRASH_IF} at start, "
          f"{CRASH_UNDER_LOAD_IF} under load); best feasible {feasible_best:,.0f} tok/s; TPE, {BUDGET} trials, "
          f"{len(SEEDS)} seeds")
    rows = {}
    for name, teaches, predict in (("today (a crash is a FAIL)", False, False),
                                   ("the constraint alone", True, False),
                                   ("now (constraint + value skip)", True, True)):
        runs = [campaign(s, teaches, predict) for s in SEEDS]
        crashed = [c for c, _b in runs]
        found = [b / feasible_best for _c, b in runs]
        rows[(teaches, predict)] = statistics.mean(crashed)
        print(f"{name:<29} crashed per {BUDGET} trials: mean {statistics.mean(crashed):.1f} {sorted(crashed)}; "
              f"best found: median {statistics.median(found):.1%} of the best feasible "
              f"(worst seed {min(found):.1%})")
    print(f"({time.monotonic() - t0:.1f}s)")
    print(f"crashed now/today = {rows[(True, True)] / rows[(False, False)]:.2f} (goal <= 0.5)")


if __name__ == "__main__":
    main()
