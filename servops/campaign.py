"""A tuning campaign: `campaigns/<name>.yml`, validated up front, expanded into trials.

    base: baseline                        # the variant every candidate is measured against
    overrides: {env: {...}, server_args: {...}}   # applied to the base and every candidate
    candidates:
      - variant: piecewise                # a named variant (playbooks/piecewise.yml)
      - name: mem                         # a grid over the base (or `variant:`)
        grid:
          server_args: {mem-fraction-static: [0.80, 0.85, 0.90], cuda-graph-max-bs: [128, 256]}
        env: {NCCL_NVLS_ENABLE: "1"}      # fixed overrides, like a variant layer
        server_args: {...}
        patches: [...]
    bench: {levels: [1, 10, 256, 1024], requests: 512, input_len: 1024, output_len: 1024,
            dataset: random, slo: "ttft:500,tpot:50", repeat: 1}
    objective:
      maximize: output_tps@1024           # or minimize: p99_ttft_ms@256
      constraints: ["p99_ttft_ms@256 <= 2000", "failed == 0"]
      min_gain: 2%                        # a smaller difference is a tie (default: the base's noise)
      max_repeats: 2                      # bench a trial again while its verdict is unsure, up to N runs;
                                          # then re-bench the top few and choose by the interval's lower bound
      confidence: 80%                     # the intervals' level (default 80%)
      rebench_top: 3                      # how many finalists the end re-bench takes (default 3)
      repeat_by: restart                  # each repeat on a fresh start of the trial's release, so the
                                          # noise holds start-to-start variation (default rebench: same start)
      starts_per_day: 4                   # start-up as a cost: the objective x (1 - 4 * start_s / 86400)
    budget: {max_trials: 20, max_wall_time: 12h}
    auto_patch: true                      # a crash whose known issue names a patch: retry once with it
    leave: best                           # or base
    drift_check_after: 2h                 # re-bench the base at the end of a longer campaign

Every value is checked before anything runs; an error is one line naming the file and key.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gate as gatemod
from .bench import DATASETS, MAX_CONCURRENCY, MAX_REPEAT, MAX_REQUESTS, MAX_TOKENS, parse_slo
from .errors import ServopsError, did_you_mean
from .playbooks import load_variant
from . import search
from .schema import ENV_NAME, FLAG, NAME, Field, load_mapping, parse_duration, seconds

CAMPAIGN_ROOT = Path(os.environ.get("SERVOPS_CAMPAIGNS") or Path(__file__).resolve().parent.parent / "campaigns")


MAX_TRIALS = 10_000  # budget.max_trials' ceiling too


class CampaignError(ServopsError):
    pass


def _levels_ok(value: Any) -> str | None:
    return None if value else "give at least one level"


def _warmup_ok(value: Any) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_REQUESTS):
        return None
    return f"expected auto (warm up until TTFT settles), 0 (none) or a number of requests up to {MAX_REQUESTS:,}"


def parse_gain(value: Any) -> float | None:
    """objective.min_gain: '2%' or a fraction (0.02) -> the fraction; None when not valid."""
    text = str(value).strip()
    try:
        gain = float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None
    return gain if not isinstance(value, bool) and 0 <= gain < 1 else None


def _gain_ok(value: Any) -> str | None:
    return None if parse_gain(value) is not None else "expected a share like 2% (or 0.02), from 0 to below 100%"


def _confidence_ok(value: Any) -> str | None:
    level = parse_gain(value)
    return None if level is not None and 0.5 <= level < 1 else "expected a level like 80% (or 0.8), from 50% to below 100%"


_SCALAR_OR_LIST = Field("any", nullable=True)
_GRID_VALUES = Field("any", check=search.axis_problem)  # a value list, or a range (servops/search.py)
CANDIDATE = {
    "name": Field("str", pattern=NAME, what="a name (letters, digits, '.', '_' or '-')"),
    "variant": Field("str", pattern=NAME, what="a variant name"),
    "server_args": Field("map", keys=FLAG, keys_what="a flag name like cuda-graph-max-bs", items=_SCALAR_OR_LIST),
    "env": Field("map", keys=ENV_NAME, keys_what="an environment variable name", items=_SCALAR_OR_LIST),
    "patches": Field("list", items=Field("str", pattern=NAME, what="a patch name")),
    "grid": Field("record", fields={
        "server_args": Field("map", keys=FLAG, keys_what="a flag name", items=_GRID_VALUES),
        "env": Field("map", keys=ENV_NAME, keys_what="an environment variable name", items=_GRID_VALUES)}),
}
BENCH = {  # the same bounds as bench's flags
    "levels": Field("list", items=Field("int", 1, MAX_CONCURRENCY), check=_levels_ok),
    "requests": Field("int", 0, MAX_REQUESTS), "input_len": Field("int", 1, MAX_TOKENS),
    "output_len": Field("int", 0, MAX_TOKENS),
    "dataset": Field("str", pattern=re.compile("|".join(DATASETS)), what=" / ".join(DATASETS)),
    "dataset_path": Field("path"), "slo": Field("str"), "repeat": Field("int", 1, MAX_REPEAT),
    "warmup": Field("any", check=_warmup_ok), "request_rate": Field("number", low=0.001, high=1e9),
    "seed": Field("int", 0, 2**63 - 1), "range_ratio": Field("number", 0, 1),
}
CAMPAIGN = {
    "description": Field("any", nullable=True),
    "search": Field("str", check=lambda v: None if v in search.SEARCHES else
                    f"expected grid, random or tpe{did_you_mean(v, search.SEARCHES)}"),
    "seed": Field("int", 0, 2**32 - 1),
    "base": Field("str", pattern=NAME, what="a variant name"),
    "overrides": Field("record", fields={k: CANDIDATE[k] for k in ("server_args", "env", "patches")}),
    "candidates": Field("list", items=Field("record", fields=CANDIDATE)),
    "bench": Field("record", fields=BENCH),
    "objective": Field("record", fields={
        "maximize": Field("str"), "minimize": Field("str"), "constraints": Field("list", items=Field("str")),
        "min_gain": Field("any", check=_gain_ok), "max_repeats": Field("int", 1, MAX_REPEAT),
        "confidence": Field("any", check=_confidence_ok), "rebench_top": Field("int", 2, 10),
        "starts_per_day": Field("number", low=0.001, high=1440),
        "repeat_by": Field("str", pattern=re.compile("rebench|restart"), what="rebench or restart")}),
    "budget": Field("record", fields={
        "max_trials": Field("int", 1, MAX_TRIALS),
        "max_wall_time": Field("any", check=parse_duration)}),
    "auto_patch": Field("bool"),
    "leave": Field("str", pattern=re.compile("best|base"), what="best or base"),
    "drift_check_after": Field("any", check=parse_duration),
}


@dataclass
class Trial:
    """One candidate setting: a variant dict (not a playbook file) and how it was derived."""
    id: str
    label: str
    variant: dict
    overrides: dict = field(default_factory=dict)   # server_args/env/patches vs its source variant
    retry_of: str | None = None

    def identity(self, host, render) -> str:
        """Equal launch script (rendered under one name) and patch set: the same trial."""
        script = render(host, dict(self.variant, name="trial", source="trial")).script
        blob = script + "\n--patches--\n" + "\n".join(sorted(self.variant["patches"]))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DAY_S = 86400.0


@dataclass
class Objective:
    sense: str          # maximize | minimize
    metric: str         # summary name (output_tps, ttft_p99, ...)
    level: int
    written: str        # as the console and the report name it (with its start-up cost, when it has one)
    starts_per_day: float = 0.0   # start-up as a cost: the server serves nothing while it starts

    def better(self, a: float, b: float) -> bool:
        return a > b if self.sense == "maximize" else a < b

    def value(self, result: dict, start: dict | None = None) -> float | None:
        """The objective of one bench; with `starts_per_day`, the throughput over a day in which
        the server starts that many times, serving nothing for its `start_s` each time:
        x (1 - starts_per_day * start_s / 86400) (a start-up not timed costs nothing)."""
        lv = next((l for l in result.get("levels", []) if l.get("concurrency") == self.level), None)
        v = (lv or {}).get(self.metric)
        if v is None:
            return None
        lost = self.starts_per_day * float((start or {}).get("start_s") or 0.0) / DAY_S
        return float(v) * max(0.0, 1.0 - lost)


@dataclass
class Campaign:
    name: str
    path: Path
    data: dict
    base: str
    trials: list[Trial]
    bench: dict
    objective: Objective
    constraints: list
    min_gain: float | None          # None: the base's measured noise band (see campaignrecord.min_gain)
    max_trials: int | None
    max_wall_s: float | None
    auto_patch: bool
    leave: str
    drift_after_s: float | None
    search: str = "grid"
    seed: int | None = None
    spaces: list = field(default_factory=list)    # search.Space per grid candidate (random / tpe)
    start_constraints: list = field(default_factory=list)   # StartCondition: bounds on the start-up
    max_repeats: int = 1            # >= 2: sequential verdicts (servops.verdict); 1: one run per trial
    confidence: float = 0.8         # the intervals' level
    rebench_top: int = 3            # the finalists the end re-bench takes
    repeat_by: str = "rebench"      # a repeat benches the running server again, or restarts it first

    @property
    def sequential(self) -> bool:
        return self.max_repeats > 1


def _fail(path: Path, key: str, message: str) -> CampaignError:
    return CampaignError(f"{path}: {key}: {message}")


def _objective(path: Path, spec: dict, levels: list[int]) -> Objective:
    senses = [s for s in ("maximize", "minimize") if s in spec]
    if len(senses) != 1:
        raise _fail(path, "objective", "give exactly one of maximize or minimize, e.g. maximize: output_tps@1024")
    written = spec[senses[0]].strip()
    m = re.fullmatch(r"([a-z_0-9]+)\s*@\s*(\d+)", written)
    if not m:
        raise _fail(path, f"objective.{senses[0]}", f"{written!r}: expected METRIC@LEVEL, e.g. output_tps@1024")
    metric = gatemod.ALIASES.get(m[1], m[1])
    if metric not in gatemod.METRICS:
        raise _fail(path, f"objective.{senses[0]}", f"unknown metric {m[1]!r} (e.g. output_tps, p99_ttft_ms, goodput)")
    if int(m[2]) not in levels:
        raise _fail(path, f"objective.{senses[0]}", f"level {m[2]} is not one of bench.levels {levels}")
    starts = spec.get("starts_per_day")
    if starts is None:
        return Objective(senses[0], metric, int(m[2]), written)
    if senses[0] != "maximize" or metric not in gatemod.HIGHER_IS_BETTER:
        raise _fail(path, "objective.starts_per_day", f"weighs start-up against a rate served (maximize: "
                                                      f"output_tps@N, goodput@N, ...), not {senses[0]}: {written}")
    return Objective(senses[0], metric, int(m[2]), f"{written} net of {starts:g} starts/day", float(starts))


START_METRICS = ("start_s", "weights_s", "jit_s", "compile_s", "capture_s", "other_s")
_START = re.compile(r"\s*(%s)\s*(<=|<|>=|>)\s*(\d+(?:\.\d+)?)\s*(s|min)?\s*" % "|".join(START_METRICS))


@dataclass(frozen=True)
class StartCondition:
    """A bound on a trial's start-up: `start_s <= 900` (time to healthy) or an engine's own timed
    phase (capture_s, compile_s, ...: what its log says, servops.engines)."""
    metric: str
    op: str
    seconds: float
    written: str

    def check(self, times: dict) -> tuple[bool, str]:
        """(met, the line the report shows); a phase the log did not time is not held against it."""
        value = times.get(self.metric)
        if value is None:
            return True, f"{self.written} ({self.metric} not timed by this start)"
        return gatemod.OPS[self.op](value, self.seconds), f"{self.written} ({self.metric} = {value:.1f})"


def start_conditions(texts: list[str]) -> list[StartCondition]:
    out = []
    for text in texts:
        m = _START.fullmatch(str(text))
        if m:
            out.append(StartCondition(m[1], m[2], float(m[3]) * (60 if m[4] == "min" else 1), " ".join(str(text).split())))
    return out


def _constraints(path: Path, texts: list[str], levels: list[int], slo: str | None) -> list:
    """The gate grammar; `failed == 0` (or `failed <= N%`) is the allowed error rate at every level.
    Start-up bounds (`start_s <= 900`) are start_conditions', not the bench's."""
    terms, error_rate = [], 0.0
    texts = [t for t in texts if not _START.fullmatch(str(t))]
    for i, text in enumerate(texts):
        m = re.fullmatch(r"\s*failed\s*(==|<=)\s*(\d+(\.\d+)?)\s*(%?)\s*", text)
        if m:
            error_rate = float(m[2]) / (100.0 if m[4] else 1.0)
            if not m[4] and error_rate != 0:
                raise _fail(path, f"objective.constraints[{i}]", "failed <= N needs a percentage (failed <= 1%), or failed == 0")
            continue
        terms.append(text)
    terms += [f"error_rate@{lv} <= {error_rate:g}" for lv in levels]
    if slo:
        terms.append(f"slo({slo})")
    try:
        conds = gatemod.parse_gate(", ".join(terms))
    except gatemod.GateError as exc:
        raise _fail(path, "objective.constraints", str(exc).replace("--gate ", "")) from None
    for c in conds:
        if c.level is not None and c.level not in levels:
            raise _fail(path, "objective.constraints", f"{c}: level {c.level} is not one of bench.levels {levels}")
        if c.ref is not None and c.ref != "base":
            raise _fail(path, "objective.constraints", f"{c}: compare with 'base' (the base trial), not {c.ref!r}")
    return conds


def _layer(variant: dict, overrides: dict, name: str, source: str | None = None) -> dict:
    """A candidate's overrides over its variant, merged like an `extends` layer."""
    out = dict(variant)
    for key in ("server_args", "env"):
        merged = dict(variant.get(key) or {})
        for k, v in (overrides.get(key) or {}).items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        out[key] = merged
    out["patches"] = list(variant.get("patches") or []) + [p for p in overrides.get("patches") or []
                                                          if p not in (variant.get("patches") or [])]
    out["name"] = name
    out["when"] = list(variant.get("when") or [])
    if source:
        out["source"] = source
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "x"


