"""Metric gates for deploy: `output_tps@1024 >= 1.02*baseline`, Argo Rollouts-style analysis.

Grammar (terms joined by ',' or 'and'):
    METRIC@LEVEL OP NUMBER                 e.g. p99_ttft_ms@256 <= 500, goodput@256 >= 0.95
    METRIC@LEVEL OP [FACTOR*]VARIANT       VARIANT's latest saved bench on the same host
    error_rate[@LEVEL] <= FRACTION         failed requests allowed (default 0 at every gate level)
    slo(ttft:500,tpot:50)                  the SLO (ms) `goodput` is measured against
OP is >=, <=, > or <. METRIC is a summary name (output_tps, request_rate, ttft_p99, tpot_p50,
itl_p99, e2e_p50, goodput, ...) or bench_serving's key for it (output_throughput, p99_ttft_ms,
median_tpot_ms, slo_attainment, ...). `goodput` is the share of requests that met every SLO.

Failed requests fail the gate: each gate level gets an implicit `error_rate@LEVEL <= 0` unless a
term sets the allowed rate. With repeated runs (bench --repeat N) a comparison with a variant is
noise-aware: it passes only when the 95% interval of the difference (Welch) clears it; absolute
terms compare the mean.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

from .bench import LATENCIES, METRICS as SUMMARY_METRICS, STAT_NAMES, BenchError, parse_slo, t975
from .errors import ServopsError

OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
ALIASES = {"output_throughput": "output_tps", "request_throughput": "request_rate", "input_throughput": "input_tps",
           "total_throughput": "total_tps", "slo_attainment": "goodput", "concurrency": "achieved_concurrency",
           "errors": "error_rate"}
for _lat, _long in zip(LATENCIES, ("ttft", "tpot", "itl", "e2e_latency")):
    for _stat, _prefix in zip(STAT_NAMES, ("mean", "median", "std", "p90", "p95", "p99")):
        ALIASES[f"{_prefix}_{_long}_ms"] = f"{_lat}_{_stat}"
        ALIASES[f"{_lat}_median"] = f"{_lat}_p50"
METRICS = tuple(SUMMARY_METRICS)
HIGHER_IS_BETTER = {"output_tps", "request_rate", "input_tps", "total_tps", "max_output_tokens_per_s", "goodput",
                    "request_goodput", "achieved_concurrency"}

_NUM = r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_COND = re.compile(
    r"^\s*(?P<metric>[a-z_0-9]+)\s*(?:@\s*(?P<level>-?\d{1,9})\s*)?(?P<op>>=|<=|>|<)\s*"
    rf"(?:(?P<number>{_NUM})\s*$|(?:(?P<factor>{_NUM})\s*\*\s*)?(?P<ref>[A-Za-z][A-Za-z0-9._-]*)\s*$)")
_SLO = re.compile(r"\bslo\s*\(([^)]*)\)")
EXAMPLE = "e.g. --gate 'output_tps@1024 >= 1.02*baseline, p99_ttft_ms@256 <= 500'"


class GateError(ServopsError):
    pass


@dataclass(frozen=True)
class Condition:
    metric: str                 # the summary name
    level: int | None           # None: every gate level (error_rate only)
    op: str
    number: float | None = None
    factor: float = 1.0
    ref: str | None = None
    written: str | None = None  # the metric as the user wrote it
    implicit: bool = False      # the default error_rate@LEVEL <= 0

    def __str__(self) -> str:
        rhs = f"{self.number:g}" if self.ref is None else (f"{self.factor:g}*{self.ref}" if self.factor != 1 else self.ref)
        at = "" if self.level is None else f"@{self.level}"
        return f"{self.written or self.metric}{at} {self.op} {rhs}"


class Gate(list):
    """The parsed conditions (a list, as before) and the SLO the bench must measure goodput with."""

    slo: dict | None = None


MAX_GATE_CHARS = 100_000  # a gate is a handful of terms (a campaign adds one per level)


def parse_gate(text: str) -> Gate:
    if not text or not text.strip():
        raise GateError(f"--gate is empty; {EXAMPLE}")
    if len(text) > MAX_GATE_CHARS:
        raise GateError(f"--gate is {len(text):,} characters long; at most {MAX_GATE_CHARS:,}: {EXAMPLE}")
    conds = Gate()
    slo_terms = _SLO.findall(text)
    if len(slo_terms) > 1:
        raise GateError("--gate: give slo(...) once, e.g. slo(ttft:500,tpot:50)")
    if slo_terms:
        try:
            conds.slo = parse_slo(slo_terms[0])
        except BenchError as exc:
            raise GateError(f"--gate slo({slo_terms[0]}): {str(exc).split(': ', 1)[-1]}") from None
        if not conds.slo:
            raise GateError("--gate slo(): give at least one SLO, e.g. slo(ttft:500,tpot:50)")
        text = _SLO.sub("", text)
    for part in re.split(r",|(?<=\s)and(?=\s)", text.strip()):  # linear: no backtracking over long blanks
        if not part.strip():
            continue
        m = _COND.match(part)
        if not m:
            shown = part.strip() if len(part.strip()) <= 120 else part.strip()[:120] + "..."
            raise GateError(f"--gate {shown!r}: expected METRIC@LEVEL OP VALUE; {EXAMPLE}")
        written = m["metric"]
        metric = ALIASES.get(written, written)
        if metric not in METRICS:
            raise GateError(f"--gate {part!r}: unknown metric {written!r} (known: {', '.join(METRICS)}; "
                            "or bench_serving's keys such as p99_ttft_ms, output_throughput)")
        level = None if m["level"] is None else int(m["level"])
        if level is None and metric != "error_rate":
            raise GateError(f"--gate {part!r}: give the level, e.g. {written}@1024")
        if level is not None and level < 1:
            raise GateError(f"--gate {part!r}: level {level}: levels are concurrencies, 1 or more")
        if m["number"] is not None:
            c = Condition(metric, level, m["op"], number=float(m["number"]), written=written)
        else:
            c = Condition(metric, level, m["op"], factor=float(m["factor"] or 1), ref=m["ref"], written=written)
        if not (math.isfinite(c.factor) and (c.number is None or math.isfinite(c.number))):
            raise GateError(f"--gate {part!r}: {m['number'] or m['factor']} is not a finite number")
        if metric == "error_rate" and (c.ref is not None or c.op not in ("<=", "<") or not 0 <= c.number <= 1):
            raise GateError(f"--gate {part!r}: allowed failures are error_rate <= FRACTION (0 to 1), e.g. error_rate <= 0.01")
        conds.append(c)
    if not any(c.level is not None for c in conds):
        raise GateError(f"--gate {text.strip()!r}: no term names a level to bench; {EXAMPLE}")
    if any(c.metric in ("goodput", "request_goodput") for c in conds) and not conds.slo:
        raise GateError("--gate: goodput needs the SLO it is measured against: add slo(ttft:500,tpot:50)")
    return conds


def gate_levels(conds: list[Condition]) -> list[int]:
    return sorted({c.level for c in conds if c.level is not None})


def bench_options(conds: list[Condition]) -> dict:
    """Options the gate's bench needs (merge into run_bench's keyword arguments): the SLO."""
    slo = getattr(conds, "slo", None)
    return {"slo": dict(slo)} if slo else {}


def validate(conds: list[Condition], host_name: str, known_variants) -> None:
    """Everything that can be checked before a deploy touches the host; raises GateError.

    known_variants: the variant names that have playbooks."""
    if not conds:
        raise GateError(f"--gate is empty; {EXAMPLE}")
    from .bench import latest_for_variant

    known = set(known_variants or ())
    for c in conds:
        if c.level is not None and c.level < 1:
            raise GateError(f"--gate {c}: level {c.level}: levels are concurrencies, 1 or more")
        if c.ref is None:
            continue
        if c.ref not in known:
            raise GateError(f"--gate {c}: no variant {c.ref!r} (no playbooks/{c.ref}.yml)")
        saved = latest_for_variant(host_name, c.ref)
        if saved is None:
            raise GateError(f"--gate {c}: no saved bench of variant {c.ref!r} on {host_name}; "
                            f"deploy {c.ref} and run invoke bench -H {host_name} first")
        if not _level(saved, c.level):
            have = ", ".join(str(lv["concurrency"]) for lv in saved.get("levels", []))
            raise GateError(f"--gate {c}: the saved bench of {c.ref!r} on {host_name} has no level {c.level} "
                            f"(it has {have or 'none'})")


def _level(result: dict, level: int) -> dict | None:
    return next((lv for lv in result.get("levels", []) if lv.get("concurrency") == level), None)


def _samples(lv: dict, metric: str) -> list[float] | None:
    samples = (lv.get("samples") or {}).get(metric)
    if samples:
        return [float(x) for x in samples]
    v = lv.get(metric)
    if v is None and metric == "error_rate" and lv.get("requests"):
        v = lv.get("failed", 0) / lv["requests"]
    return None if v is None else [float(v)]


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def _var(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def with_error_terms(conds: list[Condition]) -> list[Condition]:
    """The conditions plus an implicit `error_rate@L <= 0` for each gate level not given a rate."""
    out = list(conds)
    global_rate = [c for c in conds if c.metric == "error_rate" and c.level is None]
    for level in gate_levels(conds):
        if any(c.metric == "error_rate" and c.level == level for c in conds):
            continue
        if global_rate:
            g = global_rate[-1]
            out.append(Condition("error_rate", level, g.op, number=g.number, written="error_rate", implicit=True))
        else:
            out.append(Condition("error_rate", level, "<=", number=0.0, written="error_rate", implicit=True))
    return [c for c in out if c.level is not None]


@dataclass(frozen=True)
class Verdict:
    """One condition held against a result: whether it holds, the detail shown in parentheses,
    and what it was measured at (None: nothing to measure)."""
    cond: Condition
    ok: bool
    detail: str
    actual: float | None = None
    shown: str = ""             # the measurement as a violation shows it: '742.2', '3 of 16 requests'
    bound: str = ""             # the right-hand side as evaluated: '300', '1.02*base = 918.0'


NEGATED = {">=": "<", "<=": ">", ">": "<=", "<": ">="}
SINGLE_RUN = "single run: no noise estimate"


def verdicts(conds: list[Condition], result: dict, lookup) -> list[Verdict]:
    """lookup(variant) -> saved result or None. One Verdict per condition (implicit error terms included)."""
    return [_check(c, result, lookup) for c in with_error_terms(conds)]


def evaluate(conds: list[Condition], result: dict, lookup) -> tuple[bool, list[str]]:
    """lookup(variant) -> saved result or None. Returns (passed, one line per condition)."""
    vs = verdicts(conds, result, lookup)
    return all(v.ok for v in vs), [f"{'pass' if v.ok else 'FAIL'}: {v.cond} ({v.detail})" for v in vs]


def violation(v: Verdict) -> str:
    """What failed, as a measurement against its bound: `p99_ttft_ms@256 = 742.2 > 300`."""
    c = v.cond
    if v.actual is None:
        return f"{c}: {v.detail}"
    name = "failed" if c.metric == "error_rate" else c.written or c.metric
    return f"{name}@{c.level} = {v.shown} {NEGATED[c.op]} {v.bound}"


_THROUGHPUT = {"output_tps": "tok/s", "input_tps": "tok/s", "total_tps": "tok/s", "max_output_tokens_per_s": "tok/s",
               "request_rate": "req/s", "request_goodput": "req/s"}


def unit(metric: str) -> str:
    if metric in _THROUGHPUT:
        return _THROUGHPUT[metric]
    if metric.split("_")[0] in LATENCIES:
        return "ms"
    return ""


def num(value: float, metric: str = "") -> str:
    """A plain number (never 4e+04), with the metric's unit: '40,123 tok/s', '512.3 ms', '0.95'."""
    mag = abs(value)
    text = (f"{value:,.0f}" if mag >= 1000 else f"{value:.1f}" if mag >= 10 else f"{value:.3g}" if mag >= 0.001
            else f"{value:.6f}".rstrip("0").rstrip(".") or "0")
    u = unit(metric)
    return f"{text} {u}" if u else text


