"""Output for people: a shared rich console, and the per-host recap (ok / changed / failed)."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field



class _LazyConsole:
    """A rich Console created on first use: plain piped output never pays rich's import."""

    def __init__(self, **kwargs):
        self._kwargs = kwargs
        self._console = None

    def __getattr__(self, name):
        if self._console is None:
            from rich.console import Console

            self._console = Console(highlight=False, soft_wrap=True, **self._kwargs)
        return getattr(self._console, name)


console = _LazyConsole()
err_console = _LazyConsole(stderr=True)

OK, CHANGED, FAILED, SKIPPED = "ok", "changed", "failed", "skipped"
_STYLE = {OK: "green", CHANGED: "yellow", FAILED: "bold red", SKIPPED: "cyan"}


def is_tty() -> bool:
    return sys.stdout.isatty()


@dataclass
class HostOutcome:
    host: str
    status: str = OK
    messages: list[str] = field(default_factory=list)


class Recap:
    """Collects each host's outcome; a host's status only ever escalates ok < changed < failed."""

    _order = {SKIPPED: -1, OK: 0, CHANGED: 1, FAILED: 2}

    def __init__(self):
        self._lock = threading.Lock()
        self.hosts: dict[str, HostOutcome] = {}
        self.order: list[str] = []

    def expect(self, names: list[str]) -> None:
        """Print the recap in this (inventory) order, whatever order hosts finish in."""
        self.order.extend(n for n in names if n not in self.order)

    def mark(self, host: str, status: str, message: str = "") -> None:
        with self._lock:
            out = self.hosts.setdefault(host, HostOutcome(host, status if status == SKIPPED else OK))
            if self._order[status] > self._order[out.status]:
                out.status = status
            if message:
                out.messages.append(message)

    @property
    def failed(self) -> list[str]:
        return [h for h, o in self.hosts.items() if o.status == FAILED]

    def render(self, con=None) -> None:
        con = con or console
        if not self.hosts:
            return
        con.print()
        names = [n for n in self.order if n in self.hosts] + [n for n in self.hosts if n not in self.order]
        for name in names:
            out = self.hosts[name]
            last = out.messages[-1] if out.messages else ""
            con.print(f"[{_STYLE[out.status]}]{name}[/] : {out.status}" + (f" - {last}" if last else ""))


def table(title: str, columns: list[str]):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    return t
