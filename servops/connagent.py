"""Reaching a host through its connection agent: a per-user process (servops.connagentd) that
keeps one host's SSH connection open between commands, as OpenSSH's ControlMaster/ControlPersist do.

The first command to a host connects directly and, at its end, leaves an agent behind (the
host's `persist`, 10 minutes by default; SERVOPS_PERSIST or --no-persist override it). Later
commands reach the host through the agent's unix socket: no handshake, and the CLI never
imports paramiko. The agent

- opens its connection exactly as a direct command does (servops.sshconnect: known_hosts,
  @revoked, accept_new_host_keys), and is reached only by its own user: its socket lives in a
  0700 directory and both ends check the other's uid (SO_PEERCRED);
- is keyed by everything the connection depends on (address, port, user, key file and its
  content, proxy_jump, known_hosts and its content): a changed inventory entry means a new
  agent, and the old one is told to exit (it also notices the change itself within seconds);
- ends when idle for `persist`, when its connection dies, or when told to (`invoke disconnect`).

A client that finds no agent, a dead one, or one that does not answer within ACK_TIMEOUT (a
wedged one) connects directly instead: never a hang. Only a command that provably did not
start is moved to the direct path; one lost mid-way fails as it would have directly.

Protocol, one unix connection per command: frames of a kind byte, a 4-byte length and a
payload. Client -> agent: `R` request (JSON; `warm`: the remote python, for one of servops'
short read-only programs, which the agent may run in the host's warm interpreter:
servops.warmrunner), `I` stdin bytes, `i` end of stdin. Agent ->
client: `A` accepted (JSON: pid, known_hosts warnings), then `S` started or `F` could not open
a channel or its connection did not answer a keepalive (JSON error), then `o`/`e` stdout/stderr
bytes, and `x` exit status or `L` connection lost (JSON error); or, right after `S`, `N` not
run after all (JSON error: a warm program on a connection found wedged).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import select
import socket
import stat
import struct
import sys
import time

from .errors import InventoryError, ServopsError
from .inventory import Host, Inventory
from .schema import persist_seconds

PROTOCOL = 2
ACK_TIMEOUT = 0.5  # an agent that has not accepted a request by then is wedged: bypassed
MAX_FRAME = 16 << 20
# The vars a connection depends on: what an agent is given, and (with file contents) keyed by.
CONNECTION_VARS = ("ssh_host", "ssh_port", "ssh_user", "ssh_key", "known_hosts", "accept_new_host_keys",
                   "proxy_jump", "connect_timeout", "persist")


class AgentLost(OSError):
    """The agent reported the host connection lost mid-command, or went away itself."""


class NotStarted(Exception):
    """The agent, having said it started a command, did not run it after all (a warm program its
    runner did not take, on a connection found wedged): it may run elsewhere, as never started."""


# -- where agents live, and what they are keyed by ---------------------------------------------

_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        from .output import err_console

        err_console.print(text, markup=False)


def agent_dir() -> str | None:
    """This user's agent directory (created 0700), or None (with a warning) if it is not private."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    path = (os.environ.get("SERVOPS_AGENT_DIR") or (os.path.join(xdg, "servops-agent") if xdg else "")
            or f"/tmp/servops-agent-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        _warn_once(f"warning: cannot create {path} ({exc.strerror}); connections are not persisted")
        return None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        _warn_once(f"warning: {path} is not a private directory of this user (mode {stat.S_IMODE(st.st_mode):04o}, "
                   f"owner uid {st.st_uid}); connections are not persisted: chmod 700 it, or set SERVOPS_AGENT_DIR")
        return None
    return path


def effective_persist(host: Host) -> float:
    """Seconds an agent stays after its last command: SERVOPS_PERSIST (set by --no-persist) over
    the host's `persist`."""
    override = os.environ.get("SERVOPS_PERSIST")
    if override is None:
        return host.persist
    try:
        return persist_seconds(override)
    except ServopsError as exc:
        raise InventoryError(f"SERVOPS_PERSIST {override!r}: {exc}") from None


def _abspath(path: str | None, base: str) -> str | None:
    return os.path.join(base, os.path.expanduser(path)) if path else None


