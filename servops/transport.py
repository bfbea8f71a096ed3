"""SSH transport over fabric, with host-key checking ON.

Fabric's Connection installs paramiko's AutoAddPolicy; we replace it on every client with a
policy that refuses unknown keys unless the host opts in (`accept_new_host_keys: true`, the
equivalent of OpenSSH's StrictHostKeyChecking=accept-new). A changed key is always refused.
"""

from __future__ import annotations

import codecs
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import paramiko
from fabric import Connection

from . import interrupt
from .errors import HostKeyError, InventoryError, TransportError
from .inventory import Host, Inventory
from .redact import Redactor

DEFAULT_CONNECT_TIMEOUT = 10
DEFAULT_COMMAND_TIMEOUT = 300


class _RefuseUnknownKey(paramiko.MissingHostKeyPolicy):
    def __init__(self, host_label: str, known_hosts: str):
        self.host_label = host_label
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        _refuse_revoked(client, self.host_label, hostname, key, self.known_hosts)
        raise HostKeyError(
            f"{self.host_label}: host key for {hostname} ({key.get_name()}) is not in {self.known_hosts}; "
            f"verify it and add it (ssh-keyscan), or set accept_new_host_keys: true for this host"
        )


class _AcceptNewKey(paramiko.MissingHostKeyPolicy):
    """Trust-on-first-use: record an unknown key in known_hosts (never a changed one)."""

    _lock = threading.Lock()

    def __init__(self, known_hosts: str, host_label: str = ""):
        self.known_hosts = known_hosts
        self.host_label = host_label

    def missing_host_key(self, client, hostname, key):
        _refuse_revoked(client, self.host_label, hostname, key, self.known_hosts)  # never trust it anew
        with self._lock:
            os.makedirs(os.path.dirname(self.known_hosts) or ".", exist_ok=True)
            line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
            with open(self.known_hosts, "a") as fh:
                fh.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)


@dataclass
class CommandResult:
    command: str
    stdout: str
    stderr: str
    exited: int

    @property
    def ok(self) -> bool:
        return self.exited == 0


