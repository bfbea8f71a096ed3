"""What people see while a deploy or rollback runs: one phase line per step with the elapsed
time, and during the long health wait (a TP8 model loads for 10-20 minutes) elapsed/timeout
with the server's latest log line. On a terminal the wait is a live rich line shared by all
hosts of a parallel run; piped, a plain line every WAIT_LINE_EVERY seconds."""

from __future__ import annotations

import threading
import time

from .output import console, is_tty

WAIT_LINE_EVERY = 30.0
_live_lock = threading.Lock()
_live = None


def cut_words(text: str, width: int) -> str:
    """`text` on one line, at most `width` characters, cut at a word boundary."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[:width - 1]
    space = cut.rfind(" ")
    if space >= width // 2:
        cut = cut[:space]
    return cut.rstrip() + "…"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Phases:
    """Phase lines for one host's operation: `lab1  [ 12.4s] health  waiting for /health …`."""

    def __init__(self, host: str, redactor=None):
        self.host = host
        self.started = time.monotonic()
        self.redactor = redactor or (lambda s: s)
        self.current: str | None = None
        self.done: list[tuple[str, float, str]] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def step(self, phase: str, detail: str = "") -> None:
        self.current = phase
        self.done.append((phase, self.elapsed(), detail))
        line = f"{self.host}  [{self.elapsed():6.1f}s] {phase:<8} {self.redactor(detail)}".rstrip()
        console.print(line, markup=False, highlight=False)

    def wait(self, label: str, timeout: float) -> "Wait":
        return Wait(self, label, timeout)


class Wait:
    """The live health wait: elapsed/timeout and the latest log line (cut at a word)."""

    def __init__(self, phases: Phases, label: str, timeout: float):
        self.phases, self.label, self.timeout = phases, label, timeout
        self.task = None
        self.last_plain = time.monotonic()

    def __enter__(self) -> "Wait":
        global _live
        if is_tty():
            with _live_lock:
                if _live is None:
                    from .output import make_console
                    from rich.progress import BarColumn, Progress, TextColumn

                    _live = Progress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=24),
                                     TextColumn("{task.fields[clock]}"), TextColumn("{task.fields[log]}", style="dim", markup=False),
                                     console=make_console(stderr=True), transient=True)
                if not _live.live.is_started:
                    _live.start()
                self.task = _live.add_task(f"{self.phases.host}: {self.label}", total=self.timeout,
                                           clock=f"0s/{_clock(self.timeout)}", log="")
        return self

    def update(self, elapsed: float, log_line: str) -> None:
        line = cut_words(self.phases.redactor(log_line or ""), 90)
        if self.task is not None:
            _live.update(self.task, completed=min(elapsed, self.timeout), clock=f"{_clock(elapsed)}/{_clock(self.timeout)}",
                         log=line)
        elif time.monotonic() - self.last_plain >= WAIT_LINE_EVERY:
            self.last_plain = time.monotonic()
            console.print(f"{self.phases.host}  [{self.phases.elapsed():6.1f}s] {self.label}: "
                          f"{_clock(elapsed)}/{_clock(self.timeout)}  {line}", markup=False, highlight=False)

    def __exit__(self, *exc) -> None:
        if self.task is not None:
            with _live_lock:
                _live.remove_task(self.task)
                if not _live.tasks:
                    _live.stop()