def _check(c: Condition, result: dict, lookup) -> Verdict:
    lv = _level(result, c.level)
    if lv is None:
        why = result.get("stopped") or "the bench did not reach it"
        return Verdict(c, False, f"no result at level {c.level}: {why}")
    if c.metric == "error_rate":
        rate = lv.get("failed", 0) / lv["requests"] if lv.get("requests") else 0.0
        errors = lv.get("errors") or {}
        top = max(errors.items(), key=lambda kv: kv[1])[0][:120] if errors else ""
        failed = f"{lv.get('failed', 0)} of {lv.get('requests', 0)} requests"
        return Verdict(c, OPS[c.op](rate, c.number), f"{failed} failed = {num(rate)}" + (f"; e.g. {top}" if top else ""),
                       rate, f"{num(rate * 100)}%" if c.number else failed,
                       f"{c.number * 100:g}%" if c.number else "0")
    mine = _samples(lv, c.metric)
    if mine is None:
        hint = " (bench ran without an SLO: add slo(...) to the gate)" if c.metric in ("goodput", "request_goodput") else ""
        return Verdict(c, False, f"this run has no {c.written or c.metric} at level {c.level}{hint}")
    if c.ref is None:
        actual = _mean(mine)
        ci = (lv.get("ci95") or {}).get(c.metric)
        spread = f" ±{num((ci[1] - ci[0]) / 2)}" if ci else ""
        return Verdict(c, OPS[c.op](actual, c.number), f"{num(actual, c.metric)}{spread} {c.op} {num(c.number, c.metric)}",
                       actual, num(actual) + spread, f"{c.number:g}")
    ref = lookup(c.ref)
    if ref is None:
        raise GateError(f"gate: no saved bench of variant {c.ref!r} on {result.get('host')}; deploy and bench {c.ref} first")
    rlv = _level(ref, c.level)
    theirs = None if rlv is None else _samples(rlv, c.metric)
    if theirs is None:
        raise GateError(f"gate: the saved bench of variant {c.ref!r} has no {c.written or c.metric} at level {c.level}")
    a, b, f = _mean(mine), _mean(theirs), c.factor
    diff = a - f * b
    va, vb = _var(mine) / len(mine), f * f * _var(theirs) / len(theirs)
    half = 0.0
    if va + vb > 0:
        denom = (va * va / (len(mine) - 1) if len(mine) > 1 else 0.0) + (vb * vb / (len(theirs) - 1) if len(theirs) > 1 else 0.0)
        df = (va + vb) ** 2 / denom if denom else math.inf
        half = t975(df) * math.sqrt(va + vb)
    target = f * b
    if c.op in (">=", ">"):
        ok = OPS[c.op](diff - half, 0.0)
    else:
        ok = OPS[c.op](diff + half, 0.0)
    text = f"{num(a, c.metric)} {c.op} {f:g}*{num(b)}={num(target, c.metric)}"
    if half:
        text += (f"; difference {'+' if diff >= 0 else ''}{num(diff, c.metric)} ±{num(half)} "
                 f"(95%, n={len(mine)} vs {len(theirs)})"
                 + ("" if ok else ": the interval does not clear it"))
    elif len(mine) < 2 and len(theirs) < 2:
        text += f"; {SINGLE_RUN}"
    rhs = (f"{f:g}*{c.ref}" if f != 1 else c.ref) + f" = {num(target)}"
    return Verdict(c, ok, text, a, num(a) + (f" ±{num(half)}" if half else ""), rhs)
