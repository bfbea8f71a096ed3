"""status / logs / stop / releases: read-mostly views of a host's releases and server."""

from __future__ import annotations

import sys

from . import releases
from .output import CHANGED, OK, console, table
from .transport import HostSession


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def status(hs: HostSession, rows: dict) -> tuple[str, str]:
    res = releases.ctl(hs, "status")
    rel = res["release"] or {}
    server = res["server"]
    rows[hs.host.name] = {
        "host": hs.host.name, "release": res["current"] or "-", "variant": rel.get("variant", "-"),
        "patches": ", ".join(rel.get("patches") or []) or "-", "pid": str(server["pid"]) if server else "-",
        "health": {True: "healthy", False: "unhealthy", None: "down"}[res["healthy"]] if server else "down",
        "uptime": _uptime(res["now"] - server["started_epoch"]) if server else "-",
    }
    return OK, ""


def print_status(rows: list[dict]) -> None:
    t = table("servers", ["host", "release", "variant", "patches", "pid", "health", "uptime"])
    for r in rows:
        t.add_row(*(r[k] for k in ("host", "release", "variant", "patches", "pid", "health", "uptime")))
    console.print(t)


def logs(hs: HostSession, lines: int, follow: bool, release: str | None, prefix: bool) -> None:
    from . import shell

    res = releases.ctl(hs, "logs", name=release, lines=lines)
    tag = f"{hs.host.name}: " if prefix else ""
    out = [tag + hs.redactor(line) for line in res["lines"]]
    if out:
        sys.stdout.write("\n".join(out) + "\n")
        sys.stdout.flush()
    if follow:
        def emit(text: str) -> None:
            sys.stdout.write(hs.redactor(text))
            sys.stdout.flush()
        try:
            hs.run(f"tail -n 0 -F {shell.quote(res['path'])}", timeout=10 ** 7, on_output=emit)
        except KeyboardInterrupt:
            pass


def stop(hs: HostSession, grace: float | None, dry_run: bool) -> tuple[str, str]:
    state = releases.ctl(hs, "releases")
    server = state["server"]
    if not server:
        return OK, "no server running"
    if dry_run:
        return CHANGED, f"would stop pid {server['pid']} ({server['release']}) (check mode)"
    current = next((r for r in state["releases"] if r["name"] == state["current"]), {})
    res = releases.stop(hs, grace or float(current.get("stop_grace", 30)))
    how = "SIGKILL after grace period" if res.get("killed") else "SIGTERM"
    return CHANGED, f"stopped pid {res['pid']} ({how})"


def list_releases(hs: HostSession, out: dict) -> tuple[str, str]:
    out[hs.host.name] = releases.listing(hs)
    return OK, ""


def print_releases(listings: dict) -> None:
    t = table("releases", ["host", "release", "variant", "status", "patches", "created", ""])
    for host, state in listings.items():
        for r in state["releases"]:
            t.add_row(host, r["name"], r.get("variant", "-"), r.get("status", "-"),
                      ", ".join(r.get("patches") or []) or "-", r.get("created", "-"),
                      "current" if r["name"] == state["current"] else "")
    console.print(t)
