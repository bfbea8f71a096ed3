"""Running commands on hosts: one HostSession per host and task, each command on its own channel.

A command goes through the host's connection agent (servops.connagent) when one is warm: no
handshake, and paramiko is never imported. Otherwise it opens a direct connection
(servops.sshconnect, host keys checked) and, when the host's `persist` allows, leaves an agent
holding a connection for the next command, as OpenSSH's ControlPersist does.
"""

from __future__ import annotations

import codecs
import json
import os
import secrets
import select
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import interrupt
from .chanend import CommandEnd
from .connagent import NotStarted
from .errors import CommandFailed, InventoryError, ServopsError, TransportError
from .inventory import Host, Inventory, lab_hint
from .redact import Redactor

DEFAULT_COMMAND_TIMEOUT = 300


@dataclass
class CommandResult:
    command: str
    stdout: str
    stderr: str
    exited: int

    @property
    def ok(self) -> bool:
        return self.exited == 0


class CommandTimeout(Exception):
    pass


class OutputTooLarge(Exception):
    pass


# What one command may return (stdout, stderr each). A streamed command (`logs -f`, a bench's
# progress) is consumed as it arrives: only its last KEEP_STREAMED bytes are kept, so following
# a chatty server for days costs no memory; a host that floods any other command is refused.
MAX_OUTPUT = 512 << 20
KEEP_STREAMED = 16 << 20

# Each command line starts by marking its processes' environment with an id of its own, so that
# a command given up on (timed out) can be ended on the host with everything it started
# (servops/remote/end_command.py), whether or not its processes kept its session or group.
COMMAND_ENV = "SERVOPS_COMMAND"
END_TIMEOUT = 15  # seconds for ending a timed-out command's processes


def marked(command: str, mark: str) -> str:
    return f"export {COMMAND_ENV}={mark}\n{command}"


def _exec(chan, stdin: str | bytes | None, timeout: float,
          on_output: Callable[[str], None] | None) -> tuple[int, str, str]:
    """Feed a started command its stdin and collect its output. `chan` is a paramiko Channel, or
    the connection agent's stand-in for one (connagent.AgentChannel): the same loop, the same
    bounds, timeout and Ctrl-C handling either way."""
    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    try:
        deadline = time.monotonic() + timeout
        out, err = bytearray(), bytearray()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across chunks
        pos = 0
        end = CommandEnd()
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
            if end.reached(chan):
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


def check_key_files(host: Host, inventory: Inventory | None) -> None:
    """An `ssh_key` that is not a readable file is the inventory's mistake: say which file, host
    and key (paramiko would only say "No such file or directory"). The jump hosts' keys too."""
    seen = set()
    while host is not None and host.name not in seen:
        seen.add(host.name)
        key = host.ssh_key
        if key:
            problem = ("does not exist" if not os.path.lexists(key) else "is not a file" if not os.path.isfile(key)
                       else "cannot be read" if not os.access(key, os.R_OK) else "")
            if problem:
                # a lab host's key is made by lab.up: a missing one means the lab was never started
                fix = lab_hint(host).lstrip("; ") or "fix ssh_key (or create the key) for this host"
                raise InventoryError(f"{host.source or '<inventory>'}: host '{host.name}': ssh_key {key} {problem}; "
                                     f"{fix}")
        jump = host.get("proxy_jump")
        host = inventory.hosts.get(jump) if inventory is not None and jump else None


