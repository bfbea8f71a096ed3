"""The engine room: what servops knows about each inference server it drives.

One module per engine (sglang.py, vllm.py) holds that engine's facts: its launch module and
template, the host program that checks a launch with the engine's own parser, the distribution
names its version is read from, its health and readiness endpoints, its Prometheus metric names
(mapped to servops' engine-neutral keys), the request the bench sends, and the names of the
processes its server tree holds. A variant names its engine (`engine: vllm`; default sglang).

A new engine is one new room plus its tests; nothing else is edited. It supplies:

1. `servops/engines/<name>.py` with `ENGINE = Engine(...)` (base.py names each field): the
   launch module and the template under templates/ that writes its launch script; the
   distributions its version is read from (their order is the lookup order); its health gate
   (endpoint, model-info endpoint, a first real request where the server can die only then);
   its Prometheus names for servops' gauges/histograms/counters keys (metrics, bench and the
   tune gate read only the keys); the bench's request shape; its server tree's process names
   (what `stop` must see gone); the launch env every start gets; the log lines that mean its
   server is dead; the server arg naming the model; the host var that overrides its module.
2. A host-side parser adapter, `servops/remote/launch_check_<name>.py` (stdlib only, shipped
   alone, one JSON reply), named by `check_program`: it imports the host's engine and parses the
   launch argv with the engine's own parser (a static read of its source where it does not
   import), and reports version, flags and facts in launch_check.py's reply shape. Host programs
   cannot import this package: the metric names remote/loadgen.py reads on the host are copies
   (OTHER_NAMES maps sglang's to the other engine's), tested equal to the rooms' (test_engines).
3. An entry in ENGINES below. Version rules (`when:` keyed `<name>: <specifier>`) and every verb
   then take it by that name: playbooks.ENGINE_KEYS is ENGINES' keys.
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
