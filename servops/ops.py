"""status / logs / stop / releases: read-mostly views of a host's releases and server."""

from __future__ import annotations

import sys

from . import releases
from .output import CHANGED, OK, console, print_table, table
from .transport import HostSession


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def status(hs: HostSession) -> tuple[str, str, dict]:
    res = releases.ctl(hs, "status")
    rel = res["release"] or {}
    server = res["server"]
    row = {
        "host": hs.host.name, "release": res["current"] or "-", "variant": rel.get("variant", "-"),
        "patches": ", ".join(rel.get("patches") or []) or "-", "pid": str(server["pid"]) if server else "-",
        "health": {True: "healthy", False: "unhealthy", None: "down"}[res["healthy"]] if server else "down",
        "uptime": _uptime(res["now"] - server["started_epoch"]) if server else "-",
    }
    return OK, "", row


def print_status(rows: list[dict]) -> None:
    t = table("servers", ["host", "release", "variant", "patches", "pid", "health", "uptime"])
    for r in rows:
        t.add_row(*(r[k] for k in ("host", "release", "variant", "patches", "pid", "health", "uptime")))
    print_table(t)


def logs(hs: HostSession, lines: int, release: str | None) -> tuple[str, str, dict]:
    if release is not None:
        releases.check_name(release, "--release")
    res = releases.ctl(hs, "logs", name=release, lines=lines)
    res["lines"] = [hs.redactor(line) for line in res["lines"]]
    return OK, f"{res['name']}/server.log", res


def print_logs(host: str, res: dict, prefix: bool) -> None:
    tag = f"{host}: " if prefix else ""
    if res["lines"]:
        sys.stdout.write("\n".join(tag + line for line in res["lines"]) + "\n")
        sys.stdout.flush()


def follow(inventory, host, res: dict) -> None:
    """`tail -F` the log on the host until Ctrl-C; every chunk redacted."""
    from . import shell
    from .transport import Session

    with Session(inventory) as session:
        hs = session.host(host)

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


def list_releases(hs: HostSession) -> tuple[str, str, dict]:
    listing = releases.listing(hs)
    return OK, f"{len(listing['releases'])} release(s), current {listing['current'] or '-'}", listing


def print_releases(listings: dict) -> None:
    t = table("releases", ["host", "release", "variant", "status", "patches", "created", ""])
    for host, state in listings.items():
        for r in state["releases"]:
            t.add_row(host, r["name"], r.get("variant", "-"), r.get("status", "-"),
                      ", ".join(r.get("patches") or []) or "-", r.get("created", "-"),
                      "current" if r["name"] == state["current"] else "")
    print_table(t)