def _parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` -> (user, host, port)."""
    user = None
    if "@" in spec:
        user, spec = spec.rsplit("@", 1)
    port = None
    if spec.count(":") == 1:
        spec, port_s = spec.split(":")
        if not port_s.isdigit():
            raise InventoryError(f"proxy_jump '{spec}:{port_s}': port must be a number")
        port = int(port_s)
    return user, spec, port


_warned: set[tuple[str, int]] = set()


def lab_hint(host: Host) -> str:
    """A host of servops' own lab (group `lab`, on loopback): say how to start it."""
    if "lab" in host.groups and host.ssh_host.startswith("127."):
        return f"; is the lab up? invoke lab.up -H {host.name}"
    return ""


def _refuse_revoked(client, label: str, hostname: str, key, known_hosts: str) -> None:
    if (key.get_name(), key.get_base64()) in getattr(client, "_servops_revoked", set()):
        raise HostKeyError(f"{label}: host key for {hostname} ({key.get_name()}) is marked @revoked in "
                           f"{known_hosts}; refusing to connect")


def load_known_hosts(client: paramiko.SSHClient, path: str) -> None:
    """Like OpenSSH: a malformed line is skipped with a warning naming the file and line, and
    every other host's key still counts (paramiko would refuse the whole file). A `@revoked`
    key is refused for every host, even where another line lists it; `@cert-authority` lines
    (host certificates) are not supported and are skipped."""
    from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

    from .output import err_console

    keys = client.get_host_keys()
    revoked = client.__dict__.setdefault("_servops_revoked", set())
    entries = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            marker = None
            if line.startswith("@"):
                marker, _, line = line.partition(" ")
                line = line.strip()
                if marker == "@cert-authority":
                    continue
                if marker != "@revoked":
                    line = ""  # an unknown marker: malformed
            try:
                entry = HostKeyEntry.from_line(line, lineno)
            except (InvalidHostKey, ValueError, TypeError, paramiko.SSHException) as exc:
                entry, reason = None, str(exc.args[-1] if getattr(exc, "args", None) else exc)
            else:
                reason = "not a known_hosts entry"
            if entry is None or entry.key is None:
                if (path, lineno) not in _warned:
                    _warned.add((path, lineno))
                    err_console.print(f"warning: {path}:{lineno}: malformed known_hosts line skipped ({reason})",
                                      markup=False)
                continue
            if marker == "@revoked":
                revoked.add((entry.key.get_name(), entry.key.get_base64()))
                continue
            entries.append(entry)
    for entry in entries:
        if (entry.key.get_name(), entry.key.get_base64()) in revoked:
            continue  # listed and revoked: unknown, and the missing-key policy refuses it as revoked
        for name in entry.hostnames:
            keys.add(name, entry.key.get_name(), entry.key)


def _secure(conn: Connection, host: Host) -> Connection:
    client = conn.client
    known = host.known_hosts
    if os.path.exists(known):
        load_known_hosts(client, known)
    elif not host.accept_new_host_keys:
        raise HostKeyError(
            f"{host.name}: known_hosts file {known} does not exist; create it with the host's key "
            f"(ssh-keyscan -p {host.ssh_port} {host.ssh_host}) or set accept_new_host_keys: true{lab_hint(host)}"
        )
    if host.accept_new_host_keys:
        client.set_missing_host_key_policy(_AcceptNewKey(known, host.name))
    else:
        client.set_missing_host_key_policy(_RefuseUnknownKey(host.name, known))
    return conn


def make_connection(host: Host, inventory: Inventory | None = None) -> Connection:
    timeout = float(host.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT))
    # banner and auth timeouts too: a frozen sshd accepts TCP but never speaks.
    connect_kwargs = {"look_for_keys": host.ssh_key is None, "allow_agent": host.ssh_key is None,
                      "banner_timeout": timeout, "auth_timeout": timeout}
    if host.ssh_key:
        connect_kwargs["key_filename"] = [host.ssh_key]
    gateway = None
    jump = host.get("proxy_jump")
    if jump:
        if inventory is not None and jump in inventory.hosts:
            gateway = make_connection(inventory.hosts[jump], inventory)
        else:
            user, jhost, jport = _parse_jump(str(jump))
            jump_vars = dict(host.vars, ssh_host=jhost, ssh_port=jport or 22, ssh_user=user or host.ssh_user)
            jump_vars.pop("proxy_jump", None)
            gateway = make_connection(Host(name=f"{host.name}-jump", vars=jump_vars, source=host.source))
    conn = Connection(
        host=host.ssh_host,
        user=host.ssh_user,
        port=host.ssh_port,
        connect_kwargs=connect_kwargs,
        connect_timeout=timeout,
        gateway=gateway if gateway is not None else False,
    )
    return _secure(conn, host)


class CommandTimeout(Exception):
    pass


class OutputTooLarge(Exception):
    pass


# What one command may return (stdout, stderr each). A streamed command (`logs -f`, a bench's
# progress) is consumed as it arrives: only its last KEEP_STREAMED bytes are kept, so following
# a chatty server for days costs no memory; a host that floods any other command is refused.
MAX_OUTPUT = 512 << 20
KEEP_STREAMED = 16 << 20


def _exec(transport: paramiko.Transport, command: str, stdin: str | bytes | None, timeout: float,
          on_output: Callable[[str], None] | None) -> tuple[int, str, str]:
    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    chan = transport.open_session(timeout=timeout)
    try:
        chan.exec_command(command)
        deadline = time.monotonic() + timeout
        out, err = bytearray(), bytearray()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across chunks
        pos = 0
        if not data:
            chan.shutdown_write()
        while True:
            busy = False
            if pos < len(data) and chan.send_ready():
                pos += chan.send(data[pos:pos + 65536])
                busy = True
                if pos >= len(data):
                    chan.shutdown_write()
            while chan.recv_ready():
                chunk = chan.recv(65536)
                out += chunk
                if on_output:
                    on_output(decoder.decode(chunk))
                    if len(out) > 2 * KEEP_STREAMED:
                        del out[:-KEEP_STREAMED]
                elif len(out) > MAX_OUTPUT:
                    raise OutputTooLarge("stdout")
                busy = True
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
                if len(err) > MAX_OUTPUT:
                    del err[:-KEEP_STREAMED]  # stderr is only ever read for its last lines
                busy = True
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            if time.monotonic() > deadline:
                raise CommandTimeout()
            interrupt.check()
            if not busy:
                select.select([chan], [], [], 0.002)
        # Output that arrived between the last read and the exit status.
        while chan.recv_ready():
            out += chan.recv(65536)
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
        return chan.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace")
    finally:
        chan.close()


class HostSession:
    """One host's connection, opened on first use and reused for the whole task."""

    def __init__(self, host: Host, inventory: Inventory | None = None, redactor: Redactor | None = None):
        self.host = host
        self.inventory = inventory
        self.redactor = redactor or Redactor.for_host(host)
        self._conn: Connection | None = None
        self.cache: dict = {}  # per-task facts about the host (site-packages dirs, ...)
        self.round_trips = 0

    @property
    def connection(self) -> Connection:
        if self._conn is None:
            self._conn = make_connection(self.host, self.inventory)
        if not self._conn.is_connected:
            try:
                self._conn.open()
            except (HostKeyError, TransportError):
                raise
            except paramiko.BadHostKeyException as exc:
                raise HostKeyError(
                    f"{self.host.name}: host key for {exc.hostname} CHANGED (not the one in {self.host.known_hosts}); "
                    f"refusing to connect. If the host was reinstalled, remove the old entry with ssh-keygen -R"
                ) from None
            except paramiko.AuthenticationException as exc:
                raise TransportError(
                    f"{self.host.name}: SSH authentication failed as {self.host.ssh_user}@{self.host.ssh_host}:"
                    f"{self.host.ssh_port} ({exc}); check ssh_user and ssh_key"
                ) from None
            except (socket.timeout, TimeoutError):
                raise TransportError(f"{self.host.name}: {self._where()} did not answer within "
                                     f"{self._timeout():g}s (connect timed out){self._lab_hint()}") from None
            except paramiko.SSHException as exc:
                text = str(exc)
                if "banner" in text.lower() or "No existing session" in text or "timeout" in text.lower():
                    raise TransportError(f"{self.host.name}: {self._where()} did not answer within {self._timeout():g}s "
                                         f"(no SSH handshake: is sshd hung?){self._lab_hint()}") from None
                raise TransportError(f"{self.host.name}: cannot connect to {self._where()}: {exc}") from None
            except OSError as exc:
                raise TransportError(f"{self.host.name}: cannot connect to {self._where()}: "
                                     f"{exc.strerror or exc}{self._lab_hint()}") from None
        return self._conn

    def _where(self) -> str:
        return f"{self.host.ssh_host}:{self.host.ssh_port}"

    def _timeout(self) -> float:
        return float(self.host.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT))

    def _lab_hint(self) -> str:
        return lab_hint(self.host)

    def run(self, command: str, stdin: str | bytes | None = None, timeout: int | None = None,
            check: bool = False, on_output: Callable[[str], None] | None = None) -> CommandResult:
        """Run one command on its own channel of the shared connection.

        Uses paramiko's channel directly: invoke's runner feeds stdin one byte per 10 ms,
        far too slow for shipping a program over stdin.
        """
        conn = self.connection
        timeout = timeout or int(self.host.get("command_timeout", DEFAULT_COMMAND_TIMEOUT))
        self.round_trips += 1
        try:
            exited, out, err = _exec(conn.transport, command, stdin, timeout, on_output)
        except OutputTooLarge:
            raise TransportError(f"{self.host.name}: the remote command sent more than {MAX_OUTPUT >> 20} MiB of "
                                 f"output; refusing the rest: {self.redactor(command)[:200]}") from None
        except CommandTimeout:
            raise TransportError(
                f"{self.host.name}: remote command timed out after {timeout}s: {self.redactor(command)[:200]}"
            ) from None
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self.close()
            raise TransportError(f"{self.host.name}: SSH connection lost: {exc}") from None
        result = CommandResult(command=command, stdout=out, stderr=err, exited=exited)
        if check and not result.ok:
            lines = (result.stderr or result.stdout).strip().splitlines()
            detail = self.redactor(lines[-1]) if lines else ""
            raise TransportError(f"{self.host.name}: remote command failed (exit {result.exited}): {detail}")
        return result

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


class Session:
    """All host connections of one task; closes them at the end."""

    def __init__(self, inventory: Inventory | None = None):
        self.inventory = inventory
        self._hosts: dict[str, HostSession] = {}

    def host(self, host: Host) -> HostSession:
        if host.name not in self._hosts:
            self._hosts[host.name] = HostSession(host, self.inventory)
        return self._hosts[host.name]

    def close(self) -> None:
        for hs in self._hosts.values():
            hs.close()
        self._hosts.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