class HostSession:
    """One host's connection, opened on first use and reused for the whole task."""

    def __init__(self, host: Host, inventory: Inventory | None = None, redactor: Redactor | None = None):
        self.host = host
        self.inventory = inventory
        self.redactor = redactor or Redactor.for_host(host)
        self._conn = None  # the direct connection (fabric), when one was opened
        self._lost: tuple[type[BaseException], ...] = (OSError, EOFError)  # + paramiko's, once it is loaded
        self._agent = None  # connagent.Client once looked up (False: persist is off)
        self._via_agent = True  # False once the agent was bypassed or lost in this task
        self._leave_agent = False  # a direct connection served this task: leave an agent for the next
        self._lock = threading.Lock()
        self.cache: dict = {}  # per-task facts about the host (site-packages dirs, ...)
        self.round_trips = 0  # commands run on the host in this task (each one SSH channel)
        self.programs: list[str] = []  # servops' remote programs among them, in order (op too, where one)

    @property
    def connection(self):
        """The direct connection (fabric), opened on first use."""
        if self._conn is None or not self._conn.is_connected:
            from . import sshconnect

            check_key_files(self.host, self.inventory)
            self._conn = sshconnect.open_connection(self.host, self.inventory, self._conn)
            self._lost = sshconnect.LOST
        return self._conn

    def _agent_client(self):
        with self._lock:
            if self._agent is None:
                from . import connagent

                check_key_files(self.host, self.inventory)
                self._agent = connagent.client_for(self.host, self.inventory) or False
            return self._agent if self._via_agent else None

    def _start(self, command: str, timeout: float, warm: str | None = None):
        """`command` started on a channel: through the warm agent, else directly."""
        agent = self._agent_client() if self._conn is None else None
        if agent:
            chan = agent.start(command, timeout, warm)
            if chan is not None:
                return chan
            self._via_agent = False  # absent, dead or wedged: bypassed for the rest of the task
        transport = self.connection.transport
        if agent and agent.replaceable:
            self._leave_agent = True
        chan = transport.open_session(timeout=timeout)
        try:
            chan.exec_command(command)
        except BaseException:
            chan.close()
            raise
        return chan

    def run(self, command: str, stdin: str | bytes | None = None, timeout: int | None = None,
            check: bool = False, on_output: Callable[[str], None] | None = None,
            warm: str | None = None) -> CommandResult:
        """Run one command on its own channel of the shared connection. `warm` (a remote python):
        the command is `warm -` running one of servops' short read-only programs, which a warm
        agent may run in that python's warm interpreter on the host (servops.warmrunner).

        Uses paramiko's channel directly: invoke's runner feeds stdin one byte per 10 ms,
        far too slow for shipping a program over stdin.
        """
        timeout = timeout or int(self.host.get("command_timeout", DEFAULT_COMMAND_TIMEOUT))
        self.round_trips += 1
        mark = secrets.token_hex(8)
        try:
            try:
                exited, out, err = _exec(self._start(marked(command, mark), timeout, warm), stdin, timeout, on_output)
            except NotStarted:  # through an agent whose connection turned out wedged: direct
                self._via_agent = False
                exited, out, err = _exec(self._start(marked(command, mark), timeout, warm), stdin, timeout, on_output)
        except OutputTooLarge:
            ended = self._end_command(mark)
            raise CommandFailed(f"{self.host.name}: the remote command sent more than {MAX_OUTPUT >> 20} MiB of "
                                f"output; refusing the rest{ended}: {self.redactor(command)[:200]}") from None
        except CommandTimeout:
            ended = self._end_command(mark)
            raise CommandFailed(
                f"{self.host.name}: remote command timed out after {timeout}s{ended}: {self.redactor(command)[:200]}"
            ) from None
        except self._lost as exc:
            self._drop()
            raise TransportError(f"{self.host.name}: SSH connection lost: {exc}") from None
        result = CommandResult(command=command, stdout=out, stderr=err, exited=exited)
        if check and not result.ok:
            lines = (result.stderr or result.stdout).strip().splitlines()
            detail = self.redactor(lines[-1]) if lines else ""
            raise TransportError(f"{self.host.name}: remote command failed (exit {result.exited}): {detail}")
        return result

    def _end_command(self, mark: str) -> str:
        """End, on the host, the processes of the command marked `mark` (given up on: it keeps
        running there otherwise); what was done, as a clause of the error line."""
        from . import remote, shell
        from .inventory import deploy_root

        args = {"mark": mark, "deploy_root": deploy_root(self.host)}  # its release guards are kept
        try:
            res = self.run(shell.python_stdin(self.host.python), stdin=remote.with_args("end_command", args),
                           timeout=END_TIMEOUT)
            done = json.loads(res.stdout.strip().splitlines()[-1])
            ended = int(done["ended"])
        except (ServopsError, ValueError, LookupError, TypeError) as exc:
            return f" (its processes on the host could not be ended: {self.redactor(str(exc))[:200]})"
        if not ended:
            return " (nothing of it was left running on the host)"
        return f" and was ended on the host ({ended} process{'es' if ended > 1 else ''})"

    def _drop(self) -> None:
        """After a lost connection: the next command connects afresh; no agent is left behind."""
        self._via_agent = self._leave_agent = False
        self._close_direct()

    def _close_direct(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def close(self) -> None:
        try:
            self._close_direct()
        finally:
            if self._leave_agent:
                self._leave_agent = False
                self._agent.leave()


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
