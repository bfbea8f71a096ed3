"""`invoke lab.up` / `lab.down`: the lab of inventory/lab.yml on this machine.

Real sshd servers on the inventory's loopback addresses (keys and known_hosts under
~/.servops-lab, or $SERVOPS_LAB_HOME), and the same real venv the tests use (CPU torch +
flashinfer-python + the lab's sglang) linked at ~/.servops-lab/venv. /tmp/servops-lab-cuda stands
in for a CUDA toolkit (its version.json only). Every file here is written whole (beside its place,
then renamed in), so a lab.up killed midway leaves nothing half-written for the next one.

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
from ..localfiles import replace_link, write_new
from ..remote.procs import proc_starttime, release_processes
from . import venvs
from .sshd import SshServer, has_key, keygen

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
    write_new(OWNER, json.dumps({"checkout": CHECKOUT}).encode())
    key = LAB / "id_ed25519"
    if not has_key(key):
        keygen(key)
    venv = LAB / "venv"
    if any("vllm" not in h.groups for h in hosts):
        wanted = venvs.build_sglang_venv(LAB_SGLANG)
        # none yet, or an older lab's (without sglang, or another build): the lab's is the release
        # venv. A link to a copy of it is kept (the tests' labs link their own, which they patch).
        if not venv.exists() or (venv.is_symlink() and venv.resolve().name != wanted.name):
            replace_link(venv, wanted)
    if any("vllm" in h.groups for h in hosts):  # a real vLLM lab host (inventory/lab-vllm.yml)
        from . import vllmlab

        vllmlab.prepare(LAB)
    CUDA_STANDIN.mkdir(exist_ok=True)
    if _read(CUDA_STANDIN / "version.json") != CUDA_VERSION_JSON:  # (every lab on this machine reads it)
        write_new(CUDA_STANDIN / "version.json", CUDA_VERSION_JSON.encode(), 0o644)
    known, started = {}, []
    for host in hosts:
        address, port = host.ssh_host, host.ssh_port
        work = _record_path(address, port).parent
        work.mkdir(mode=0o700, exist_ok=True)
        if not has_key(work / "ssh_host_ed25519_key"):
            keygen(work / "ssh_host_ed25519_key")
        write_new(work / "authorized_keys", key.with_suffix(".pub").read_bytes())
        srv = SshServer(address, port, work, work / "ssh_host_ed25519_key", key, getpass.getuser(), home=Path.home())
        if not _running(work / "lab.json"):
            srv.start()
            pid = srv.proc.pid
            write_new(work / "lab.json", json.dumps({"pid": pid, "starttime": proc_starttime(pid),
                                                     "address": address, "port": port}).encode())
            srv.proc = None  # keep it running after this process exits
            started.append(f"{address}:{port}")
        known[f"{address}:{port}"] = srv.known_hosts_line
    # Keep entries of lab hosts started earlier (another -H selection) in known_hosts.
    kh = LAB / "known_hosts"
    for line in (kh.read_text().splitlines(True) if kh.exists() else []):
        addr = line.split(" ", 1)[0].strip("[").replace("]:", ":")
        known.setdefault(addr, line)
    write_new(kh, "".join(known.values()).encode())
    return started


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


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
