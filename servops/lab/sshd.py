"""A real OpenSSH server on a loopback address, with its own config, host key and authorized_keys."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")


def find_sshd() -> str | None:
    for cand in SSHD_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    return shutil.which("sshd")


# Where free_port draws from: "LOW-HIGH" (the test suite gives each parallel worker its own
# slice, so two workers never pick the same port between its check and its bind).
PORTS_ENV = "SERVOPS_LAB_PORTS"


def port_range() -> tuple[int, int]:
    low, _, high = os.environ.get(PORTS_ENV, "20000-32000").partition("-")
    return int(low), int(high)


_HANDED_OUT: set[int] = set()  # this process' answers: free now, but maybe not bound by anyone yet


def free_port(address: str = "0.0.0.0") -> int:
    """A free port below the kernel's ephemeral range (32768+ on Linux), so no outgoing
    connection can take it between now and when a server binds it; never one this process
    handed out before (four hosts' ports asked for in a row, none bound yet, once got the same
    one twice), until half the range has been."""
    import random

    low, high = port_range()
    if len(_HANDED_OUT) > (high - low + 1) // 2:
        _HANDED_OUT.clear()
    for _ in range(200):
        port = random.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")


def keygen(path: Path, kind: str = "ed25519") -> Path:
    """A new key pair at `path` and `path`.pub, made beside them and renamed in, the private key
    last: a run killed midway leaves no key without its .pub (has_key says whether both are there)."""
    scratch = path.with_name(f".{path.name}.new")
    for leftover in (scratch, Path(f"{scratch}.pub")):  # a killed keygen's
        leftover.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(scratch)], check=True)
    os.replace(f"{scratch}.pub", f"{path}.pub")
    os.replace(scratch, path)
    return path


def has_key(path: Path) -> bool:
    return path.is_file() and path.with_name(path.name + ".pub").is_file()


@dataclass
class SshServer:
    address: str
    port: int
    workdir: Path
    host_key: Path
    client_key: Path
    user: str
    proc: subprocess.Popen | None = None
    home: Path | None = None  # the "host's" HOME (the lab: the home of whoever ran lab.up)
    # variables every session gets, as a host's /etc/environment sets them
    env: dict[str, str] | None = None

    @property
    def known_hosts_line(self) -> str:
        kind, b64 = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"[{self.address}]:{self.port} {kind} {b64}\n"

    def _set_env(self) -> str:
        pairs = ([f"HOME={self.home}"] if self.home else []) + [f"{k}={v}" for k, v in (self.env or {}).items()]
        if any(c in '"\n\r' for pair in pairs for c in pair):  # sshd_config quotes with '"', has no escape
            raise ValueError(f"sshd SetEnv cannot hold a double quote or a line break: {pairs}")
        return ("SetEnv " + " ".join('"%s"' % p for p in pairs) + "\n") if pairs else ""

    def start(self) -> "SshServer":
        sshd = find_sshd()
        if not sshd:
            raise RuntimeError("sshd not found: install openssh-server (see README)")
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege-separation dir
        config = self.workdir / "sshd_config"
        config.write_text(
            f"ListenAddress {self.address}\nPort {self.port}\nHostKey {self.host_key}\n"
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}\nPidFile {self.workdir / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\nMaxStartups 100:30:200\n"
            "MaxSessions 100\nAllowTcpForwarding yes\nPrintMotd no\nLogLevel ERROR\n"
            f"Subsystem sftp internal-sftp\nAllowUsers {self.user}\n"
            + self._set_env()
        )
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.workdir / "sshd.log", "ab"), start_new_session=True)
        deadline = time.time() + 60  # sshd answers in milliseconds, a loaded machine's in seconds
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.workdir / 'sshd.log').read_text()}")
            try:
                with socket.create_connection((self.address, self.port), timeout=0.5) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd on {self.address}:{self.port} did not come up")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


def make_server(address: str, workdir: Path, client_key: Path) -> SshServer:
    workdir.mkdir(parents=True, exist_ok=True)
    host_key = keygen(workdir / "ssh_host_ed25519_key")
    (workdir / "authorized_keys").write_text(client_key.with_suffix(".pub").read_text())
    os.chmod(workdir / "authorized_keys", 0o600)
    return SshServer(address, free_port(address), workdir, host_key, client_key, getpass.getuser())
