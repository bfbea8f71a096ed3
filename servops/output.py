"""Output for people: a shared rich console, and the per-host recap (ok / changed / failed)."""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

# Characters a terminal acts on rather than shows: C0 controls (ESC starts cursor moves, screen
# clears, title and clipboard writes, hidden text) except tab and newline, DEL, C1 controls (0x9b
# is a one-byte CSI), and the bidirectional overrides that reorder what a line appears to say.
_UNSAFE = re.compile("\r(?!\n)|[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match) -> str:
    ch = match.group()
    return "\\r" if ch == "\r" else f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"


def terminal_safe(text: str) -> str:
    """`text` with every control character shown as an escape (ESC -> \\x1b); newlines, tabs and
    CRLF line ends kept. Whatever servops prints passes through this: text from a host (a
    server's log, a traceback, a release's record) never drives the operator's terminal."""
    if text.isprintable():
        return text
    return _UNSAFE.sub(_visible, text.replace("\r\n", "\n"))


class SafeStream:
    """sys.stdout / sys.stderr while a verb runs: every write goes through terminal_safe, every
    secret servops knows of masked (servops.redact.mask_known).

    rich consoles write to the stream behind it (`rich_proxied_file`), as SafeConsole, which
    makes their text safe before adding its own colours."""

    def __init__(self, raw):
        self.raw = raw
        self.rich_proxied_file = raw

    def write(self, text: str) -> int:
        from .redact import mask_known

        self.raw.write(terminal_safe(mask_known(text)))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def _escaping(stream) -> Callable[[], None]:
    """Set `stream` to write what its encoding cannot show as an escape (\\u2014, \\udcff) rather
    than raise UnicodeEncodeError (LC_ALL=C, PYTHONIOENCODING=ascii, undecodable host bytes kept
    as surrogates); returns the undo."""
    errors, reconfigure = getattr(stream, "errors", None), getattr(stream, "reconfigure", None)
    if reconfigure is None or errors in (None, "backslashreplace"):
        return lambda: None
    try:
        reconfigure(errors="backslashreplace")
    except (ValueError, OSError, AttributeError):  # a stream that cannot change now: left as is
        return lambda: None
    return lambda: reconfigure(errors=errors)


@contextlib.contextmanager
def safe_streams():
    """Install SafeStream on stdout and stderr for the duration (idempotent); the real streams
    escape what they cannot encode."""
    saved = sys.stdout, sys.stderr
    undo = [_escaping(s.raw if isinstance(s, SafeStream) else s) for s in saved]
    if not isinstance(sys.stdout, SafeStream):
        sys.stdout = SafeStream(sys.stdout)
    if not isinstance(sys.stderr, SafeStream):
        sys.stderr = SafeStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for restore in undo:
            restore()


def json_text(obj: Any, **kwargs) -> str:
    """JSON that strict parsers (jq, JSON.parse) read: NaN and +-Infinity, which json.dumps writes
    bare, become null. Everything servops prints or writes as JSON goes through this."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def make_console(**kwargs):
    """A rich Console whose printed text (not its own styling or cursor control) goes through
    terminal_safe, every known secret masked. Every console servops prints with comes from here."""
    from rich.console import Console
    from rich.segment import Segment

    from .redact import mask_known

    def safe(seg):
        if seg.control:
            return seg
        text = terminal_safe(mask_known(seg.text))
        return seg if text == seg.text else Segment(text, seg.style)

    class SafeConsole(Console):
        def _render_buffer(self, buffer):
            return super()._render_buffer(safe(seg) for seg in buffer)

        @property
        def file(self):
            # rich unwraps one proxy; a live display's FileProxy around our SafeStream is two:
            # this console's own escape codes go to the real stream, never through SafeStream
            f = Console.file.fget(self)
            while isinstance(f, SafeStream) or isinstance(getattr(f, "rich_proxied_file", None), SafeStream):
                f = f.raw if isinstance(f, SafeStream) else f.rich_proxied_file
            return f

        @file.setter
        def file(self, value):
            Console.file.fset(self, value)

    return SafeConsole(**kwargs)


class _LazyConsole:
    """A rich Console created on first use: plain piped output never pays rich's import."""

    def __init__(self, **kwargs):
        self._kwargs = kwargs
        self._console = None

    def __getattr__(self, name):
        if self._console is None:
            self._console = make_console(highlight=False, soft_wrap=True, **self._kwargs)
        return getattr(self._console, name)


console = _LazyConsole()
err_console = _LazyConsole(stderr=True)

OK, CHANGED, FAILED, SKIPPED = "ok", "changed", "failed", "skipped"

# The exit-code contract (README, `invoke --help`): what a script calling servops can rely on.
EXIT_OK, EXIT_NOTHING, EXIT_BAD_INPUT, EXIT_UNREACHABLE, EXIT_RESTORED, EXIT_ATTENTION, EXIT_INTERRUPTED = (
    0, 1, 2, 3, 4, 5, 130)
EXIT_CONTRACT = ("exit status: 0 ok; 1 the log shows a failure (diagnose: explained or not) or the command failed "
                 "(run, status --check), "
                 "or a host command timed out or sent too much output; "
                 "2 bad input, nothing touched; 3 a host unreachable; 4 failed on a host and servops restored it "
                 "(rolled back, undone); 5 failed and the host is NOT as before (the line says what to run); "
                 "130 interrupted")
# With several hosts failing differently, the exit status is the one needing most attention.
_SEVERITY = [EXIT_ATTENTION, EXIT_RESTORED, EXIT_UNREACHABLE, EXIT_BAD_INPUT, EXIT_NOTHING]


class Failed(str):
    """FAILED, carrying the exit status it stands for (compares equal to "failed")."""

    def __new__(cls, code: int):
        obj = super().__new__(cls, FAILED)
        obj.code = code
        return obj


RESTORED = Failed(EXIT_RESTORED)      # the operation failed; servops rolled back or undid it
ATTENTION = Failed(EXIT_ATTENTION)    # the operation failed and the host is not as before
UNREACHABLE = Failed(EXIT_UNREACHABLE)


def worst(codes) -> int:
    """The exit status needing most attention among `codes` (0 when none)."""
    codes = set(codes)
    return next((c for c in _SEVERITY if c in codes), 0)
_STYLE = {OK: "green", CHANGED: "yellow", FAILED: "bold red", SKIPPED: "cyan"}


def is_tty() -> bool:
    return sys.stdout.isatty()


@dataclass
class HostOutcome:
    host: str
    status: str = OK
    messages: list[str] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)  # exit statuses its failures stand for


