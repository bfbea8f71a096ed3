"""Restarting a server onto a release: stop the old one, switch `current`, start, health-gate.

The health gate runs ON the host (one SSH command for the whole wait; its progress lines drive
the display here). A deploy's start also arms the host-side guard (servops/remote/deploy_ctl.py):
while this controller renews the guard's lease, the guard only watches; if the controller dies
before the release is marked, the guard finishes the gate and rolls back by itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from . import releases, shell
from .progress import Phases
from .transport import HostSession

DEFAULT_SIGNATURES = [r"torch\._dynamo\.exc\.Unsupported", r"CUDA out of memory"]
DEFAULT_HEALTH_TIMEOUT = 1200.0
DEFAULT_LEASE_TIMEOUT = 60.0


def health_timeout(hs: HostSession, health: dict) -> float:
    """One precedence: the variant's health.timeout wins; the inventory's health_timeout is the
    default for variants that do not set one; else 1200 s."""
    if health.get("timeout") is not None:
        return float(health["timeout"])
    if hs.host.get("health_timeout") is not None:
        return float(hs.host.get("health_timeout"))
    return DEFAULT_HEALTH_TIMEOUT


def signatures(meta: dict) -> list[str]:
    return list(dict.fromkeys(list(meta.get("crash_signatures") or []) + DEFAULT_SIGNATURES))


@dataclass
class Node:
    """One host's part of a bring-up: its session, target release, and that release's record."""
    hs: HostSession
    name: str
    meta: dict
    root: str
    guard: dict | None = None  # deploy only: what the host guard needs to roll back alone
    extra: dict = field(default_factory=dict)


def lease_command(release_dir: str, counter: int) -> str:
    """Bump the guard's lease: the counter's new value replaces <release>/lease by rename (a
    symlink planted there is replaced, never followed; noclobber refuses one at the temp name).
    The guard judges it on its own monotonic clock, so no wall clock is compared anywhere."""
    tmp = f".lease.{counter}.$$"
    return (f"cd -- {shell.quote(release_dir)} && set -C && printf '%s\\n' {int(counter)} > {tmp} "
            f"&& mv -f -- {tmp} lease")


class LeaseKeeper:
    """Bumps the guard's lease counter (<release>/lease) from a thread while the deploy runs."""

    def __init__(self, nodes: list[Node], every: float):
        self.nodes = [n for n in nodes if n.guard]
        self.every = every
        self.counter = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="servops-lease", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.counter += 1
            for n in self.nodes:
                try:
                    n.hs.run(lease_command(f"{n.root}/releases/{n.name}", self.counter), timeout=20)
                except Exception:  # noqa: BLE001 - a missed renewal is what the guard is for
                    pass

    def start(self) -> "LeaseKeeper":
        if self.nodes:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)


def stop_switch_start(nodes: list[Node], phases: Phases, owner: dict | None = None) -> None:
    """Stop what runs, point `current` at each node's release, start rank 0 first. One SSH command
    per node for a single-node server: a controller that dies mid-way leaves the host program to
    finish the step, and a deploy's guard (armed with the release) to judge the result.

    `owner` ({"name": release, "id": lock id}): the batch goes ahead only while that release's
    decision is not the host guard's (a controller frozen past its lease must not restart what
    the guard already took over). The release's patch set is verified before anything stops."""
    single = len(nodes) == 1
    for n in nodes:
        grace = float(n.meta.get("stop_grace", 30))
        steps = [{"op": "owns", **owner}] if owner else []
        steps += [{"op": "verify_patches", "name": n.name},
                  {"op": "stop", "grace": grace, "restart_of": n.name,
                   "journal": {"action": "server.stop", "why": f"restart onto {n.name}"}},
                  {"op": "switch", "name": n.name}]
        if single:
            steps.append({"op": "start", "name": n.name, "port": int(n.meta["port"])})
        running = n.extra.get("server")  # as the lock's listing saw it
        if running:
            phases.step("stop", f"{n.hs.host.name}: stopping pid {running['pid']} ({running.get('release')}), "
                                f"grace {grace:g}s")
        results = releases.batch(n.hs, *steps, ssh_timeout=int(grace) + 90)
        stopped = next(r for r in results if "stopped" in r)
        for line in stop_lines(stopped):
            phases.step("stop", f"{n.hs.host.name}: {line}")
        if single:
            phases.step("start", f"{n.hs.host.name}: started {n.name}")
    if not single:
        for n in nodes:  # rank 0 first
            phases.step("start", f"{n.hs.host.name}: starting {n.name}")
            releases.ctl(n.hs, "start", name=n.name, port=int(n.meta["port"]))


