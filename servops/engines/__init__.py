"""The engine room: what servops knows about each inference server it drives.

One module per engine (sglang.py, vllm.py) holds that engine's facts: its launch module and
template, the host program that checks a launch with the engine's own parser, the distribution
names its version is read from, its health and readiness endpoints, its Prometheus metric names
(mapped to servops' engine-neutral keys), the request the bench sends, and the names of the
processes its server tree holds. A variant names its engine (`engine: vllm`; default sglang).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import ServopsError
from . import sglang, vllm
from .base import Engine

ENGINES: dict[str, Engine] = {e.name: e for e in (sglang.ENGINE, vllm.ENGINE)}
DEFAULT = "sglang"


class EngineError(ServopsError):
    pass


def get(name: str | None) -> Engine:
    key = str(name or DEFAULT)
    if key not in ENGINES:
        raise EngineError(f"engine {key!r} is not one servops drives (known: {', '.join(sorted(ENGINES))})")
    return ENGINES[key]


def of_variant(variant: Mapping[str, Any]) -> Engine:
    """The engine a variant names (sglang when it names none)."""
    return get(variant.get("engine"))


def metric_aliases(kind: str) -> dict[str, list[str]]:
    """servops key -> the metric names the engines OTHER than sglang report for it (sglang's own
    names stay in servops.metrics); `kind` is gauges, histograms or counters."""
    out: dict[str, list[str]] = {}
    for engine in ENGINES.values():
        if engine.name == DEFAULT:
            continue
        for key, name in getattr(engine, kind).items():
            out.setdefault(key, []).append(name)
    return out


__all__ = ["Engine", "ENGINES", "EngineError", "get", "of_variant", "metric_aliases"]