def point_trial(camp_name: str, space: "search.Space", point: dict, tid: str, label: str) -> Trial:
    """A sampled point of a space as a trial, layered like a grid point."""
    overrides = {"server_args": dict(space.fixed.get("server_args") or {}), "env": dict(space.fixed.get("env") or {}),
                 "patches": list(space.fixed.get("patches") or [])}
    for (section, key), value in point.items():
        overrides[section][key] = value
    overrides["source"] = space.source
    return Trial(tid, label, _layer(space.variant, overrides, f"{camp_name}-{tid}", f"campaigns/{camp_name}.yml trial {tid}"),
                 overrides)


def expand(path: Path, name: str, data: dict, spaces: list | None = None) -> list[Trial]:
    """Trial 'base' first, then every candidate (each grid point its own trial). With `spaces`
    (search: random / tpe) a grid candidate becomes a search.Space appended there instead."""
    from .patchstore import find_patch

    common = data.get("overrides") or {}
    base = _layer(load_variant(data["base"]), common, data["base"])
    trials = [Trial("base", f"base ({data['base']})", _layer(base, {}, f"{name}-base", f"campaigns/{name}.yml trial base"))]
    seen = {"base"}
    for i, cand in enumerate(data.get("candidates") or []):
        where = f"candidates[{i}]"
        if not any(k in cand for k in ("variant", "grid", "server_args", "env", "patches")):
            raise _fail(path, where, "give a variant, a grid, or server_args/env/patches overrides")
        src_name = cand.get("variant") or data["base"]
        src = _layer(load_variant(src_name), common, src_name)
        for p in cand.get("patches") or []:
            find_patch(p)
        grid = cand.get("grid") or {}
        axes = [(section, key, values) for section in ("server_args", "env") for key, values in (grid.get(section) or {}).items()]
        if spaces is not None and axes:
            label0 = _slug(cand.get("name") or f"c{i + 1}")
            if label0 in {s.name for s in spaces}:
                raise _fail(path, f"{where}.name", f"{label0!r} names two candidates")
            spaces.append(search.Space(label0, src_name, src, {k: cand.get(k) for k in ("server_args", "env", "patches")},
                                       [search.parse_axis(s_, k_, v_) for s_, k_, v_ in axes]))
            continue
        parsed = []
        for section, key, values in axes:
            axis = search.parse_axis(section, key, values)
            vals = axis.values()
            if vals is None:
                raise _fail(path, f"{where}.grid.{section}.{key}", "a range needs a step under search: grid (or "
                            "use search: random / tpe to sample it)")
            parsed.append((section, key, vals))
        axes = parsed
        points = 1
        for _section, _key, values in axes:
            points *= len(values)
        if len(trials) + points > MAX_TRIALS:  # before expanding: a grid of 10^7 points is refused, not built
            raise _fail(path, f"{where}.grid", f"expands to {points:,} trials; a campaign holds at most {MAX_TRIALS:,}")
        label0 = cand.get("name") or (cand.get("variant") if not axes else f"c{i + 1}")
        combos = itertools.product(*[values for _s, _k, values in axes]) if axes else [()]
        for combo in combos:
            overrides = {"server_args": dict(cand.get("server_args") or {}), "env": dict(cand.get("env") or {}),
                         "patches": list(cand.get("patches") or [])}
            parts = []
            for (section, key, _values), value in zip(axes, combo):
                overrides[section][key] = value
                parts.append(f"{key}={value}")
            label = label0 + (f" [{', '.join(parts)}]" if parts else "")
            tid = _slug(label0 + ("-" + "-".join(str(v) for v in combo) if combo else ""))
            n, base_id = 2, tid
            while tid in seen:
                tid, n = f"{base_id}-{n}", n + 1
            seen.add(tid)
            overrides["source"] = src_name
            trials.append(Trial(tid, label, _layer(src, overrides, f"{name}-{tid}", f"campaigns/{name}.yml trial {tid}"),
                                overrides))
    return trials