def _content_hash(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        return f"unreadable: {exc.errno}"


def _chain(host: Host, inventory: Inventory | None) -> list[Host]:
    """The host and the inventory hosts it jumps through (proxy_jump), nearest first."""
    hosts = [host]
    while inventory is not None and len(hosts) < 16:
        jump = hosts[-1].get("proxy_jump")
        if not jump or jump not in inventory.hosts or inventory.hosts[jump] in hosts:
            break
        hosts.append(inventory.hosts[jump])
    return hosts


def entry_key(host: Host, inventory: Inventory | None, base: str) -> str:
    """What a connection to `host` depends on, hashed: the same key, the same connection."""
    parts = []
    for h in _chain(host, inventory):
        key_file, known = _abspath(h.ssh_key, base), _abspath(h.known_hosts, base)
        parts.append([h.ssh_host, h.ssh_port, h.ssh_user, key_file, _content_hash(key_file), known,
                      _content_hash(known), h.accept_new_host_keys, h.get("proxy_jump"), h.get("connect_timeout"),
                      h.get("persist")])
    return hashlib.sha256(json.dumps([PROTOCOL, os.getuid(), parts]).encode()).hexdigest()[:16]


def identity(host: Host) -> str:
    """Which inventory entry an agent serves (its file and host name): one agent per entry."""
    source = os.path.realpath(host.source) if host.source and os.path.isfile(host.source) else host.source
    return hashlib.sha256(f"{source}\0{host.name}".encode()).hexdigest()[:12]


def peer_uid(sock: socket.socket) -> int | None:
    if hasattr(socket, "SO_PEERCRED"):
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
        return uid
    if hasattr(socket, "LOCAL_PEERCRED"):  # macOS, BSD: struct xucred {u_int version; uid_t uid; ...}
        return struct.unpack_from("Ii", sock.getsockopt(0, socket.LOCAL_PEERCRED, 76))[1]
    return None


def peer_pid(sock: socket.socket) -> int | None:
    if hasattr(socket, "SO_PEERCRED"):
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    return None


# -- frames -------------------------------------------------------------------------------------

def frame(kind: str, payload: bytes = b"") -> bytes:
    return kind.encode() + len(payload).to_bytes(4, "big") + payload


def json_frame(kind: str, obj) -> bytes:
    return frame(kind, json.dumps(obj).encode())


class Frames:
    """Incremental frame parser."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        self.buf += data
        out = []
        while len(self.buf) >= 5:
            size = int.from_bytes(self.buf[1:5], "big")
            if size > MAX_FRAME:
                raise AgentLost("the connection agent sent a malformed frame")
            if len(self.buf) < 5 + size:
                break
            out.append((chr(self.buf[0]), bytes(self.buf[5:5 + size])))
            del self.buf[:5 + size]
        return out


def _error_text(payload: bytes) -> str:
    try:
        return str(json.loads(payload).get("error"))
    except (ValueError, AttributeError):
        return "unreadable error from the connection agent"


# -- the client side ----------------------------------------------------------------------------

class AgentChannel:
    """A command started through the agent, with the part of paramiko's Channel interface that
    transport._exec uses; frames are read as the loop asks for data."""

    def __init__(self, sock: socket.socket, frames: Frames, early: list[tuple[str, bytes]]):
        sock.setblocking(False)
        self._sock, self._frames = sock, frames
        self._out, self._err, self._outgoing = bytearray(), bytearray(), bytearray()
        self._status: int | None = None
        self._error: str | None = None
        self._not_started: str | None = None
        self._handle(early)

    def fileno(self) -> int:
        return self._sock.fileno()

    def _handle(self, frames: list[tuple[str, bytes]]) -> None:
        for kind, payload in frames:
            if kind == "o":
                self._out += payload
            elif kind == "e":
                self._err += payload
            elif kind == "x":
                self._status = int(payload)
            elif kind == "L":
                self._error = _error_text(payload)
            elif kind == "N":
                self._not_started = _error_text(payload)

    def _pump(self) -> None:
        self._flush()
        if self._status is not None or self._error is not None or self._not_started is not None:
            return
        try:
            data = self._sock.recv(1 << 18)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._error = f"the connection agent went away ({exc.strerror or exc})"
            return
        if not data:
            self._error = "the connection agent went away"
            return
        self._handle(self._frames.feed(data))

    def _flush(self) -> None:
        while self._outgoing:
            try:
                sent = self._sock.send(self._outgoing)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._error = f"the connection agent went away ({exc.strerror or exc})"
                self._outgoing.clear()
                return
            del self._outgoing[:sent]

    def send_ready(self) -> bool:
        self._flush()
        return not self._outgoing

    def send(self, data: bytes) -> int:
        self._outgoing += frame("I", bytes(data))
        self._flush()
        return len(data)

    def shutdown_write(self) -> None:
        self._outgoing += frame("i")
        self._flush()

    def recv_ready(self) -> bool:
        if not self._out:
            self._pump()
        return bool(self._out)

    def recv(self, size: int) -> bytes:
        chunk = bytes(self._out[:size])
        del self._out[:size]
        return chunk

    def recv_stderr_ready(self) -> bool:
        if not self._err:
            self._pump()
        return bool(self._err)

    def recv_stderr(self, size: int) -> bytes:
        chunk = bytes(self._err[:size])
        del self._err[:size]
        return chunk

    def exit_status_ready(self) -> bool:
        self._pump()
        if self._not_started is not None:
            raise NotStarted(self._not_started)
        if self._error is not None and not self._out and not self._err:
            raise AgentLost(self._error)
        return self._status is not None

    def recv_exit_status(self) -> int:
        return self._status if self._status is not None else -1

    @property
    def eof_received(self) -> bool:
        return self._status is not None  # the agent sends the status once the output is all sent

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    def close(self) -> None:
        self._sock.close()


class Client:
    """How this process reaches one host's agent (whether or not one is running)."""

    def __init__(self, host: Host, inventory: Inventory | None, directory: str, persist: float):
        self.host, self.inventory, self.persist = host, inventory, persist
        self.base = os.getcwd()
        self.key = entry_key(host, inventory, self.base)
        self.ident = identity(host)
        self.path = os.path.join(directory, f"{self.ident}-{self.key}.sock")
        self.replaceable = True  # False: a live agent holds this key (wedged): none is left in its place

    def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(ACK_TIMEOUT)
        try:
            sock.connect(self.path)
            if peer_uid(sock) != os.getuid():
                raise PermissionError(errno.EPERM, "the agent's socket belongs to another user")
        except (FileNotFoundError, ConnectionRefusedError):  # none, or a dead one's socket
            sock.close()
            stop_agents(self.ident, self.path, os.path.dirname(self.path))  # one of the entry before it changed
            return None
        except OSError:  # a full backlog (wedged), another user's socket, ...
            sock.close()
            self.replaceable = False
            return None
        return sock

    def start(self, command: str, timeout: float, warm: str | None = None) -> AgentChannel | None:
        """`command` started through the agent, or None (the command did not start): connect directly.
        `warm`: the remote python whose warm interpreter may run it (a servops.remote.WARM program)."""
        from . import interrupt

        sock = self._connect()
        if sock is None:
            return None
        frames, started = Frames(), False
        try:
            request = {"op": "run", "command": command, "timeout": timeout, "persist": self.persist}
            if warm:
                request["warm"] = warm
            sock.sendall(json_frame("R", request))
            ack_by, start_by = time.monotonic() + ACK_TIMEOUT, time.monotonic() + timeout
            accepted = False
            while True:
                deadline = start_by if accepted else ack_by
                left = deadline - time.monotonic()
                if left <= 0:
                    if not accepted:
                        self.replaceable = False  # alive (it holds the socket) but not answering
                        return None
                    raise AgentLost("Timeout opening channel.")
                interrupt.check()
                if not select.select([sock], [], [], min(left, 0.1))[0]:
                    continue
                data = sock.recv(1 << 16)
                if not data:
                    if accepted:  # it ended between accepting and starting: the command never ran
                        return None
                    self.replaceable = False
                    return None
                got = frames.feed(data)
                for i, (kind, payload) in enumerate(got):
                    if kind == "A":
                        accepted = True
                        for text in json.loads(payload).get("warnings") or []:
                            _warn_once(str(text))
                    elif kind == "F":
                        return None  # no channel: its connection is gone, and it ends itself
                    elif kind == "S":
                        started = True
                        return AgentChannel(sock, frames, got[i + 1:])
        except (OSError, ValueError):
            if started:
                raise
            return None
        finally:
            if not started:
                sock.close()

    def leave(self) -> None:
        """Start an agent for this host in the background (it exits at once if one holds the key)."""
        import subprocess

        hosts = {}
        for h in _chain(self.host, self.inventory):
            conn_vars = {k: h.vars[k] for k in CONNECTION_VARS if k in h.vars}
            for k in ("ssh_key", "known_hosts"):
                if k in conn_vars:
                    conn_vars[k] = _abspath(str(conn_vars[k]), self.base)
            hosts[h.name] = {"vars": conn_vars, "groups": list(h.groups), "source": h.source}
        source = self.host.source
        spec = {"path": self.path, "key": self.key, "base": self.base, "name": self.host.name, "hosts": hosts,
                "inventory": os.path.realpath(source) if source and os.path.isfile(source) else None,
                "persist": self.persist}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        log = os.open(self.path[:-len(".sock")] + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "servops.connagentd"], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=log, cwd="/", env=env, start_new_session=True)
        finally:
            os.close(log)
        try:
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
        except OSError:
            pass


