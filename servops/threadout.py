"""Per-thread capture of stdout/stderr, for work done in several threads at once (a fleet
campaign: one worker per host). contextlib.redirect_stdout swaps the process-wide sys.stdout,
so two threads holding back their output at once would each end up writing into the other's
buffer; under `threads()` a capture is the calling thread's only, and every other thread's
writes go to the terminal as before."""

from __future__ import annotations

import contextlib
import sys
import threading


class ThreadStreams:
    """A stream that writes to the calling thread's capture buffer when it holds one, else to
    the stream it wraps."""

    def __init__(self, real):
        self.real = real
        self.local = threading.local()

    def _target(self):
        return getattr(self.local, "buf", None) or self.real

    def write(self, text: str) -> int:
        return self._target().write(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name):
        return getattr(self.real, name)


def _slots():
    """(owner, attribute) of the raw stdout and stderr: inside servops' SafeStream when there is
    one (so rich's own escape codes keep reaching the terminal unaltered), else sys itself."""
    from .output import SafeStream

    out = []
    for name in ("stdout", "stderr"):
        s = getattr(sys, name)
        out.append((s, "raw") if isinstance(s, SafeStream) else (sys, name))
    return out


@contextlib.contextmanager
def threads():
    """For the duration: each thread may capture its own output (`capture`)."""
    saved = []
    for owner, attr in _slots():
        current = getattr(owner, attr)
        if isinstance(current, ThreadStreams):
            continue
        saved.append((owner, attr, current))
        setattr(owner, attr, ThreadStreams(current))
        if attr == "raw":
            owner.rich_proxied_file = getattr(owner, attr)
    try:
        yield
    finally:
        for owner, attr, current in reversed(saved):
            setattr(owner, attr, current)
            if attr == "raw":
                owner.rich_proxied_file = current


def active() -> bool:
    return any(isinstance(getattr(owner, attr), ThreadStreams) for owner, attr in _slots())


@contextlib.contextmanager
def capture(buf):
    """What this thread writes to stdout and stderr goes to `buf` (under `threads()`)."""
    streams = [getattr(owner, attr) for owner, attr in _slots()]
    before = [getattr(s.local, "buf", None) for s in streams]
    for s in streams:
        s.local.buf = buf
    try:
        yield
    finally:
        for s, b in zip(streams, before):
            s.local.buf = b