class Recap:
    """Collects each host's outcome; a host's status only ever escalates ok < changed < failed."""

    _order = {SKIPPED: -1, OK: 0, CHANGED: 1, FAILED: 2}

    def __init__(self):
        self._lock = threading.Lock()
        self.hosts: dict[str, HostOutcome] = {}
        self.order: list[str] = []
        self.default_code = EXIT_BAD_INPUT  # a failure that names no code; a verb may choose another
        self.machine_output = False  # stdout holds JSON: the recap goes to stderr

    def expect(self, names: list[str]) -> None:
        """Print the recap in this (inventory) order, whatever order hosts finish in."""
        self.order.extend(n for n in names if n not in self.order)

    def mark(self, host: str, status: str, message: str = "") -> None:
        with self._lock:
            out = self.hosts.setdefault(host, HostOutcome(host, status if status == SKIPPED else OK))
            if self._order[status] > self._order[out.status]:
                out.status = status
            if status == FAILED:
                out.codes.append(getattr(status, "code", None) or self.default_code)
            if message:
                out.messages.append(message)

    @property
    def failed(self) -> list[str]:
        return [h for h, o in self.hosts.items() if o.status == FAILED]

    @property
    def exit_code(self) -> int:
        """The contract's status for this run: the failed hosts' most serious one."""
        return worst(c for o in self.hosts.values() if o.status == FAILED for c in o.codes)

    def render(self) -> None:
        """One line per host in inventory order; a failed host's line (with its error) on
        stderr, the others on stdout, each flushed so a terminal shows them in order."""
        if not self.hosts:
            return
        names = [n for n in self.order if n in self.hosts] + [n for n in self.hosts if n not in self.order]
        first = True
        for name in names:
            out = self.hosts[name]
            last = out.messages[-1] if out.messages else ""
            text = f"{name} : {out.status}" + (f" - {last}" if last else "")
            to_err = out.status == FAILED or self.machine_output
            stream = sys.stderr if to_err else sys.stdout
            if first:
                stream.write("\n")
                first = False
            if stream.isatty():  # colour on a terminal; piped output never pays rich's import
                from rich.text import Text

                con = err_console if to_err else console
                line = Text(name, style=_STYLE[out.status])
                line.append(text[len(name):])
                con.print(line)
                con.file.flush()
            else:
                stream.write(text + "\n")
                stream.flush()


def table(title: str, columns: list[str]):
    """A rich Table whose cells and title are plain text: a name like `a[bold]b` prints as is.

    Pass a rich Text for a styled cell."""
    from rich.table import Table
    from rich.text import Text

    class PlainTable(Table):
        def add_row(self, *cells, **kwargs):
            super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kwargs)

    t = PlainTable(title=Text(title), title_justify="left")
    for c in columns:
        t.add_column(Text(c))
    return t


def print_table(t, con=None) -> None:
    """Print a table whole: piped output gets the table's natural width, never cut names
    (a terminal's width still applies on a terminal)."""
    con = con or console
    if con.is_terminal:
        con.print(t)
        return
    from rich.measure import Measurement

    real = getattr(con, "_console", None) or con  # the rich Console behind the lazy wrapper
    natural = Measurement.get(real, real.options.update(max_width=100_000), t).maximum
    saved = real.width
    real.width = max(saved, natural)
    try:
        real.print(t)
    finally:
        real.width = saved