def client_for(host: Host, inventory: Inventory | None) -> Client | None:
    """The host's agent client, or None where connections are not persisted."""
    persist = effective_persist(host)
    if persist <= 0 or not (hasattr(socket, "SO_PEERCRED") or hasattr(socket, "LOCAL_PEERCRED")):
        return None
    directory = agent_dir()
    if directory and len(directory) > 64:  # a unix socket's path has room for about 100 bytes
        _warn_once(f"warning: {directory} is too long a path for the agents' sockets; connections are not persisted")
        return None
    return Client(host, inventory, directory, persist) if directory else None


def stop_agents(ident: str, keep: str | None = None, directory: str | None = None) -> list[int]:
    """Tell every agent of this inventory entry (but `keep`'s) to exit; the pids that were told."""
    directory = directory or agent_dir()
    if directory is None:
        return []
    told = []
    for name in sorted(os.listdir(directory)):  # <ident>-<key>.sock
        path = os.path.join(directory, name)
        if not (name.startswith(ident + "-") and name.endswith(".sock")) or path == keep:
            continue
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(ACK_TIMEOUT)
        try:
            sock.connect(path)
            if peer_uid(sock) != os.getuid():
                continue
            sock.sendall(json_frame("R", {"op": "exit"}))
            for kind, payload in Frames().feed(sock.recv(1 << 16)):
                if kind == "A":
                    told.append(int(json.loads(payload)["pid"]))
        except (ConnectionRefusedError, FileNotFoundError):
            _remove_stale(path)
        except (OSError, ValueError, KeyError):
            pass  # wedged: it ends when its idle time is up, or its key files change
        finally:
            sock.close()
    return told


def _remove_stale(sock_path: str) -> None:
    """A dead agent's socket and lock, removed unless a live agent holds the lock."""
    fd = take_lock(sock_path[:-len(".sock")] + ".lock")
    if fd is not None:
        for path in (sock_path, sock_path[:-len(".sock")] + ".log"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        release_lock(fd, sock_path[:-len(".sock")] + ".lock")


def disconnect(host: Host) -> list[int]:
    """`invoke disconnect`: end this host's agents (like `ssh -O exit`); the pids told."""
    return stop_agents(identity(host))


# -- the lock an agent holds for its life (taken by servops.connagentd) -------------------------

def take_lock(path: str) -> int | None:
    """An exclusive flock on `path`, held for the agent's life; None if another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # unlinked by its last holder in the meantime: lock the new file instead


def release_lock(fd: int, path: str) -> None:
    try:
        os.unlink(path)  # still holding it, so whoever opens the old file next sees it is gone
    except FileNotFoundError:
        pass
    os.close(fd)
