"""`invoke diagnose`: tracebacks from a server log, mapped to the host's source, matched
against patches/known_issues.yml. One SSH command for the log and every frame's context."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml

from .errors import ServopsError
from .output import console
from .patchstore import PATCH_ROOT
from .releases import deploy_root
from .remote_exec import run_program
from .transport import HostSession


class DiagnoseError(ServopsError):
    pass


def known_issues(path: Path | None = None) -> list[dict]:
    path = path or PATCH_ROOT / "known_issues.yml"
    try:
        data = yaml.safe_load(path.read_text()) or []
    except (OSError, yaml.YAMLError) as exc:
        raise DiagnoseError(f"{path}: cannot load the knowledge base: {exc}") from None
    for entry in data:
        for key in ("id", "title", "match", "explanation"):
            if key not in entry:
                raise DiagnoseError(f"{path}: entry {entry.get('id', '?')} lacks '{key}'")
        for key, value in entry["match"].items():
            for rx in value if isinstance(value, list) else [value]:
                try:
                    re.compile(rx)
                except re.error as exc:
                    raise DiagnoseError(f"{path}: {entry['id']}.match.{key}: bad regex {rx!r}: {exc}") from None
    return data


def _all_frames(tb: dict) -> list[dict]:
    return tb["frames"] + tb["user_frames"]


def match(tb: dict, issues: list[dict]) -> list[dict]:
    text = "\n".join([tb["message"]] + tb["details"])
    funcs = [f["func"] for f in _all_frames(tb)]
    hits = []
    for entry in issues:
        m = entry["match"]
        if "exception" in m and not re.search(m["exception"], tb["exc_type"] or ""):
            continue
        if "message" in m and not re.search(m["message"], text):
            continue
        if any(not any(re.search(rx, fn) for fn in funcs) for rx in m.get("frames", [])):
            continue
        hits.append(entry)
    return hits


def call_chain(tb: dict, entry_rx: str | None) -> list[str]:
    """From the capture entry point to the failing call, through dynamo's traced user code."""
    frames = tb["frames"]
    start = 0
    if entry_rx:
        idx = [i for i, f in enumerate(frames) if re.search(entry_rx, f["func"])]
        start = idx[0] if idx else 0
    chain = [f for f in frames[start:] if "torch/_dynamo" not in f["path"]]
    chain += [f for f in tb["user_frames"] if "torch/_dynamo" not in f["path"]]
    steps = [f"{f['func']} ({os.path.basename(f['path'])}:{f['line']})" for f in chain]
    if tb.get("skipped_call"):
        steps.append(f"{tb['skipped_call']}  <- dynamo cannot trace this")
    return steps


def diagnose(hs: HostSession, release: str | None = None, log_text: str | None = None, context: int = 3) -> dict:
    args = {"deploy_root": deploy_root(hs.host), "release": release, "context": context,
            "state_dir": hs.host.state_dir, "log_text": log_text}
    return run_program(hs, "diagnose_ctx", args)


def print_report(host: str, result: dict, issues: list[dict], explain: bool) -> int:
    """Prints every traceback; returns how many matched a known issue."""
    from rich.syntax import Syntax

    tbs = result["tracebacks"]
    if not tbs:
        console.print(f"{host}: no Python traceback in {result['source']}", markup=False)
        return 0
    known = 0
    for n, tb in enumerate(tbs, 1):
        console.rule(f"{host}: traceback {n}/{len(tbs)} (log line {tb['start_line']})")
        console.print(f"[bold red]{tb['exc_type']}[/]: {tb['message']}", highlight=False)
        for section, frames in (("traceback", tb["frames"]), ("traced by dynamo (from user code)", tb["user_frames"])):
            if not frames:
                continue
            console.print(f"[bold]{section}[/]")
            for f in frames:
                where = f.get("rel") or f["path"]
                marks = []
                if f.get("patch"):
                    marks.append(f"[green]patched: {f['patch']}[/]")
                elif f.get("modified"):
                    marks.append("[magenta]modified since install[/]")
                if f.get("dist"):
                    marks.append(f["dist"])
                if not f.get("host_path"):
                    marks.append("[dim]not on host[/]")
                console.print(f"  {where}:{f['line']} in [cyan]{f['func']}[/]" + (f"  ({', '.join(marks)})" if marks else ""),
                              highlight=False)
                src = f.get("source")
                if src and src["lines"] and console.is_terminal:
                    console.print(Syntax("\n".join(src["lines"]), "python", line_numbers=True, start_line=src["start"],
                                         highlight_lines={f["line"]}, theme="monokai"))
                elif src:
                    for i, line in enumerate(src["lines"], src["start"]):
                        console.out(f"    {'>' if i == f['line'] else ' '}{i:>5}  {line}", highlight=False)
        hits = match(tb, issues)
        for hit in hits:
            known += 1
            console.print(f"[bold yellow]known issue {hit['id']}[/]: {hit['title']}", highlight=False)
            console.print(f"  {hit['explanation']}", markup=False)
            for key, value in (hit.get("suggest") or {}).items():
                console.print(f"  suggest {key}: {value}", markup=False)
            if hit.get("link"):
                console.print(f"  see: {hit['link']}", markup=False)
        if explain:
            entry = hits[0].get("entry") if hits else None
            console.print("[bold]call chain[/]")
            for depth, step in enumerate(call_chain(tb, entry)):
                console.print(f"  {'  ' * min(depth, 12)}-> {step}", markup=False)
    sys.stdout.flush()
    return known
