"""The health gate: poll /health and /get_model_info on the host while watching the log.

The polling runs on the host (one SSH command for the whole wait, no tunnel needed); its
progress lines drive a rich progress display here.
"""

from __future__ import annotations

import threading

from .output import is_tty
from .releases import ctl
from .transport import HostSession

_progress_lock = threading.Lock()
_shared_progress = None


def _progress():
    """One rich Progress shared by all hosts of a parallel deploy."""
    global _shared_progress
    with _progress_lock:
        if _shared_progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            _shared_progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                        TimeElapsedColumn(), TextColumn("{task.fields[log]}", style="dim"),
                                        console=Console(stderr=True), transient=True)
        return _shared_progress


def health_gate(hs: HostSession, name: str, port: int, health: dict, signatures: list[str], label: str) -> dict:
    timeout = float(hs.host.get("health_timeout") or health.get("timeout", 1200))
    args = dict(name=name, port=port, timeout=timeout, interval=float(health.get("interval", 2)),
                endpoint=health.get("endpoint", "/health"), model_info=health.get("model_info", "/get_model_info"),
                signatures=signatures)
    if not is_tty():
        return ctl(hs, "health", ssh_timeout=int(timeout) + 60, **args)
    progress = _progress()
    with _progress_lock:
        if not progress.live.is_started:
            progress.start()
        task = progress.add_task(f"{label}: waiting for {args['endpoint']}", total=timeout, log="")

    def update(p: dict) -> None:
        progress.update(task, completed=p["progress"], log=hs.redactor(p.get("log", ""))[-60:])

    try:
        return ctl(hs, "health", ssh_timeout=int(timeout) + 60, on_progress=update, **args)
    finally:
        with _progress_lock:
            progress.remove_task(task)
            if not progress.tasks:
                progress.stop()
