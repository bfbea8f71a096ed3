"""A campaign's search space: `grid:` axes as value lists, ranges or categorical flags (pure).

    search: tpe                     # grid (every point, in order; the default), random or tpe
    seed: 7                         # the sampler's seed: the same campaign asks the same points
    candidates:
      - name: mem
        grid:
          server_args:
            mem-fraction-static: {low: 0.80, high: 0.92, step: 0.02}   # a range (step: a grid of it)
            cuda-graph-max-bs: {low: 8, high: 512, log: true}           # integers on a log scale
            max-running-requests: [16, 64, 256]                         # categorical
            enable-torch-compile: [true, false]

Under `search: grid` a range needs a step (it is expanded into its values); random and tpe
sample each candidate's axes with Optuna, one candidate (a "space") chosen per trial when there
are several. Named variants and candidates without a grid are fixed trials, run first.

Pruning (pure): which constraint levels can stop a trial early (`prunable_levels`) and the
order to bench the levels in (`bench_order`): the constrained levels below the objective's, lowest
first, each alone, then the rest together. Higher load only makes a latency or error-rate bound
worse, so a violation there means the trial cannot be feasible at the objective's level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SEARCHES = ("grid", "random", "tpe")
RANGE_KEYS = ("low", "high", "step", "log")
MAX_RANGE_POINTS = 10_000
# What Optuna's samplers represent: integers as floats (exact up to 2**53; 2**63 overflows numpy's
# int64), and TPE squares a float range's width (1e308 overflows; 1e150 is its edge).
MAX_INT_RANGE = 2 ** 53
MAX_FLOAT_RANGE = 1e100
# metrics that only get worse as concurrency grows: a bound violated at a lower level stays violated
MONOTONE_WORSE = ("ttft", "tpot", "itl", "e2e", "error_rate")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def axis_problem(value: Any) -> str | None:
    """Why a grid axis is not a value list or a range (None: it is one). Field(check=...)."""
    if isinstance(value, list):
        if not value:
            return "give at least one value"
        if not all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
            return "each value must be a number, text, true/false or null"
        return None
    if not isinstance(value, dict):
        return "expected a list of values or a range {low, high, step} / {low, high, log: true}"
    unknown = [k for k in value if k not in RANGE_KEYS]
    if unknown:
        from .errors import did_you_mean

        return f"unknown key {unknown[0]!r}{did_you_mean(str(unknown[0]), RANGE_KEYS)} (a range takes low, high, step, log)"
    for k in ("low", "high"):
        if k not in value:
            return f"a range needs {k}"
        if not _is_num(value[k]):
            return f"{k}: expected a number"
    low, high, step, log = value["low"], value["high"], value.get("step"), value.get("log", False)
    integer = isinstance(low, int) and isinstance(high, int) and (step is None or isinstance(step, int))
    bound = MAX_INT_RANGE if integer else MAX_FLOAT_RANGE
    for k in ("low", "high"):
        if abs(value[k]) > bound:
            return (f"{k}: {value[k]:.6g} is beyond what the sampler represents (integers within ±2**53, "
                    f"decimals within ±1e100)")
    if low > high:
        return f"low {low} is above high {high}"
    if not isinstance(log, bool):
        return "log: expected true or false"
    if step is not None and (not _is_num(step) or step <= 0):
        return "step: expected a number above 0"
    if log and low <= 0:
        return "log: true needs low above 0"
    if log and step is not None and not (isinstance(step, int) and step == 1 and isinstance(low, int)):
        return "give step or log: true, not both"
    if step is not None and (high - low) / step + 1 > MAX_RANGE_POINTS:
        return f"low..high by step is more than {MAX_RANGE_POINTS:,} values"
    return None


@dataclass
class Axis:
    section: str            # server_args | env
    key: str
    choices: list | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False

    @property
    def integer(self) -> bool:
        return self.choices is None and all(isinstance(v, int) for v in (self.low, self.high)) and \
            (self.step is None or isinstance(self.step, int))

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    def values(self) -> list:
        """Every value, for a grid: the list, or the range by its step (None: not enumerable)."""
        if self.choices is not None:
            return list(self.choices)
        if self.step is None:
            return None
        n = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        if self.integer:
            return [int(self.low + i * self.step) for i in range(n)]
        digits = max(0, -int(math.floor(math.log10(self.step))) + 3)
        return [round(self.low + i * self.step, digits) for i in range(n)]

    def suggest(self, trial, name: str):
        """The value an Optuna trial asks for, as the launch script gets it."""
        if self.choices is not None:
            return trial.suggest_categorical(name, self.choices)
        if self.integer:
            return trial.suggest_int(name, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(name, float(self.low), float(self.high), step=self.step, log=self.log)


def parse_axis(section: str, key: str, value: Any) -> Axis:
    if isinstance(value, list):
        return Axis(section, key, choices=list(value))
    return Axis(section, key, low=value["low"], high=value["high"], step=value.get("step"), log=bool(value.get("log")))


@dataclass
class Space:
    """One candidate's grid, sampled instead of expanded (search: random / tpe)."""
    name: str
    source: str                   # the variant it layers over
    variant: dict                 # that variant, with the campaign's overrides
    fixed: dict                   # the candidate's own server_args/env/patches
    axes: list[Axis] = field(default_factory=list)

    def size(self) -> int | None:
        n = 1
        for a in self.axes:
            vals = a.values()
            if vals is None:
                return None
            n *= len(vals)
        return n