def health_gate(node: Node, phases: Phases, label: str) -> dict:
    health = node.meta.get("health") or {}
    timeout = health_timeout(node.hs, health)
    phases.step("health", f"waiting up to {timeout:g}s for {health.get('endpoint', '/health')}")
    with phases.wait(label, timeout) as wait:
        outcome = releases.ctl(node.hs, "health", ssh_timeout=int(timeout) + 120,
                               on_progress=lambda p: wait.update(p["progress"], p.get("log", "")),
                               name=node.name, port=int(node.meta["port"]), health=health, timeout=timeout,
                               signatures=signatures(node.meta), caches=node.meta.get("caches"),
                               compare=node.extra.get("compare") or [node.name])
    for pattern in outcome.get("slow_signatures") or []:
        phases.step("warning", f"crash signature {pattern!r} took over 2 s on the log and was dropped; simplify it")
    return outcome


def stop_lines(res: dict) -> list[str]:
    """What a host-side stop did, beyond the plain case (the leader gone on SIGTERM): processes
    that needed SIGKILL, escapees, a port still held, GPU memory still held."""
    lines = []
    procs = res.get("processes") or []
    killed = [p for p in procs if p["signal"] == "SIGKILL"]
    if len(procs) > 1 or killed:
        lines.append(f"ended {len(procs)} process(es) of {res.get('release')}: "
                     + ", ".join(f"{p['pid']} {p['name']}" + (" (SIGKILL)" if p['signal'] == "SIGKILL" else "")
                                 + (" (had left the server's session)" if p.get("escaped") else "")
                                 for p in procs[:12]) + (", ..." if len(procs) > 12 else ""))
    if res.get("port") and res.get("port_free") is False:
        lines.append(f"port {res['port']} is still held by pid(s) {', '.join(map(str, res.get('port_holders') or []))}"
                     f", not a process of this deploy root")
    gpu = res.get("gpu") or {}
    if gpu.get("error"):
        lines.append(f"GPU facts unknown: {gpu['error']}")
    for app in gpu.get("others") or []:
        lines.append(f"GPU memory still held by pid {app['pid']} ({app['name']}, {app['used_mib']} MiB), not a "
                     f"process of this deploy root")
    if gpu.get("skipped"):
        lines.append(f"{gpu['skipped']} row(s) of nvidia-smi's process list did not parse (a pid that is not a "
                     f"number): skipped")
    return lines


def bring_up(nodes: list[Node], phases: Phases, label: str, owner: dict | None = None,
             started: bool = False) -> dict:
    """Stop, switch, start (unless already `started`), health-gate rank 0; other ranks of a
    multi-node server have no HTTP endpoint of their own and must merely still be running."""
    if not started:
        stop_switch_start(nodes, phases, owner)
    outcome = health_gate(nodes[0], phases, label)
    if outcome["state"] == "healthy":
        for n in nodes[1:]:
            if (releases.ctl(n.hs, "status")["server"] or {}).get("release") != n.name:
                return {"state": "crashed", "reason": f"rank on {n.hs.host.name} exited", "elapsed": outcome["elapsed"],
                        "excerpt": releases.ctl(n.hs, "logs", name=n.name, lines=30)["lines"],
                        "log": f"{n.root}/releases/{n.name}/server.log"}
    return outcome
