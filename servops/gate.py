"""Metric gates for deploy: `output_tps@1024 >= 1.02*baseline`, Argo Rollouts-style analysis.

Grammar (conditions joined by ',' or 'and'):
    METRIC@LEVEL OP NUMBER
    METRIC@LEVEL OP [FACTOR*]VARIANT      VARIANT's latest saved bench on the same host
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from .errors import ServopsError

METRICS = ("output_tps", "request_rate", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99")
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_COND = re.compile(
    r"^\s*(?P<metric>[a-z_0-9]+)\s*@\s*(?P<level>\d+)\s*(?P<op>>=|<=|>|<)\s*"
    r"(?:(?P<number>\d+(?:\.\d+)?)\s*$|(?:(?P<factor>\d+(?:\.\d+)?)\s*\*\s*)?(?P<ref>[A-Za-z][A-Za-z0-9._-]*)\s*$)")


class GateError(ServopsError):
    pass


@dataclass(frozen=True)
class Condition:
    metric: str
    level: int
    op: str
    number: float | None = None
    factor: float = 1.0
    ref: str | None = None

    def __str__(self) -> str:
        rhs = f"{self.number:g}" if self.ref is None else (f"{self.factor:g}*{self.ref}" if self.factor != 1 else self.ref)
        return f"{self.metric}@{self.level} {self.op} {rhs}"


def parse_gate(text: str) -> list[Condition]:
    if not text or not text.strip():
        raise GateError("--gate is empty; e.g. --gate 'output_tps@1024 >= 1.02*baseline'")
    conds = []
    for part in re.split(r"\s*,\s*|\s+and\s+", text.strip()):
        m = _COND.match(part)
        if not m:
            raise GateError(f"--gate {part!r}: expected METRIC@LEVEL OP VALUE, e.g. output_tps@1024 >= 1.02*baseline")
        if m["metric"] not in METRICS:
            raise GateError(f"--gate {part!r}: unknown metric {m['metric']!r} (known: {', '.join(METRICS)})")
        if m["number"] is not None:
            conds.append(Condition(m["metric"], int(m["level"]), m["op"], number=float(m["number"])))
        else:
            conds.append(Condition(m["metric"], int(m["level"]), m["op"], factor=float(m["factor"] or 1), ref=m["ref"]))
    return conds


def gate_levels(conds: list[Condition]) -> list[int]:
    return sorted({c.level for c in conds})


def _value(result: dict, metric: str, level: int, what: str):
    for l in result.get("levels", []):
        if l["concurrency"] == level:
            v = l.get(metric)
            if v is None:
                raise GateError(f"gate: {what} has no {metric} at concurrency {level}")
            return float(v)
    raise GateError(f"gate: {what} has no result at concurrency {level}")


def evaluate(conds: list[Condition], result: dict, lookup) -> tuple[bool, list[str]]:
    """lookup(variant) -> saved result or None. Returns (passed, one line per condition)."""
    lines, passed = [], True
    for c in conds:
        actual = _value(result, c.metric, c.level, f"this run ({result.get('variant')})")
        if c.ref is None:
            target = c.number
            ref_text = f"{target:g}"
        else:
            ref = lookup(c.ref)
            if ref is None:
                raise GateError(f"gate: no saved bench of variant {c.ref!r} on {result.get('host')}; "
                                f"deploy and bench {c.ref} first")
            base = _value(ref, c.metric, c.level, f"variant {c.ref}")
            target = c.factor * base
            ref_text = f"{c.factor:g}*{base:.3g}={target:.3g}"
        ok = OPS[c.op](actual, target)
        passed &= ok
        lines.append(f"{'pass' if ok else 'FAIL'}: {c} ({actual:.3g} {c.op} {ref_text})")
    return passed, lines


def validate(conds: list[Condition], host: str) -> None:
    """What can be checked before a deploy touches the host: levels, and that every reference
    variant has a playbook and a saved bench on this host."""
    from .bench import latest_for_variant
    from .playbooks import load_variant

    for c in conds:
        if c.level < 1:
            raise GateError(f"--gate {c}: the level (concurrency) must be 1 or more")
        if c.ref is not None:
            load_variant(c.ref)
            if latest_for_variant(host, c.ref) is None:
                raise GateError(f"--gate {c}: no saved bench of variant {c.ref!r} on {host}; "
                                f"deploy and bench {c.ref} first")
