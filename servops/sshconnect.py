"""Opening an SSH connection over fabric/paramiko, with host-key checking ON.

Fabric's Connection installs paramiko's AutoAddPolicy; we replace it on every client with a
policy that refuses unknown keys unless the host opts in (`accept_new_host_keys: true`, the
equivalent of OpenSSH's StrictHostKeyChecking=accept-new). A changed key is always refused.

Imported only where a connection is made (a command run directly, or the connection agent),
so a command that goes through a warm agent never loads paramiko.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Callable

import paramiko
from fabric import Connection

from .errors import HostKeyError, InventoryError, TransportError
from .inventory import Host, Inventory, lab_hint

DEFAULT_CONNECT_TIMEOUT = 10

# What paramiko raises for a connection that broke mid-command (next to OSError and EOFError).
LOST = (OSError, EOFError, paramiko.SSHException)

# paramiko logs a failed handshake (a missing banner, say) with a traceback through the logging
# fallback handler on stderr; servops reports each such failure itself, in one line.
if not os.environ.get("SERVOPS_DEBUG"):
    logging.getLogger("paramiko").addHandler(logging.NullHandler())
    logging.getLogger("paramiko").propagate = False


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


def _refuse_revoked(client, label: str, hostname: str, key, known_hosts: str) -> None:
    if (key.get_name(), key.get_base64()) in getattr(client, "_servops_revoked", set()):
        raise HostKeyError(f"{label}: host key for {hostname} ({key.get_name()}) is marked @revoked in "
                           f"{known_hosts}; refusing to connect")


def _print_warning(text: str) -> None:
    from .output import err_console

    err_console.print(text, markup=False)


def load_known_hosts(client: paramiko.SSHClient, path: str, warn: Callable[[str], None] = _print_warning) -> None:
    """Like OpenSSH: a malformed line is skipped with a warning naming the file and line, and
    every other host's key still counts (paramiko would refuse the whole file). A `@revoked`
    key is refused for every host, even where another line lists it; `@cert-authority` lines
    (host certificates) are not supported and are skipped."""
    from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

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
                    warn(f"warning: {path}:{lineno}: malformed known_hosts line skipped ({reason})")
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


def _secure(conn: Connection, host: Host, warn: Callable[[str], None]) -> Connection:
    client = conn.client
    known = host.known_hosts
    if os.path.exists(known):
        load_known_hosts(client, known, warn)
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


def connect_timeout(host: Host) -> float:
    return float(host.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT))


def make_connection(host: Host, inventory: Inventory | None = None,
                    warn: Callable[[str], None] = _print_warning) -> Connection:
    timeout = connect_timeout(host)
    # banner and auth timeouts too: a frozen sshd accepts TCP but never speaks.
    connect_kwargs = {"look_for_keys": host.ssh_key is None, "allow_agent": host.ssh_key is None,
                      "banner_timeout": timeout, "auth_timeout": timeout}
    if host.ssh_key:
        connect_kwargs["key_filename"] = [host.ssh_key]
    gateway = None
    jump = host.get("proxy_jump")
    if jump:
        if inventory is not None and jump in inventory.hosts:
            gateway = make_connection(inventory.hosts[jump], inventory, warn)
        else:
            user, jhost, jport = _parse_jump(str(jump))
            jump_vars = dict(host.vars, ssh_host=jhost, ssh_port=jport or 22, ssh_user=user or host.ssh_user)
            jump_vars.pop("proxy_jump", None)
            gateway = make_connection(Host(name=f"{host.name}-jump", vars=jump_vars, source=host.source), None, warn)
    conn = Connection(
        host=host.ssh_host,
        user=host.ssh_user,
        port=host.ssh_port,
        connect_kwargs=connect_kwargs,
        connect_timeout=timeout,
        gateway=gateway if gateway is not None else False,
    )
    return _secure(conn, host, warn)


def open_connection(host: Host, inventory: Inventory | None = None, conn: Connection | None = None,
                    warn: Callable[[str], None] = _print_warning) -> Connection:
    """`conn` (or a new connection to `host`), open and authenticated; every failure is one line."""
    conn = conn or make_connection(host, inventory, warn)
    if conn.is_connected:
        return conn
    where = f"{host.ssh_host}:{host.ssh_port}"
    timeout = connect_timeout(host)
    try:
        conn.open()
    except (HostKeyError, TransportError):
        raise
    except paramiko.BadHostKeyException as exc:
        raise HostKeyError(
            f"{host.name}: host key for {exc.hostname} CHANGED (not the one in {host.known_hosts}); "
            f"refusing to connect. If the host was reinstalled, remove the old entry with ssh-keygen -R"
        ) from None
    except paramiko.AuthenticationException as exc:
        raise TransportError(
            f"{host.name}: SSH authentication failed as {host.ssh_user}@{host.ssh_host}:"
            f"{host.ssh_port} ({exc}); check ssh_user and ssh_key"
        ) from None
    except (socket.timeout, TimeoutError):
        raise TransportError(f"{host.name}: {where} did not answer within "
                             f"{timeout:g}s (connect timed out){lab_hint(host)}") from None
    except paramiko.SSHException as exc:
        text = str(exc)
        if "banner" in text.lower() or "No existing session" in text or "timeout" in text.lower():
            raise TransportError(f"{host.name}: {where} did not answer within {timeout:g}s "
                                 f"(no SSH handshake: is sshd hung?){lab_hint(host)}") from None
        raise TransportError(f"{host.name}: cannot connect to {where}: {exc}") from None
    except OSError as exc:
        raise TransportError(f"{host.name}: cannot connect to {where}: "
                             f"{exc.strerror or exc}{lab_hint(host)}") from None
    return conn
