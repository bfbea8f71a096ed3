"""`invoke inspect`: read library source inside a host's venv, and check it for drift."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from .errors import ServopsError
from .output import console, is_tty
from .remote_exec import run_program
from .transport import HostSession


def parse_range(spec: str) -> tuple[int | None, int | None]:
    """sed-style range: `60:90`, `60,90`, `60:`, `:90`, `60` (one line), `60:+10` (ten after)."""
    m = re.fullmatch(r"\s*(\d*)\s*(?:([:,])\s*(\+?)(\d*))?\s*", spec or "")
    if not m or (not m.group(1) and not m.group(4)):
        raise ServopsError(f"--lines {spec!r}: expected START:END (e.g. 60:90), START:, :END, START or START:+N")
    start = int(m.group(1)) if m.group(1) else None
    if m.group(2) is None:
        return start, start
    end = int(m.group(4)) if m.group(4) else None
    if m.group(3):
        if start is None or end is None:
            raise ServopsError(f"--lines {spec!r}: START:+N needs both START and N")
        end = start + end
    if start is not None and start < 1:
        raise ServopsError(f"--lines {spec!r}: line numbers start at 1")
    if start is not None and end is not None and end < start:
        raise ServopsError(f"--lines {spec!r}: end {end} is before start {start}")
    return start, end


@dataclass
class InspectRequest:
    file: str
    lines: str | None = None
    symbol: str | None = None
    grep: str | None = None
    context: int = 0
    allow_outside: bool = False

    def program_args(self) -> dict:
        if not self.file:
            raise ServopsError("inspect needs --file PATH (relative to site-packages), or --verify DIST")
        chosen = [n for n, v in (("--lines", self.lines), ("--symbol", self.symbol), ("--grep", self.grep)) if v]
        if len(chosen) > 1:
            raise ServopsError(f"inspect: choose one of {' / '.join(chosen)}, not several")
        if self.context < 0:
            raise ServopsError("--context must be 0 or more")
        args = {"file": self.file, "allow_outside": bool(self.allow_outside)}
        if self.lines:
            start, end = parse_range(self.lines)
            args.update(mode="lines", start=start, end=end)
        elif self.symbol:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", self.symbol):
                raise ServopsError(f"--symbol {self.symbol!r}: expected a name like get_cuda_version or Class.method")
            args.update(mode="symbol", symbol=self.symbol)
        elif self.grep:
            try:
                re.compile(self.grep)
            except re.error as exc:
                raise ServopsError(f"--grep {self.grep!r}: invalid regular expression: {exc}") from None
            args.update(mode="grep", pattern=self.grep, context=self.context)
        else:
            args.update(mode="all")
        return args


def inspect_file(hs: HostSession, req: InspectRequest) -> dict:
    return run_program(hs, "inspect_file", req.program_args())


def parse_dists(spec: str) -> list[str]:
    dists = [d.strip() for d in spec.split(",") if d.strip()]
    for dist in dists or [spec]:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", dist or ""):
            raise ServopsError(f"--verify {dist[:80]!r}: expected distribution names like flashinfer-python,sglang")
    # each one hashes every file it installed on the host: a name given twice is checked once
    dists = list(dict.fromkeys(re.sub(r"[-_.]+", "-", d).lower() for d in dists))
    if len(dists) > MAX_VERIFY:
        raise ServopsError(f"--verify: {len(dists)} distributions; at most {MAX_VERIFY} at a time")
    return dists


MAX_VERIFY = 100


def verify_dists(hs: HostSession, dists: list[str]) -> list[dict]:
    """RECORD check of each distribution; files an applied servops patch changed are listed apart."""
    return run_program(hs, "verify_dist", {"dists": dists})["dists"]


def format_plain(result: dict) -> list[str]:
    """Line-numbered text like `cat -n`; grep matches are marked with ':' and context with '-'."""
    out = []
    grep = any(b["matches"] for b in result["blocks"])
    for i, block in enumerate(result["blocks"]):
        if i and (grep or block.get("label")):
            out.append("--")
        for n, text in enumerate(block["lines"], block["start"]):
            mark = (":" if n in block["matches"] else "-") if grep else " "
            out.append(f"{n:>6}{mark} {text}")
    return out


def header(host: str, result: dict) -> str:
    owner = result.get("owner")
    who = f"{owner['name']} {owner['version']}" if owner else "not owned by any installed distribution"
    drift = " (MODIFIED since install)" if owner and owner.get("modified") else ""
    return f"==> {host}: {result['path']} [{who}]{drift} <=="


def print_inspect(host: str, result: dict, highlight: bool | None = None) -> None:
    highlight = is_tty() if highlight is None else highlight
    empty = not any(b["lines"] for b in result["blocks"])
    if not highlight:
        lines = [header(host, result)] + (["(no matching lines)"] if empty else format_plain(result))
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        return
    from rich.syntax import Syntax

    console.print(header(host, result), markup=False, style="bold")
    if empty:
        console.print("(no matching lines)", markup=False)
        return
    for i, block in enumerate(result["blocks"]):
        if i:
            console.rule(style="dim")
        console.print(Syntax("\n".join(block["lines"]), "python", line_numbers=True,
                             start_line=block["start"], highlight_lines=set(block["matches"]),
                             word_wrap=False, theme="monokai"))


def print_verify(host: str, result: dict) -> None:
    from .output import print_table, table

    name = f"{result['name']} {result['version']}"
    patched = result.get("patched") or []
    outside = result.get("outside_missing") or []
    if outside:  # a `pip --target` install: the library is whole, its console scripts live elsewhere
        console.print(f"{host}: {name}: {len(outside)} console script(s) not installed here "
                      f"({', '.join(p.rsplit('/', 1)[-1] for p in outside[:5])}{', ...' if len(outside) > 5 else ''}): "
                      f"outside site-packages, not drift of the library", markup=False)
    if not result["modified"] and not result["missing"]:
        note = f" ({len(patched)} changed by servops patches, as expected)" if patched else ""
        console.print(f"{host}: {name}: {result['checked']} files match RECORD{note}", markup=False)
        if not patched:
            return
    t = table(f"{host}: {name} ({result['checked']} files checked)", ["state", "file"])
    for entry in patched:
        t.add_row(f"patched by {entry['patch']} (expected)", entry["file"])
    for path in result["modified"]:
        t.add_row("modified (unexpected drift)", path)
    for path in result["missing"]:
        t.add_row("missing", path)
    print_table(t)
