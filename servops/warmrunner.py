"""The connection agent's side of a host's warm interpreter (servops/remote/warm_runner.py).

A command that runs one of servops' short read-only programs (servops.remote.WARM) still pays,
through a warm agent, the exec round trip, the login shell's start-up (sourcing the user's
rc files) and python's. The agent therefore keeps, per remote python, one long-lived
interpreter on a channel of its connection; each such program is sent to it and runs in a
fork of it, and the command costs one round trip. The runner is started in the background by
the first warm command (which itself runs the ordinary way), serves one program at a time (a
second one meanwhile runs the ordinary way), and is given up when it reports itself stale
(what its interpreter loaded at start changed on the host), dies, or does not take a program
within HANDOFF_TIMEOUT (stopped, starved); a program it provably did not start
then runs the ordinary way, so no command ever fails for the runner's sake.
It holds one of sshd's MaxSessions per python while the agent lives.
"""

from __future__ import annotations

import json
import select
import threading
import time

from . import remote, shell
from .connagent import Frames, frame

# Its own text arrives as BOOT's first stdin line (a JSON string); then the frames begin.
BOOT = "import sys,json;exec(compile(json.loads(sys.stdin.buffer.readline()),'<servops-warm-runner>','exec'))"
RETRY_AFTER = 60.0  # seconds before a runner that failed to start is tried again
IDLE_MARGIN = 60.0  # the runner outlives its agent's idle time by this much, at most
HANDOFF_TIMEOUT = 2.0  # a runner that has not taken a program by then is given up (stopped, starved)


def boot_command(python: str) -> str:
    return f"{shell.remote_path(python)} -c {shell.quote(BOOT)}"


class Outcome:
    DONE = "done"          # the program ran; its output and status went to the client
    NOT_RUN = "not-run"    # nothing ran: run it the ordinary way
    LOST = "lost"          # the runner died after the program's output began


class WarmRunner:
    """One remote python's warm interpreter on the agent's connection."""

    def __init__(self, transport, python: str, timeout: float, idle: float):
        self.transport, self.python, self.timeout, self.idle = transport, python, timeout, idle
        self._busy = threading.Lock()
        self._state = threading.Lock()
        self._chan = None
        self._frames = Frames()
        self._starting = False
        self._failed_at: float | None = None

    def ensure_started(self) -> None:
        """Start it in the background unless it is ready, starting, or failed just now."""
        with self._state:
            if (self._chan is not None or self._starting
                    or (self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER)):
                return
            self._starting = True
        threading.Thread(target=self._start, daemon=True).start()

    def _start(self) -> None:
        chan = None
        try:
            chan = self.transport.open_session(timeout=self.timeout)
            chan.exec_command(boot_command(self.python))
            text = f"_IDLE_S = {float(self.idle) + IDLE_MARGIN!r}\n" + remote.standalone("warm_runner")
            chan.sendall(json.dumps(text).encode() + b"\n")
            frames = Frames()
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                got = self._read(chan, frames, 0.2)
                if got is None:
                    break  # it ended: this python cannot run it
                if any(kind == "r" for kind, _ in got):
                    with self._state:
                        self._chan, self._frames, chan = chan, frames, None
                        self._failed_at = None
                    return
        except Exception:  # no runner: warm commands keep running the ordinary way
            pass
        finally:
            if chan is not None:
                chan.close()
            with self._state:
                self._starting = False
                if self._chan is None:
                    self._failed_at = time.monotonic()

    @staticmethod
    def _read(chan, frames: Frames, wait: float) -> list[tuple[str, bytes]] | None:
        """Frames that arrived within `wait` seconds ([] none yet), None once the channel ended."""
        select.select([chan], [], [], wait)
        while chan.recv_stderr_ready():
            chan.recv_stderr(1 << 16)  # the interpreter's own warnings: drained, not shown
        if chan.recv_ready():
            data = chan.recv(1 << 16)
            return frames.feed(data) if data else None
        return None if chan.closed or chan.eof_received else []

    def acquire(self) -> bool:
        """Take the ready runner for one program (False: not ready, or busy with another)."""
        with self._state:
            if self._chan is None:
                return False
        return self._busy.acquire(blocking=False)

    def release(self) -> None:
        self._busy.release()

    def _give_up(self) -> None:
        with self._state:
            chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()

    def run(self, program: bytes, sock, abandon=lambda: False) -> str:
        """Run `program` (acquired first), relaying its output and status to the client `sock`
        as agent frames. A client that goes has the program killed. Releases the runner.
        `abandon()` true before the runner took the program (the connection is wedged): given up."""
        chan, frames = self._chan, self._frames
        output_sent = client_gone = taken = False
        held = True
        try:
            chan.sendall(frame("P", program))
            handoff_by = time.monotonic() + HANDOFF_TIMEOUT
            while True:
                if not taken and (time.monotonic() > handoff_by or abandon()):
                    self._give_up()  # it runs nothing it is sent later: its stdin is closed
                    return Outcome.NOT_RUN
                if not client_gone and select.select([sock], [], [], 0)[0] and not sock.recv(1 << 16):
                    client_gone = True
                    chan.sendall(frame("k"))
                got = self._read(chan, frames, 0.05)
                if got is None:
                    self._give_up()
                    return Outcome.LOST if output_sent else Outcome.NOT_RUN
                for kind, payload in got:
                    if kind == "a":
                        taken = True
                    if kind == "s":  # stale: it ran nothing and exits
                        self._give_up()
                        return Outcome.NOT_RUN
                    if kind == "x":
                        # free before the client hears the status: its next command (sent at
                        # once) must find the runner free, not run the ordinary way beside it
                        held = False
                        self.release()
                    if kind in ("o", "e", "x") and not client_gone:
                        try:
                            sock.sendall(frame(kind, payload))
                        except OSError:
                            client_gone = True
                            chan.sendall(frame("k"))
                        output_sent = True
                    if kind == "x":
                        return Outcome.DONE
        except Exception:  # the channel failed under us (paramiko's errors are not all OSErrors)
            self._give_up()
            return Outcome.LOST if output_sent else Outcome.NOT_RUN
        finally:
            if held:
                self.release()


class WarmRunners:
    """The agent's runners, one per remote python, made on first use."""

    def __init__(self, transport, timeout: float, idle: float):
        self.transport, self.timeout, self.idle = transport, timeout, idle
        self._lock = threading.Lock()
        self._runners: dict[str, WarmRunner] = {}

    def get(self, python: str) -> WarmRunner:
        with self._lock:
            runner = self._runners.get(python)
            if runner is None:
                runner = self._runners[python] = WarmRunner(self.transport, python, self.timeout, self.idle)
        runner.ensure_started()
        return runner
