"""A server's start-up as servops shows and keeps it: the phases the engine's log timed
(servops/remote/startlog.py reads them on the host, in the health gate), one line of text, and
which phase grew beyond its noise against the previous start. Pure."""

from __future__ import annotations

from .remote.startlog import MAX_PHASE_S, START_PHASES

NAMES = {"weights_s": "weights", "jit_s": "JIT", "compile_s": "compile", "capture_s": "capture", "other_s": "other"}
KEEP = 10                # starts a release keeps in release.json (its own history of start-ups)
FLOOR_S, FLOOR_REL = 1.0, 0.10  # a phase's noise: 1 s (whole-second log timestamps) or 10% of its last value


def clean(start) -> dict:
    """A start as a host reported it (or a history file kept it), its phases numbers only: anything
    else, and a time no start spends (negative, NaN, past a week), is dropped, never shown."""
    if not isinstance(start, dict):
        return {}
    return {k: float(v) for k, v in start.items() if k in (*START_PHASES, "other_s", "start_s")
            and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_PHASE_S}


def text(start: dict) -> str:
    """`start to healthy 35.2s (weights 3.0s, capture 12.1s, other 20.1s; not in the log: JIT,
    compile)`: the phases shown, then those the log did not show (a start without a total, a
    phase list alone)."""
    shown = ", ".join(f"{NAMES[k]} {start[k]:.1f}s" for k in NAMES if start.get(k) is not None)
    missing = [NAMES[k] for k in START_PHASES if start.get(k) is None] if "other_s" in start else []
    head = f"start to healthy {start['start_s']:.1f}s" if "start_s" in start else "start-up"
    inner = "; ".join(p for p in (shown, "not in the log: " + ", ".join(missing) if missing else "") if p)
    return head + (f" ({inner})" if inner else "")


def noise(previous: float) -> float:
    """How far a phase may move from one start to the next and still be noise: 1 s (the logs'
    timestamps are whole seconds) or 10% of what it took before, whichever is larger."""
    return max(FLOOR_S, FLOOR_REL * previous)


def grown(start: dict, previous: dict | None) -> list[str]:
    """Each phase of `start` that grew beyond its noise against the `previous` start:
    `JIT 0.0s -> 12.3s (+12.3s; noise 1.0s)`. A phase the previous start's log did not show
    counts from 0 where that start had a total (it spent nothing there that the log saw)."""
    if not previous:
        return []
    out = []
    for key in (*START_PHASES, "other_s"):
        now, was = start.get(key), previous.get(key)
        if now is None or (was is None and "other_s" not in previous):
            continue
        was = was or 0.0
        if now - was > noise(was):
            out.append(f"{NAMES[key]} {was:.1f}s -> {now:.1f}s (+{now - was:.1f}s; noise {noise(was):.1f}s)")
    return out


def kept(before: list[dict], start: dict) -> list[dict]:
    """A release's recorded starts with `start` added, the last KEEP."""
    return ([clean(s) for s in before if isinstance(s, dict)] + [start])[-KEEP:]


def compared(before: dict | None, release: str) -> tuple[dict | None, list[dict], str]:
    """From the health gate's `before` (the earlier starts of the release itself, else of the
    release it replaces): the previous start a new one is judged against, the release's own
    starts to keep, and how the line names the previous one."""
    before = before if isinstance(before, dict) else {}
    starts = [clean(s) for s in before.get("starts") or [] if isinstance(s, dict)] \
        if isinstance(before.get("starts"), list) else []
    own = before.get("release") == release
    if not starts:
        return None, [], ""
    return starts[-1], starts if own else [], "its previous start" if own else f"{before.get('release')}'s last start"
