"""The connection agent process (`python -m servops.connagentd`, started by
servops.connagent.Client.leave): it holds one host's SSH connection and runs each client's
command on a channel of it, or a short read-only servops program in the host's warm interpreter
(servops.warmrunner), relaying stdin, output and the exit status (the protocol, keys and socket
rules are servops.connagent's)."""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time

from .chanend import CommandEnd
from .connagent import AgentLost, Frames, entry_key, frame, json_frame, peer_pid, peer_uid, release_lock, take_lock
from .errors import ServopsError
from .inventory import Host, Inventory, load_inventory
from .warmrunner import Outcome, WarmRunners

WATCH_EVERY = 2.0  # seconds between checks of the files the agent's key depends on
PROBE_TIMEOUT = 1.0  # the host connection must answer a keepalive within this, before each command


class _State:
    def __init__(self, persist: float, warnings: list[str]):
        self.persist = persist
        self.warnings = warnings
        self.active = 0
        self.last = time.monotonic()
        self.stopping = threading.Event()
        self.cond = threading.Condition()
        self.socket: tuple[str, int] | None = None  # its path and inode, while it serves

    def retire(self) -> None:
        """Take no new commands: the socket goes at once (an agent started for the same key
        waits for this one to end, rather than seeing it still serve), the main loop ends."""
        with self.cond:
            self.stopping.set()
            if self.socket is not None:
                path, inode = self.socket
                self.socket = None
                try:
                    if os.stat(path).st_ino == inode:
                        os.unlink(path)
                except FileNotFoundError:
                    pass

    def begin(self) -> None:
        with self.cond:
            self.active += 1

    def done(self) -> None:
        with self.cond:
            self.active -= 1
            self.last = time.monotonic()
            self.cond.notify_all()

    def idle_for(self) -> float:
        with self.cond:
            return 0.0 if self.active else time.monotonic() - self.last


class _Spare:
    """One session channel opened ahead of the next command, which so waits one round trip less
    (the channel's open; its exec is the command's own). It takes one of sshd's MaxSessions."""

    def __init__(self, transport, timeout: float):
        self.transport, self.timeout = transport, timeout
        self.lock = threading.Lock()
        self.chan = None
        self.refill()

    def refill(self) -> None:
        threading.Thread(target=self._open, daemon=True).start()

    def _open(self) -> None:
        try:
            chan = self.transport.open_session(timeout=self.timeout)
        except Exception:  # the next command opens its own, and reports what fails
            return
        with self.lock:
            chan, self.chan = (chan, self.chan) if self.chan is not None else (None, chan)
        if chan is not None:
            chan.close()  # one is kept ready

    def take(self, timeout: float):
        with self.lock:
            chan, self.chan = self.chan, None
        self.refill()
        if chan is None or chan.closed:
            chan = self.transport.open_session(timeout=timeout)
        return chan


class _Probe:
    """Whether the host connection still answers, asked at each command: a keepalive request
    whose reply must come within PROBE_TIMEOUT. A connection that is up but wedged (the sshd
    serving it stopped, a dead route that TCP has not noticed) fails it; the command then goes
    the direct way, provably not started here, and the agent retires. An exec waits for it (one
    round trip); a warm program is handed to the warm runner meanwhile, whose taking it answers
    as well. Probes run one at a time (paramiko tracks one pending global request); once one
    failed, the rest fail at once."""

    def __init__(self, transport):
        self.transport = transport
        self.lock = threading.Lock()
        self.failed = False

    def alive(self) -> bool:
        with self.lock:
            if self.failed:
                return False
            answered = threading.Event()

            def ask() -> None:
                try:
                    self.transport.global_request("keepalive@openssh.com", wait=True)
                except Exception:
                    pass
                answered.set()
            threading.Thread(target=ask, daemon=True).start()
            self.failed = not answered.wait(PROBE_TIMEOUT) or not self.transport.is_active()
            return not self.failed

    def in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.alive, daemon=True)
        thread.start()
        return thread


def _hosts_from(spec: dict) -> tuple[Host, Inventory]:
    hosts = {name: Host(name=name, vars=h["vars"], groups=tuple(h["groups"]), source=h["source"])
             for name, h in spec["hosts"].items()}
    return hosts[spec["name"]], Inventory(path=spec.get("inventory") or "<agent>", hosts=hosts)


def _current_key(spec: dict) -> str | None:
    """The entry's key as its files say now (None: the entry is gone or unreadable)."""
    host, inventory = _hosts_from(spec)
    if spec.get("inventory"):
        try:
            inventory = load_inventory(spec["inventory"])
        except ServopsError:
            return None
        host = inventory.hosts.get(spec["name"])
        if host is None:
            return None
    return entry_key(host, inventory, spec["base"])


