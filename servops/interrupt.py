"""Ctrl-C for operations that must not stop half-way.

SIGINT reaches only the main thread. A parallel run catches it there and `request()`s an
interrupt; every host's worker sees it at its next remote command or phase (`check()`), and
handles it like a failure: before the old server stopped, undo; after, roll back. Inside that
handling (`handling()`), checks pass, so the rollback's own commands run. A second Ctrl-C
abandons the run.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_requested = threading.Event()
_local = threading.local()


def request() -> None:
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def check() -> None:
    """Raise KeyboardInterrupt in this thread if an interrupt was requested and not yet handled here."""
    if _requested.is_set() and not getattr(_local, "handling", False):
        raise KeyboardInterrupt


@contextmanager
def handling():
    _local.handling = True
    try:
        yield
    finally:
        _local.handling = False
