"""A server's start-up as servops shows and keeps it: the phases the engine's log timed
(servops/remote/startlog.py reads them on the host, in the health gate), one line of text, and
which phase grew beyond its noise against the release's earlier starts. Pure."""

from __future__ import annotations

import statistics

from .remote.startlog import START_PHASES

NAMES = {"weights_s": "weights", "jit_s": "JIT", "compile_s": "compile", "capture_s": "capture", "other_s": "other"}
KEEP = 10                # starts a release keeps in release.json (its own history of start-ups)
FLOOR_S, FLOOR_REL = 1.0, 0.10  # noise at least 1 s (the logs' timestamps are whole seconds) and 10%


def clean(start) -> dict:
    """A start as a host reported it, its phases numbers only (anything else is dropped, never shown)."""
    if not isinstance(start, dict):
        return {}
    return {k: float(v) for k, v in start.items() if k in (*START_PHASES, "other_s", "start_s")
            and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) < 1e9}


def text(start: dict) -> str:
    """`start to healthy 35.2s (weights 3.0s, capture 12.1s, other 20.1s; not in the log: JIT,
    compile)`: the phases shown, then those the log did not show (a start without a total, a
    phase list alone)."""
    shown = ", ".join(f"{NAMES[k]} {start[k]:.1f}s" for k in NAMES if start.get(k) is not None)
    missing = [NAMES[k] for k in START_PHASES if start.get(k) is None] if "other_s" in start else []
    head = f"start to healthy {start['start_s']:.1f}s" if "start_s" in start else "start-up"
    inner = "; ".join(p for p in (shown, "not in the log: " + ", ".join(missing) if missing else "") if p)
    return head + (f" ({inner})" if inner else "")


def noise(values: list[float]) -> float:
    """How far a phase may move between starts and still be noise: twice the spread of the
    earlier starts, at least FLOOR_S and FLOOR_REL of their mean."""
    mean = statistics.fmean(values)
    spread = 2 * statistics.stdev(values) if len(values) > 1 else 0.0
    return max(FLOOR_S, FLOOR_REL * mean, spread)


def grown(start: dict, before: list[dict]) -> list[str]:
    """Each phase of `start` that grew beyond its noise against the earlier starts `before`
    (oldest first): `JIT 0.0s -> 12.3s (+12.3s; noise 1.0s over 3 starts)`. A phase none of them
    showed counts from 0 when they had a total (they spent nothing there that the log saw)."""
    out = []
    for key in (*START_PHASES, "other_s"):
        now = start.get(key)
        if now is None:
            continue
        was = [b[key] if b.get(key) is not None else 0.0 for b in before if b.get(key) is not None or "other_s" in b]
        if not was:
            continue
        mean, limit = statistics.fmean(was), noise(was)
        if now - mean > limit:
            out.append(f"{NAMES[key]} {mean:.1f}s -> {now:.1f}s (+{now - mean:.1f}s; noise {limit:.1f}s over "
                       f"{len(was)} start{'s' if len(was) > 1 else ''})")
    return out


def kept(before: list[dict], start: dict) -> list[dict]:
    """A release's recorded starts with `start` added, the last KEEP."""
    return ([clean(s) for s in before if isinstance(s, dict)] + [start])[-KEEP:]


def compared(before: dict | None, release: str) -> tuple[list[dict], str]:
    """The earlier starts a new one is judged against (the health gate's `before`: the release's
    own, else the release it replaces) and how the line names them."""
    before = before if isinstance(before, dict) else {}
    starts = [clean(s) for s in before.get("starts") or [] if isinstance(s, dict)] \
        if isinstance(before.get("starts"), list) else []
    if not starts:
        return [], ""
    whose = "its earlier starts" if before.get("release") == release else f"{before.get('release')}'s last start"
    return (starts if before.get("release") == release else starts[-1:]), whose
