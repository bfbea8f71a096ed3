"""A server's start-up as servops shows and keeps it: the phases the engine's log timed
(servops/remote/startlog.py reads them on the host, in the health gate), one line of text, and
which phase grew beyond its noise against the previous start. Pure."""

from __future__ import annotations

from .remote.startlog import MAX_PHASE_S, START_PHASES

NAMES = {"weights_s": "weights", "jit_s": "JIT", "compile_s": "compile", "capture_s": "capture", "other_s": "other"}
# where the log times no JIT build, the health gate reads the JIT caches (cache_ledger.note_jit_builds):
# how many builds their new files show and their seconds, which lie within other_s
BY_FILES = ("jit_builds", "jit_files_s")
KEEP = 10                # starts a release keeps in release.json (its own history of start-ups)
FLOOR_S, FLOOR_REL = 1.0, 0.10  # a phase's noise: 1 s (whole-second log timestamps) or 10% of its last value


def clean(start) -> dict:
    """A start as a host reported it (or a history file kept it), its phases numbers only: anything
    else, and a time no start spends (negative, NaN, past a week), is dropped, never shown."""
    if not isinstance(start, dict):
        return {}
    return {k: float(v) for k, v in start.items() if k in (*START_PHASES, "other_s", "start_s", *BY_FILES)
            and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_PHASE_S}


def jit_of(start: dict) -> float | None:
    """The JIT phase: the log's, else what the JIT caches' new files showed (an engine whose builds
    print nothing, sglang 0.5.17's)."""
    return start.get("jit_s") if start.get("jit_s") is not None else start.get("jit_files_s")


def rest_of(start: dict) -> float | None:
    """other_s less the JIT the caches' files showed within it (a growth is named once, as JIT)."""
    rest = start.get("other_s")
    if rest is None or start.get("jit_s") is not None:
        return rest
    return max(0.0, rest - (start.get("jit_files_s") or 0.0))


def text(start: dict) -> str:
    """`start to healthy 35.2s (weights 3.0s, capture 12.1s, other 20.1s; not in the log: JIT,
    compile)`: the phases shown, then those the log did not show (a start without a total, a
    phase list alone)."""
    shown = ", ".join(f"{NAMES[k]} {start[k]:.1f}s" for k in NAMES if start.get(k) is not None)
    missing = [NAMES[k] for k in START_PHASES if start.get(k) is None] if "other_s" in start else []
    head = f"start to healthy {start['start_s']:.1f}s" if "start_s" in start else "start-up"
    by_files = ""
    if start.get("jit_s") is None and start.get("jit_builds") is not None and start.get("jit_files_s") is not None:
        n = int(start["jit_builds"])
        by_files = (f"the JIT caches show {n} build{'s' if n != 1 else ''}, ~{start['jit_files_s']:.1f}s by their "
                    f"files, within other" if n else "the JIT caches show no build")
    inner = "; ".join(p for p in (shown, "not in the log: " + ", ".join(missing) if missing else "", by_files) if p)
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
        now, was = (jit_of(start), jit_of(previous)) if key == "jit_s" else \
            (rest_of(start), rest_of(previous)) if key == "other_s" else (start.get(key), previous.get(key))
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
