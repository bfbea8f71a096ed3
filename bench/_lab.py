"""Shared by the bench scripts: start real sshd hosts and the remote venv, like the tests do."""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from servops.lab import venvs as remote_venv  # noqa: E402
from servops.lab.sshd import free_port, keygen, make_server  # noqa: E402


class BenchLab:
    def __init__(self, n_hosts: int = 1):
        self.tmp = Path(tempfile.mkdtemp(prefix="servops-bench-"))
        self.key = keygen(self.tmp / "id_ed25519")
        self.venv = remote_venv.build_venv()
        self.site = remote_venv.site_packages(self.venv)
        self.servers = [make_server(f"127.0.0.{i + 2}", self.tmp / f"sshd{i}", self.key).start()
                        for i in range(n_hosts)]
        self.known_hosts = self.tmp / "known_hosts"
        self.known_hosts.write_text("".join(s.known_hosts_line for s in self.servers))
        hosts = {}
        for i, s in enumerate(self.servers):
            hosts[f"lab{i + 1}"] = {"ssh_host": s.address, "ssh_port": s.port, "ssh_user": s.user,
                                    "server_port": free_port(), "deploy_root": str(self.tmp / f"deploy{i}")}
        lab = yaml.safe_load((REPO / "inventory" / "lab.yml").read_text())
        gvars = dict(lab["all"]["children"]["lab"]["vars"], ssh_key=str(self.key),
                     known_hosts=str(self.known_hosts), venv=str(self.venv))
        lab["all"]["children"]["lab"] = {"vars": gvars, "hosts": hosts}
        self.inventory = self.tmp / "inventory.yml"
        self.inventory.write_text(yaml.safe_dump(lab))

    def close(self):
        for s in self.servers:
            s.stop()


def summary(name: str, samples: list[float]) -> str:
    return f"{name}: median {statistics.median(samples) * 1000:.1f} ms, min {min(samples) * 1000:.1f} ms (n={len(samples)})"
