"""`invoke lab.up` / `lab.down`: the lab of inventory/lab.yml on this machine, for a first deploy.

Real sshd servers on 127.0.0.2.. port 2222 (keys and known_hosts under ~/.servops-lab), and the
same real venv the tests use (CPU torch + flashinfer-python 0.7.2.post1) linked at
~/.servops-lab/venv. /tmp/servops-lab-cuda stands in for a CUDA toolkit (its version.json only).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from . import remote_venv
from .sshd import SshServer, keygen

LAB = Path.home() / ".servops-lab"
CUDA_STANDIN = Path("/tmp/servops-lab-cuda")
PORT = 2222


def up(n_hosts: int = 1) -> list[str]:
    LAB.mkdir(exist_ok=True)
    key = LAB / "id_ed25519"
    if not key.exists():
        keygen(key)
    venv = LAB / "venv"
    if not venv.exists():
        venv.symlink_to(remote_venv.build_venv())
    CUDA_STANDIN.mkdir(exist_ok=True)
    (CUDA_STANDIN / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "12.9.1"}}')
    lines, started = [], []
    for i in range(n_hosts):
        address = f"127.0.0.{i + 2}"
        work = LAB / f"sshd-{address}"
        work.mkdir(exist_ok=True)
        if not (work / "ssh_host_ed25519_key").exists():
            keygen(work / "ssh_host_ed25519_key")
        (work / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
        import getpass
        srv = SshServer(address, PORT, work, work / "ssh_host_ed25519_key", key, getpass.getuser())
        pidfile = work / "sshd.pid"
        if not (pidfile.exists() and _alive(int(pidfile.read_text().split()[0]))):
            srv.start()
            pidfile.write_text(str(srv.proc.pid))
            srv.proc = None  # keep it running after this process exits
            started.append(address)
        lines.append(srv.known_hosts_line)
    (LAB / "known_hosts").write_text("".join(lines))
    return started


def down() -> list[str]:
    stopped = []
    for pidfile in LAB.glob("sshd-*/sshd.pid"):
        pid = int(pidfile.read_text().split()[0])
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            stopped.append(pidfile.parent.name[5:])
        pidfile.unlink()
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