REPO_ROOT = Path(__file__).resolve().parent.parent


def _dataset_path(path: Path, written: str) -> Path:
    """A campaign's bench.dataset_path: its rows are shipped to the host as prompts, so a campaign
    file may name only a dataset beside it (relative to its directory), in the repository, or in
    a directory the operator lists in SERVOPS_DATASET_DIRS -- never ~/.ssh/id_ed25519 or
    /proc/self/environ. No hidden file or directory on the way; symlinks are resolved first."""
    p = Path(written).expanduser()
    p = (p if p.is_absolute() else path.resolve().parent / p).resolve()
    roots = [path.resolve().parent, REPO_ROOT] + [Path(d).expanduser().resolve()
                                                 for d in os.environ.get("SERVOPS_DATASET_DIRS", "").split(":") if d]
    for root in roots:
        try:
            rel = p.relative_to(root)
        except ValueError:
            continue
        if not any(part.startswith(".") for part in rel.parts):
            return p
    raise _fail(path, "bench.dataset_path", f"{written!r} is outside the campaign's directory and the repository "
                "(or under a hidden directory); put the dataset there, or list its directory in SERVOPS_DATASET_DIRS")


def load_campaign(name_or_path: str) -> Campaign:
    path = Path(name_or_path)
    if not path.suffix:
        if not NAME.fullmatch(name_or_path):
            raise CampaignError(f"campaign {name_or_path!r}: give a name under campaigns/ or a .yml path")
        path = CAMPAIGN_ROOT / f"{name_or_path}.yml"
    if not path.is_file():
        names = sorted(p.stem for p in CAMPAIGN_ROOT.glob("*.yml"))
        raise CampaignError(f"campaign {name_or_path!r}: no {path}{did_you_mean(name_or_path, names)} (known: "
                            f"{', '.join(names) or 'none'})")
    data = load_mapping(path, CAMPAIGN, CampaignError)
    for key in ("base", "bench", "objective"):
        if key not in data:
            raise _fail(path, key, "is required")
    bench = dict(data["bench"])
    if bench.get("dataset_path"):
        bench["dataset_path"] = str(_dataset_path(path, bench["dataset_path"]))
    if "levels" not in bench:
        raise _fail(path, "bench.levels", "is required, e.g. [1, 10, 256, 1024]")
    if bench.get("slo"):
        try:
            parse_slo(bench["slo"])
        except ServopsError as exc:
            raise _fail(path, "bench.slo", str(exc)) from None
    levels = bench["levels"]
    objective = _objective(path, data["objective"], levels)
    constraints = _constraints(path, data["objective"].get("constraints") or [], levels, bench.get("slo"))
    name = path.stem
    if not NAME.fullmatch(name):
        raise CampaignError(f"{path}: the file name must be letters, digits, '.', '_' or '-'")
    strategy = data.get("search", "grid")
    spaces: list | None = None if strategy == "grid" else []
    if "seed" in data and strategy == "grid":
        raise _fail(path, "seed", "only search: random or tpe samples; a grid runs every point in order")
    try:
        trials = expand(path, name, data, spaces)
    except ServopsError as exc:
        text = str(exc)
        raise CampaignError(text if text.startswith(f"{path}: ") else f"{path}: {text}") from None
    budget = data.get("budget") or {}
    if spaces is not None:
        if not spaces:
            raise _fail(path, "search", f"search: {strategy} samples the candidates' grid: spaces, and none has one")
        if not budget.get("max_trials") and not budget.get("max_wall_time"):
            raise _fail(path, "budget", f"search: {strategy} runs until its budget: give budget.max_trials "
                        "(or max_wall_time)")
    return Campaign(name=name, path=path, data=data, base=data["base"], trials=trials, bench=bench,
                    objective=objective, constraints=constraints,
                    min_gain=parse_gain(data["objective"]["min_gain"]) if "min_gain" in data["objective"] else None,
                    max_trials=budget.get("max_trials"),
                    max_wall_s=seconds(budget["max_wall_time"]) if budget.get("max_wall_time") else None,
                    auto_patch=bool(data.get("auto_patch", False)), leave=data.get("leave", "best"),
                    drift_after_s=seconds(data["drift_check_after"]) if data.get("drift_check_after") else None,
                    search=strategy, seed=data.get("seed"), spaces=spaces or [],
                    start_constraints=start_conditions(data["objective"].get("constraints") or []),
                    max_repeats=data["objective"].get("max_repeats", 1),
                    confidence=parse_gain(data["objective"].get("confidence", 0.8)),
                    rebench_top=data["objective"].get("rebench_top", 3),
                    repeat_by=data["objective"].get("repeat_by", "rebench"))
