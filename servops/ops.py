"""status / logs / stop / releases: read-mostly views of a host's releases and server."""

from __future__ import annotations

import sys

from . import releases
from .output import OK, console, print_table, table
from .transport import HostSession


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def status(hs: HostSession) -> tuple[str, str, dict]:
    res = releases.ctl(hs, "status")
    hs.redactor.learn(res.get("server_info"))  # its api_key, repeated in launch_command
    rel = res["release"] or {}
    server = res["server"]
    row = {
        "host": hs.host.name, "release": res["current"] or "-", "variant": rel.get("variant", "-"),
        "patches": ", ".join(rel.get("patches") or []) or "-", "pid": str(server["pid"]) if server else "-",
        "health": {True: "healthy", False: "unhealthy", None: "down"}[res["healthy"]] if server else "down",
        "uptime": _uptime(res["now"] - server["started_epoch"]) if server else "-",
        "sglang": ((res.get("server_info") or {}).get("version") or "-") if server else "-",
        "launch": hs.redactor((res.get("server_info") or {}).get("launch_command") or ""),
        "release_status": rel.get("status", "-"),
    }
    message = ""
    if rel.get("status") in ("unconfirmed", "deploying", "interrupted"):
        message = f"release {res['current']} is {rel['status']}" + (f": {rel['guard']}" if rel.get("guard") else "")
    return OK, message, row


COLUMNS = ("host", "release", "variant", "patches", "pid", "health", "uptime", "sglang")


def print_status(rows: list[dict]) -> None:
    t = table("servers", list(COLUMNS))
    for r in rows:
        t.add_row(*(r[k] for k in COLUMNS))
    print_table(t)
    for r in rows:
        if r["launch"]:
            console.print(f"{r['host']}: launched as: {r['launch']}", markup=False, highlight=False)


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
    """Follow the log on the host until Ctrl-C (`tail -F` in the host program, which masks the
    release's secrets before a line leaves the host); every chunk redacted here too."""
    from . import remote, shell
    from .transport import Session

    with Session(inventory) as session:
        hs = session.host(host)

        def emit(text: str) -> None:
            sys.stdout.write(hs.redactor(text))
            sys.stdout.flush()
        program = remote.with_args("deploy_ctl", {"op": "follow", "name": res["name"],
                                                  "deploy_root": releases.deploy_root(host)})
        try:
            hs.run(shell.python_stdin(host.python), stdin=program, timeout=10 ** 7, on_output=emit)
        except KeyboardInterrupt:
            pass


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


def history(hs: HostSession, last: int) -> tuple[str, str, list]:
    res = releases.ctl(hs, "journal", last=last)
    entries = [{k: (hs.redactor(v) if isinstance(v, str) else v) for k, v in e.items()} for e in res["entries"]]
    return OK, f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} in {res['path']}", entries


def print_history(host: str, entries: list[dict]) -> None:
    t = table(f"{host}: history", ["when", "who", "action", "release", "outcome", "detail"])
    for e in entries:
        release = e.get("release") or e.get("patch") or "-"
        if e.get("to"):
            release += f" -> {e['to']}"
        t.add_row(e.get("at", "-"), str(e.get("who") or "-"), e.get("action", "-"), release,
                  str(e.get("outcome") or "-"), str(e.get("detail") or e.get("why") or ""))
    print_table(t)
