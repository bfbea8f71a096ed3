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


def metric_names(kind: str, key: str) -> list[str]:
    """Each engine's metric name for servops' `key` (default engine first); `kind` is gauges,
    histograms or counters."""
    order = [ENGINES[DEFAULT]] + [e for n, e in ENGINES.items() if n != DEFAULT]
    return [getattr(e, kind)[key] for e in order if key in getattr(e, kind)]


__all__ = ["Engine", "ENGINES", "EngineError", "get", "of_variant", "metric_names"]
