"""`invoke lab.up` / `lab.down`: the lab of inventory/lab.yml on this machine.

Real sshd servers on the inventory's loopback addresses (keys and known_hosts under
~/.servops-lab), and the same real venv the tests use (CPU torch + flashinfer-python) linked at
~/.servops-lab/venv. /tmp/servops-lab-cuda stands in for a CUDA toolkit (its version.json only).

The lab keeps its OWN record of each sshd it started (`lab.json`: pid and kernel start time),
apart from sshd's PidFile, which sshd itself writes and deletes: stopping reads only the lab's
records, checks the start time against pid reuse, and is idempotent.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import time
from pathlib import Path

from ..inventory import Host
from ..errors import ServopsError
from ..remote.procs import proc_starttime, release_processes
from . import venvs
from .sshd import SshServer, keygen

LAB = Path(os.environ.get("SERVOPS_LAB_HOME") or Path.home() / ".servops-lab")
OWNER = LAB / "checkout.json"  # which checkout's lab is up (its hosts' addresses and ports are fixed)
CHECKOUT = str(Path(__file__).resolve().parents[2])
# The lab venv's sglang: a real release whose real parser runs on the lab's CPU torch, so the
# lab's first `invoke check` refuses a typo'd flag as a GPU host's sglang would.
LAB_SGLANG = "0.5.21"


class LabError(ServopsError):
    pass


def _other_checkout() -> str | None:
    """The checkout whose lab is up here, when it is another one (two checkouts under one
    account would otherwise stop each other's servers and sshd)."""
    try:
        owner = json.loads(OWNER.read_text()).get("checkout")
    except (OSError, ValueError, AttributeError):
        return None
    if not owner or owner == CHECKOUT or not Path(owner).is_dir():
        return None
    running = [r for r in LAB.glob("sshd-*/lab.json") if _running(r)]
    return owner if running else None


def refuse_other_checkout(verb: str) -> None:
    other = _other_checkout()
    if other:
        raise LabError(f"the lab under {LAB} is up from another checkout, {other}: run `invoke lab.down` there "
                       f"first (its hosts use the same addresses and ports), then {verb} here")
CUDA_STANDIN = Path("/tmp/servops-lab-cuda")
CUDA_VERSION_JSON = '{"cuda": {"name": "CUDA SDK", "version": "12.9.1"}}'


def _record_path(address: str, port: int) -> Path:
    return LAB / f"sshd-{address}-{port}" / "lab.json"


def _running(record: Path) -> dict | None:
    """The process a lab record names, if that very process still runs."""
    try:
        info = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if proc_starttime(int(info.get("pid", 0))) != info.get("starttime"):
        return None
    return info


def up(hosts: list[Host]) -> list[str]:
    """Start sshd for each lab host that is not already up; returns the addresses started."""
    refuse_other_checkout("lab.up")
    LAB.mkdir(mode=0o700, exist_ok=True)
    OWNER.write_text(json.dumps({"checkout": CHECKOUT}))
    key = LAB / "id_ed25519"
    if not key.exists():
        keygen(key)
    venv = LAB / "venv"
    if any("vllm" not in h.groups for h in hosts):
        wanted = venvs.build_sglang_venv(LAB_SGLANG)
        if venv.is_symlink() and Path(os.readlink(venv)) != wanted:
            venv.unlink()  # an older lab's venv (without sglang): the lab's is the release venv
        if not venv.exists():
            venv.symlink_to(wanted)
    if any("vllm" in h.groups for h in hosts):  # a real vLLM lab host (inventory/lab-vllm.yml)
        from . import vllmlab

        vllmlab.prepare(LAB)
    CUDA_STANDIN.mkdir(exist_ok=True)
    (CUDA_STANDIN / "version.json").write_text(CUDA_VERSION_JSON)
    known, started = {}, []
    for host in hosts:
        address, port = host.ssh_host, host.ssh_port
        work = _record_path(address, port).parent
        work.mkdir(mode=0o700, exist_ok=True)
        if not (work / "ssh_host_ed25519_key").exists():
            keygen(work / "ssh_host_ed25519_key")
        (work / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
        srv = SshServer(address, port, work, work / "ssh_host_ed25519_key", key, getpass.getuser(), home=Path.home())
        if not _running(work / "lab.json"):
            srv.start()
            pid = srv.proc.pid
            tmp = work / "lab.json.tmp"
            tmp.write_text(json.dumps({"pid": pid, "starttime": proc_starttime(pid), "address": address,
                                       "port": port}))
            tmp.replace(work / "lab.json")
            srv.proc = None  # keep it running after this process exits
            started.append(f"{address}:{port}")
        known[f"{address}:{port}"] = srv.known_hosts_line
    # Keep entries of lab hosts started earlier (another -H selection) in known_hosts.
    kh = LAB / "known_hosts"
    for line in (kh.read_text().splitlines(True) if kh.exists() else []):
        addr = line.split(" ", 1)[0].strip("[").replace("]:", ":")
        known.setdefault(addr, line)
    kh.write_text("".join(known.values()))
    return started


def _stop_pid(pid: int, starttime: str | None, group: bool = False, grace: float = 10.0) -> bool:
    """SIGTERM (then SIGKILL) a process we recorded; False if it was no longer running."""
    if proc_starttime(pid) is None or (starttime and proc_starttime(pid) != starttime):
        return False
    kill = os.killpg if group else os.kill
    try:
        kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and proc_starttime(pid) == starttime:
        time.sleep(0.05)
    if proc_starttime(pid) == starttime:
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return True


def down(hosts: list[Host]) -> tuple[list[str], list[str]]:
    """Stop the lab hosts' servers (from each host's deploy_root pidfile), then their sshd.

    Returns (servers stopped, sshd stopped). Safe to run any number of times.
    """
    refuse_other_checkout("lab.down")
    servers, sshds = [], []
    for host in hosts:
        root = Path(os.path.expanduser(str(host.get("deploy_root") or "~/.servops/deploy")))
        pidfile = root / "server.pid"
        try:
            info = json.loads(pidfile.read_text())
        except (OSError, ValueError):
            info = None
        if info and _stop_pid(int(info["pid"]), info.get("starttime"), group=True):
            servers.append(f"{host.name} pid {info['pid']}")
        # and every other process of its releases (children deaf to SIGTERM, escapees)
        leader = [(int(info["pid"]), str(info.get("release")))] if isinstance(info, dict) and "pid" in info else []
        for pid, facts in release_processes(str(root / "releases"), leader).items() if (root / "releases").is_dir() else ():
            _stop_pid(pid, facts["starttime"], grace=2.0)
        if info:
            pidfile.unlink(missing_ok=True)
        record = _record_path(host.ssh_host, host.ssh_port)
        running = _running(record)
        if running and _stop_pid(int(running["pid"]), running["starttime"]):
            sshds.append(f"{host.ssh_host}:{host.ssh_port}")
        record.unlink(missing_ok=True)
    if not any(_running(r) for r in LAB.glob("sshd-*/lab.json")):
        OWNER.unlink(missing_ok=True)
    return servers, sshds