SPACE_PARAM = "space"


def param_name(spaces: list[Space], space: Space, axis: Axis) -> str:
    return axis.name if len(spaces) == 1 else f"{space.name}:{axis.name}"


def suggest(spaces: list[Space], trial) -> tuple[Space, dict]:
    """(the space, {(section, key): value}) an Optuna trial (ask-and-tell) asks for."""
    space = spaces[0]
    if len(spaces) > 1:
        chosen = trial.suggest_categorical(SPACE_PARAM, [s.name for s in spaces])
        space = next(s for s in spaces if s.name == chosen)
    return space, {(a.section, a.key): a.suggest(trial, param_name(spaces, space, a)) for a in space.axes}


def point_label(space: Space, point: dict) -> str:
    return f"{space.name} [{', '.join(f'{k}={v}' for (_s, k), v in point.items())}]"


def prunable_levels(conds: list, objective_level: int) -> list[int]:
    """The levels below the objective's with a bound that higher load can only make worse."""
    out = set()
    for c in conds:
        if c.level is None or c.level >= objective_level or c.ref is not None:
            continue
        if c.op in ("<=", "<") and any(c.metric.startswith(m) for m in MONOTONE_WORSE):
            out.add(c.level)
    return sorted(out)


def bench_order(levels: list[int], conds: list, objective_level: int) -> list[list[int]]:
    """The bench runs of a trial, in the order that fails fastest: each prunable level alone,
    lowest first, then every other level in one run."""
    first = [lv for lv in prunable_levels(conds, objective_level) if lv in levels]
    rest = [lv for lv in levels if lv not in first]
    return [[lv] for lv in first] + ([rest] if rest else [])


def level_conditions(conds: list, level: int) -> list:
    """The constraint conditions measured at one level (for a pruning check)."""
    return [c for c in conds if c.level == level and c.ref is None]


def point_of(spaces: list[Space], params: dict) -> tuple[Space, dict] | None:
    """The (space, point) an Optuna trial's params stand for (None: not one of these spaces)."""
    space = spaces[0] if len(spaces) == 1 else next((s for s in spaces if s.name == params.get(SPACE_PARAM)), None)
    if space is None:
        return None
    point = {}
    for a in space.axes:
        name = param_name(spaces, space, a)
        if name not in params:
            return None
        point[(a.section, a.key)] = params[name]
    return space, point


def predicted_crash(point: dict, history: list[tuple[dict, bool]], min_crashes: int = 2) -> str | None:
    """Why `point` would crash, from the points run so far ((point, crashed) pairs): one of its
    flag values that every trial holding it crashed with (at least `min_crashes` of them), and
    that alone explains one of those crashes -- no other value of that trial only ever crashed
    (so a value that merely rode along with the real culprit is not blamed). None: no such
    value. The search's own learning from crashes, beside TPE's constraint: a value that has
    only ever crashed is not deployed again."""
    outcomes: dict = {}
    for p, crashed in history:
        for kv in p.items():
            outcomes.setdefault(kv, []).append(crashed)
    crash_only = {kv for kv, seen in outcomes.items() if len(seen) >= min_crashes and all(seen)}
    for kv in point.items():
        seen = outcomes.get(kv) or []
        if len(seen) < min_crashes or not all(seen):
            continue
        if any(p.get(kv[0]) == kv[1] and not any(other in crash_only for other in p.items() if other != kv)
               for p, _crashed in history):
            return f"every trial with {kv[0][1]} = {kv[1]} crashed ({len(seen)} of {len(seen)})"
    return None


def params_of(spaces: list[Space], spec: dict) -> dict | None:
    """The Optuna params that ask for a setting (`spec`: {"server_args": {...}, "env": {...}}, as a
    trials log records it) in these spaces: the first space whose every axis the setting gives a
    value the axis allows (None: no space holds it). For --warm-start."""
    for space in spaces:
        params = {SPACE_PARAM: space.name} if len(spaces) > 1 else {}
        for a in space.axes:
            value = (spec.get(a.section) or {}).get(a.key)
            if not _allowed(a, value):
                break
            params[param_name(spaces, space, a)] = value
        else:
            return params
    return None


def _allowed(a: Axis, value: Any) -> bool:
    if a.choices is not None:
        return any(value == c and type(value) is type(c) for c in a.choices)
    if not _is_num(value) or not a.low <= value <= a.high or (a.integer and not isinstance(value, int)):
        return False
    return a.step is None or value in a.values()
