"""`invoke inspect --lines 60:90` against raw `ssh host sed -n 60,90p FILE`, interleaved, and
`invoke status`, with the connection agent (servops.connagent) warm. Every figure is a whole
command a user types, measured in this one run:

1. loopback: warm-agent inspect / ssh sed (goal <= 1.0x);
2. 40 ms round trip (a proxy delaying each direction 20 ms, for both): the same (goal <= 0.6x);
3. cold inspect (the first to a host: connects, then leaves an agent) / an inspect that neither
   uses nor leaves one (--no-persist: the direct path as before the agent), and / the servops
   of git revision REV with --baseline REV (goal <= 1.0x: no slower);
4. `status` on a warm agent, a server deployed (goal <= 0.5 s);
5. what a wedged (SIGSTOPped) agent costs the next command before it is bypassed.

Commands run with bytecode caching on (PYTHONDONTWRITEBYTECODE unset), as in a user's shell.
Usage: python bench/inspect_overhead.py [RUNS] [--baseline REV]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _lab import REPO, BenchLab, summary

from servops.lab.sshd import free_port
from servops.lab.tcpproxy import TcpProxy

FILE = "flashinfer/jit/cpp_ext.py"


def timed(argv, env=None, cwd=REPO) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env, cwd=cwd)
    return time.perf_counter() - t0


def ratio_line(name: str, ours: list[float], theirs: list[float], goal: float) -> str:
    ratio = statistics.median(ours) / statistics.median(theirs)
    return f"{name}: {ratio:.2f}x  (goal <= {goal}x: {'met' if ratio <= goal else 'NOT met'})"


class Target:
    """One way to reach the lab host: its inventory, the raw ssh command and the CLI's env."""

    def __init__(self, lab: BenchLab, name: str, port: int, known_hosts_line: str, agents: str):
        srv = lab.servers[0]
        self.name = name
        self.known_hosts = lab.tmp / f"known_hosts-{name}"
        self.known_hosts.write_text(known_hosts_line)
        inv = yaml.safe_load(lab.inventory.read_text())
        inv["all"]["children"]["lab"]["vars"]["known_hosts"] = str(self.known_hosts)
        inv["all"]["children"]["lab"]["hosts"]["lab1"]["ssh_port"] = port
        self.inventory = lab.tmp / f"inventory-{name}.yml"
        self.inventory.write_text(yaml.safe_dump(inv))
        self.ssh = ["ssh", "-q", "-p", str(port), "-i", str(lab.key), "-o", f"UserKnownHostsFile={self.known_hosts}",
                    "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ControlMaster=no",
                    "-o", "ControlPath=none", f"{srv.user}@{srv.address}",
                    "sed", "-n", "60,90p", str(lab.site / FILE)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.env = dict(env, SERVOPS_INVENTORY=str(self.inventory), SERVOPS_AGENT_DIR=agents)
        self.direct_env = dict(self.env, SERVOPS_PERSIST="0")

    def invoke(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "invoke", *args]

    def inspect(self) -> list[str]:
        return self.invoke("inspect", "--file", FILE, "--lines", "60:90")

    def agent_pid(self, wait: float = 60) -> int:
        """The pid of this target's agent, once it serves."""
        from servops.connagent import identity
        from servops.inventory import load_inventory

        mine = identity(load_inventory(self.inventory).hosts["lab1"]) + "-"
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for sock in Path(self.env["SERVOPS_AGENT_DIR"]).glob(mine + "*.sock"):
                try:
                    return int(sock.with_suffix(".lock").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
            time.sleep(0.05)
        raise SystemExit(f"{self.name}: no agent came up in {self.env['SERVOPS_AGENT_DIR']}")

    def disconnect(self) -> None:
        subprocess.run(self.invoke("disconnect"), check=True, stdout=subprocess.DEVNULL, env=self.env, cwd=REPO)


def warm_vs_ssh(target: Target, runs: int) -> tuple[list[float], list[float]]:
    print(f"{target.name}: warm agent vs ssh ...", file=sys.stderr)
    timed(target.inspect(), target.env)
    target.agent_pid()
    timed(target.ssh), timed(target.inspect(), target.env)  # caches warm
    raw, ours = [], []
    for _ in range(runs):
        raw.append(timed(target.ssh))
        ours.append(timed(target.inspect(), target.env))
    return raw, ours


def cold(target: Target, runs: int, baseline: Path | None) -> dict[str, list[float]]:
    """First commands: each timed run finds no agent (the one before was ended, untimed)."""
    out = {"cold": [], "no-persist": [], "baseline": []}
    for _ in range(runs):
        target.disconnect()
        out["cold"].append(timed(target.inspect(), target.env))
        target.agent_pid()  # up before it is ended: never racing the next timed run
        out["no-persist"].append(timed(target.inspect() + ["--no-persist"], target.direct_env))
        if baseline:
            out["baseline"].append(timed(target.inspect(), target.direct_env, cwd=baseline))
    target.disconnect()
    return out


def export(rev: str) -> Path:
    """servops as of git revision `rev`, in a temporary directory (its tasks.py imports it from there)."""
    where = Path(tempfile.mkdtemp(prefix="servops-baseline-"))
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def main(runs: int, baseline_rev: str | None) -> None:
    lab = BenchLab()
    srv = lab.servers[0]
    agents = tempfile.mkdtemp(prefix="servops-agents-")
    proxy = TcpProxy((srv.address, srv.port), address=srv.address, delay=0.020)
    loop = Target(lab, "loopback", srv.port, srv.known_hosts_line, agents)
    far = Target(lab, "rtt40", proxy.port, proxy.known_hosts_line(srv.known_hosts_line), agents)
    baseline = export(baseline_rev) if baseline_rev else None
    lines = []
    try:
        raw, ours = warm_vs_ssh(loop, runs)
        lines += [summary("loopback: ssh sed -n 60,90p", raw), summary("loopback: inspect, agent warm", ours),
                  ratio_line("loopback: warm inspect / ssh sed", ours, raw, 1.0)]
        raw, ours = warm_vs_ssh(far, max(5, runs // 2))
        lines += [summary("40 ms RTT: ssh sed -n 60,90p", raw), summary("40 ms RTT: inspect, agent warm", ours),
                  ratio_line("40 ms RTT: warm inspect / ssh sed", ours, raw, 0.6)]
        c = cold(loop, max(5, runs // 2), baseline)
        lines += [summary("loopback: cold inspect (leaves an agent)", c["cold"]),
                  summary("loopback: inspect --no-persist", c["no-persist"]),
                  ratio_line("cold inspect / --no-persist", c["cold"], c["no-persist"], 1.0)]
        if baseline:
            lines += [summary(f"loopback: inspect of {baseline_rev}", c["baseline"]),
                      ratio_line(f"cold inspect / inspect of {baseline_rev}", c["cold"], c["baseline"], 1.0)]
        inv = yaml.safe_load(loop.inventory.read_text())
        inv["all"]["children"]["lab"]["hosts"]["lab1"]["server_port"] = free_port()
        loop.inventory.write_text(yaml.safe_dump(inv))
        subprocess.run(loop.invoke("deploy", "--variant", "baseline", "-H", "lab1"), check=True, capture_output=True, env=loop.env,
                       cwd=REPO)
        loop.agent_pid()
        timed(loop.invoke("status"), loop.env)
        status = [timed(loop.invoke("status"), loop.env) for _ in range(runs)]
        lines += [summary("loopback: status, agent warm, server up", status),
                  f"status on a warm agent: median {statistics.median(status):.2f} s  "
                  f"(goal <= 0.5 s: {'met' if statistics.median(status) <= 0.5 else 'NOT met'})"]
        subprocess.run(loop.invoke("stop", "--grace", "2", "-H", "lab1"), capture_output=True, env=loop.env, cwd=REPO)
        timed(loop.inspect(), loop.env)
        pid = loop.agent_pid()
        warm = [timed(loop.inspect(), loop.env) for _ in range(3)]
        os.kill(pid, signal.SIGSTOP)
        try:
            wedged = [timed(loop.inspect(), loop.env) for _ in range(3)]
        finally:
            os.kill(pid, signal.SIGCONT)
        lines.append(f"a wedged agent costs the next command {1000 * (statistics.median(wedged) - statistics.median(warm)):.0f} ms "
                     f"before it is bypassed (median {statistics.median(wedged) * 1000:.0f} ms, warm "
                     f"{statistics.median(warm) * 1000:.0f} ms)")
    finally:
        for target in (loop, far):
            subprocess.run(target.invoke("disconnect"), capture_output=True, env=target.env, cwd=REPO)
        proxy.close()
        lab.close()
        for where in (agents, baseline):
            if where:
                shutil.rmtree(where, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="?", type=int, default=15)
    parser.add_argument("--baseline", help="also time the inspect of servops at this git revision")
    opts = parser.parse_args()
    main(opts.runs, opts.baseline)