def _watched(spec: dict) -> list[str]:
    files = [spec["inventory"]] if spec.get("inventory") else []
    for h in spec["hosts"].values():
        files += [h["vars"][k] for k in ("ssh_key", "known_hosts") if h["vars"].get(k)]
    return files


def _signature(files: list[str]) -> list:
    sig = []
    for path in files:
        try:
            st = os.stat(path)
            sig.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            sig.append(None)
    return sig


def _relay(sock: socket.socket, chan, frames: Frames, early: list[tuple[str, bytes]]) -> None:
    """Between the client's socket and the command's channel until the command ends (or the
    client goes: then the channel is closed, as a direct command's would be)."""
    pending = bytearray()
    stdin_done = shut = False
    end = CommandEnd()

    def take(got: list[tuple[str, bytes]]) -> None:
        nonlocal stdin_done
        for kind, payload in got:
            if kind == "I" and not stdin_done:
                pending.extend(payload)
            elif kind == "i":
                stdin_done = True

    take(early)
    while True:
        busy = False
        if select.select([sock], [], [], 0)[0]:
            data = sock.recv(1 << 16)
            if not data:
                return  # the client went (Ctrl-C, its timeout, killed)
            take(frames.feed(data))
            busy = True
        if pending and chan.send_ready():
            del pending[:chan.send(bytes(pending[:65536]))]
            busy = True
        if stdin_done and not pending and not shut:
            chan.shutdown_write()
            shut = True
        while chan.recv_ready():
            sock.sendall(frame("o", chan.recv(65536)))
            busy = True
        while chan.recv_stderr_ready():
            sock.sendall(frame("e", chan.recv_stderr(65536)))
            busy = True
        if end.reached(chan):
            break
        if not busy:
            # A channel at EOF stays readable: poll it briefly until its exit status comes.
            quick = pending or chan.eof_received
            select.select([sock] if chan.eof_received else [sock, chan], [], [], 0.002 if quick else 0.05)
    while chan.recv_ready():
        sock.sendall(frame("o", chan.recv(65536)))
    while chan.recv_stderr_ready():
        sock.sendall(frame("e", chan.recv_stderr(65536)))
    sock.sendall(frame("x", str(chan.recv_exit_status()).encode()))


def _read_request(sock: socket.socket, frames: Frames) -> tuple[dict | None, list[tuple[str, bytes]]]:
    sock.settimeout(5)  # a client that connects and says nothing is dropped
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return None, []
        got = frames.feed(data)
        if got:
            sock.settimeout(None)
            kind, payload = got[0]
            request = json.loads(payload) if kind == "R" else None
            return (request if isinstance(request, dict) else None), got[1:]


def _collect_stdin(sock: socket.socket, frames: Frames, early: list[tuple[str, bytes]]) -> bytes | None:
    """The client's whole stdin (a warm program is sent whole), or None if the client went."""
    data, got = bytearray(), early
    while True:
        for kind, payload in got:
            if kind == "I":
                data += payload
            elif kind == "i":
                return bytes(data)
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        got = frames.feed(chunk)


def _run_warm(sock: socket.socket, runners: WarmRunners, python: str, frames: Frames,
              early: list[tuple[str, bytes]], probe: _Probe) -> list[tuple[str, bytes]] | None:
    """A warm program run by the host's warm interpreter, if one is ready and free: None when it
    ran (or its client went), else the client's stdin as frames, for the ordinary way (`S` is
    already sent then). [] when no runner took it: the ordinary way, from the start."""
    runner = runners.get(python)
    if not runner.acquire():
        return []
    probing = probe.in_background()
    sock.sendall(frame("S"))
    program = _collect_stdin(sock, frames, early)
    if program is None:
        runner.release()
        return None
    outcome = runner.run(program, sock, abandon=lambda: probe.failed)
    if outcome == Outcome.NOT_RUN:
        probing.join()
    if outcome == Outcome.LOST:
        sock.sendall(json_frame("L", {"error": "the host's warm interpreter ended mid-command"}))
    if outcome != Outcome.NOT_RUN:
        return None
    return [("I", program), ("i", b"")]


