"""status / logs / stop / releases: read-mostly views of a host's releases and server."""

from __future__ import annotations

import sys

from . import releases, startup
from .output import CHANGED, EXIT_NOTHING, OK, Failed, console, err_console, print_table, table
from .transport import HostSession


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def status(hs: HostSession, check: bool = False) -> tuple[str, str, dict]:
    """One host's release and server. A current release whose server is down or unhealthy is
    said so, with what to run; with `check` it is that host's failure (exit 1)."""
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
        "start": _last_start(rel),
    }
    message = ""
    unfinished = res.get("unfinished") or []
    if unfinished:
        row["health"] = "deploy never finished" if any(u["guard"] == "restarted" for u in unfinished) \
            else "deploying"
        message = "; ".join(f"release {u['release']}: {u['detail']}" for u in unfinished)
    elif rel.get("status") in ("unconfirmed", "deploying", "interrupted"):
        message = f"release {res['current']} is {rel['status']}" + (f": {rel['guard']}" if rel.get("guard") else "")
    if res["current"] and row["health"] != "healthy" and not unfinished:
        what = "down" if row["health"] == "down" else "not healthy"
        fix = "start" if what == "down" else "restart"
        message = f"server {what}: the current release {res['current']} is not serving; invoke {fix} -H {hs.host.name}"
        if check:
            return Failed(EXIT_NOTHING), message, row
    return OK, message, row


def _last_start(rel: dict) -> str:
    """The current release's last start, as its health gate read it from the log ("" if none)."""
    starts = rel.get("starts") if isinstance(rel.get("starts"), list) else []
    last = startup.clean(starts[-1]) if starts else {}
    return startup.text(last) + (f" (last of {len(starts)} starts recorded)" if len(starts) > 1 else "") if last else ""


COLUMNS = ("host", "release", "variant", "patches", "pid", "health", "uptime", "sglang")


def print_status(rows: list[dict]) -> None:
    t = table("servers", list(COLUMNS))
    for r in rows:
        t.add_row(*(r[k] for k in COLUMNS))
    print_table(t)
    for r in rows:
        if r["launch"]:
            console.print(f"{r['host']}: launched as: {r['launch']}", markup=False, highlight=False)
        if r.get("start"):
            console.print(f"{r['host']}: last start: {r['start']}", markup=False, highlight=False)


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
    t = table("releases", ["host", "release", "variant", "status", "patches", "created", "kept because"])
    for host, state in listings.items():
        if state.get("pins_damaged"):
            err_console.print(f"{host}: warning: {state['pins_damaged']}: its pins are not shown, and nothing "
                              f"is pruned until it is fixed or removed", markup=False)
        kept = state.get("protected") or {}
        for r in state["releases"]:
            t.add_row(host, r["name"], r.get("variant", "-"), r.get("status", "-"),
                      ", ".join(r.get("patches") or []) or "-", r.get("created", "-"),
                      "; ".join(str(w) for w in kept.get(r["name"]) or []))
    print_table(t)


def pin(hs: HostSession, name: str, why: str | None, unpin: bool) -> tuple[str, str]:
    """releases --pin / --unpin: a pinned release is never pruned (whatever keep_releases says)."""
    releases.check_name(name, "--unpin" if unpin else "--pin")
    res = releases.ctl(hs, "pin", name=name, why=why, unpin=unpin)
    now = (res.get("pins") or {}).get(name) or []
    if unpin:
        return CHANGED, f"unpinned {name}" + (f" (still pinned: {'; '.join(now)})" if now else "")
    return CHANGED, f"pinned {name}: {'; '.join(now)}"


def run_command(hs: HostSession, command: str, sudo: bool, timeout: int) -> tuple[str, str, dict]:
    """`invoke run 'CMD'`: an ad-hoc shell command (Ansible's -a), output kept for printing per
    host; the host's status is its exit status."""
    from . import shell

    line = f"sudo -n -- sh -c {shell.quote(command)}" if sudo else command
    res = hs.run(line, timeout=timeout)
    out = {"stdout": hs.redactor(res.stdout), "stderr": hs.redactor(res.stderr), "exit": res.exited}
    if res.exited:
        hint = "; sudo needs a password or is not allowed (sudo -n)" if sudo and "password" in res.stderr else ""
        return Failed(EXIT_NOTHING), f"exit {res.exited}{hint}", out
    return OK, "exit 0", out


def print_command(host: str, out: dict) -> None:
    console.print(f"---- {host}: exit {out['exit']} ----", markup=False, highlight=False)
    for key, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        text = out[key]
        if text:
            stream.write(text if text.endswith("\n") else text + "\n")
            stream.flush()


def history(hs: HostSession, last: int) -> tuple[str, str, list]:
    """The host's journal; what the host could not vouch for (damaged lines skipped, a broken
    chain, entries cut off its end) goes to stderr as warnings, never silently."""
    res = releases.ctl(hs, "journal", last=last)
    entries = [{k: (hs.redactor(v) if isinstance(v, str) else v) for k, v in e.items()} for e in res["entries"]]
    problems = [str(p) for p in res.get("problems") or []]
    for p in problems:
        err_console.print(f"{hs.host.name}: warning: journal: {hs.redactor(p)}", markup=False, highlight=False)
    note = f"; {len(problems)} warning(s)" if problems else ""
    return OK, f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} in {res['path']}{note}", entries


def print_history(host: str, entries: list[dict]) -> None:
    t = table(f"{host}: history", ["when", "who", "action", "release", "outcome", "detail"])
    for e in entries:
        # a journal line is the host's: any field may be a number, a list or an object (each cell text)
        release = str(e.get("release") or e.get("patch") or "-")
        if e.get("to"):
            release += f" -> {e['to']}"
        start = startup.clean(e.get("start"))
        detail = str(e.get("detail") or e.get("why") or "") + (f"; {startup.text(start)}" if start else "")
        t.add_row(str(e.get("at", "-")), str(e.get("who") or "-"), str(e.get("action", "-")), release,
                  str(e.get("outcome") or "-"), detail)
    print_table(t)