def _handle(sock: socket.socket, transport, probe: _Probe, spare: _Spare, runners: WarmRunners, state: _State,
            lost) -> None:
    chan = None
    try:
        if peer_uid(sock) != os.getuid():
            sys.stderr.write(f"refused a client of uid {peer_uid(sock)} (pid {peer_pid(sock)})\n")
            return
        frames = Frames()
        request, early = _read_request(sock, frames)
        if request is None:
            return
        sock.sendall(json_frame("A", {"pid": os.getpid(), "warnings": state.warnings}))
        if request.get("op") == "exit":
            state.retire()
            return
        if request.get("op") != "run":
            return
        state.persist = float(request.get("persist") or state.persist)
        started = False
        if isinstance(request.get("warm"), str):
            stdin = _run_warm(sock, runners, request["warm"], frames, early, probe)
            if stdin is None:
                return
            if stdin:  # the runner did not run it: the ordinary way, `S` already sent
                early, started = stdin, True
        if (probe.failed if started else not probe.alive()):  # (a warm hand-off probed already)
            # nothing ran: `F`, or `N` once `S` went (a warm hand-off that did not happen)
            sock.sendall(json_frame("N" if started else "F",
                                    {"error": f"the host connection did not answer within {PROBE_TIMEOUT:g}s"}))
            sys.stderr.write(f"the host connection did not answer a keepalive within {PROBE_TIMEOUT:g}s: retired\n")
            state.retire()
            return
        try:
            chan = spare.take(float(request["timeout"]))
        except lost as exc:
            sock.sendall(json_frame("L" if started else "F", {"error": str(exc)}))
            return
        chan.exec_command(str(request["command"]))
        if not started:
            sock.sendall(frame("S"))
        _relay(sock, chan, frames, early)
    except lost as exc:  # the host connection, or the client's socket
        try:
            sock.sendall(json_frame("L", {"error": str(exc)}))
        except OSError:
            pass
    except (ValueError, KeyError, TypeError, AgentLost):
        pass  # a malformed request: dropped
    finally:
        if chan is not None:
            chan.close()
        sock.close()
        if not transport.is_active() or probe.failed:
            state.retire()
        state.done()


def serve(spec: dict) -> int:
    from . import sshconnect

    path = spec["path"]
    lock_path = path[:-len(".sock")] + ".lock"
    # Another agent holds this key: one that serves (its socket is up) or starts, and this one
    # is not needed; or one that is ending (told to exit just now: its socket already gone),
    # whose place this one takes once it has.
    deadline = time.monotonic() + 10
    while (lock := take_lock(lock_path)) is None:
        if os.path.exists(path) or time.monotonic() > deadline:
            return 0
        time.sleep(0.05)
    listener = None
    try:
        if _current_key(spec) != spec["key"]:
            return 0  # the entry changed since the client looked: the next command starts afresh
        host, inventory = _hosts_from(spec)
        warnings: list[str] = []
        try:
            conn = sshconnect.open_connection(host, inventory, warn=warnings.append)
        except ServopsError as exc:
            sys.stderr.write(f"{exc}\n")
            return 1
        transport = conn.client.get_transport()
        transport.set_keepalive(15)
        state = _State(float(spec["persist"]), warnings)
        probe = _Probe(transport)
        spare = _Spare(transport, sshconnect.connect_timeout(host))
        runners = WarmRunners(transport, sshconnect.connect_timeout(host), float(spec["persist"]))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{path}.{os.getpid()}"
        for stale in (tmp, path):
            if os.path.lexists(stale):
                os.unlink(stale)  # a dead agent's: we hold the lock
        listener.bind(tmp)
        os.chmod(tmp, 0o600)
        listener.listen(64)
        os.rename(tmp, path)
        inode = os.stat(path).st_ino
        state.socket = (path, inode)
        watched = _watched(spec)
        signature, next_watch = _signature(watched), time.monotonic() + WATCH_EVERY
        while not state.stopping.is_set():
            if select.select([listener], [], [], 1.0)[0]:
                client, _ = listener.accept()
                state.begin()
                threading.Thread(target=_handle, args=(client, transport, probe, spare, runners, state,
                                                                sshconnect.LOST),
                                 daemon=True).start()
            if state.idle_for() > state.persist or not transport.is_active():
                break
            if time.monotonic() < next_watch:
                continue
            next_watch = time.monotonic() + WATCH_EVERY
            try:
                if os.stat(path).st_ino != inode:
                    break  # our socket was removed or replaced: nobody can reach us
            except FileNotFoundError:
                break
            now = _signature(watched)
            if now != signature:
                signature = now
                if _current_key(spec) != spec["key"]:
                    break  # the inventory entry, its key or its known_hosts changed
        # No new commands from here; those running finish (a `logs -f` keeps its connection).
        state.retire()
        listener.close()
        if probe.failed:
            conn.close()  # wedged: nothing more comes through it; what waits on it ends now
        with state.cond:
            while state.active:
                state.cond.wait(1.0)
        conn.close()
        return 0
    finally:
        if listener is not None:
            listener.close()
        log = path[:-len(".sock")] + ".log"
        if os.path.isfile(log) and not os.path.getsize(log):
            os.unlink(log)  # kept only when it says why the agent could not serve
        release_lock(lock, lock_path)


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    return serve(spec)


if __name__ == "__main__":
    sys.exit(main())
