"""Deploy (render + upload + restart of the SGLang double) to 1 host vs 8 hosts, in parallel.

Each host is a real sshd on its own loopback address. Goal: 8 hosts take <= 1.5x one host.
Usage: python bench/fanout.py [ROUNDS]
"""

import os
import resource
import statistics
import subprocess
import sys
import time

import yaml

from _lab import REPO, BenchLab
from servops.lab.sshd import free_port


def deploy(env, hosts, cpu=None):
    """Wall time of one `invoke deploy`; adds the controller process's CPU seconds to `cpu`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "invoke", "deploy", "--variant", "baseline", "-H", hosts],
                         cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"deploy -H {hosts} failed:\n{res.stdout}\n{res.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if cpu is not None:
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return wall


def main(rounds: int = 3):
    lab = BenchLab(n_hosts=8)
    inv = yaml.safe_load(lab.inventory.read_text())
    for name, hv in inv["all"]["children"]["lab"]["hosts"].items():
        hv["server_port"] = free_port()
    lab.inventory.write_text(yaml.safe_dump(inv))
    env = dict(os.environ, SERVOPS_INVENTORY=str(lab.inventory), NO_COLOR="1")
    all_hosts = ",".join(inv["all"]["children"]["lab"]["hosts"])
    one, eight, cpu_one, cpu_eight = [], [], [], []
    try:
        deploy(env, all_hosts)  # first releases everywhere, warm caches
        for _ in range(rounds):
            one.append(deploy(env, "lab1", cpu_one))
            eight.append(deploy(env, all_hosts, cpu_eight))
    finally:
        subprocess.run([sys.executable, "-m", "invoke", "stop", "--grace", "2", "-H", all_hosts], cwd=REPO, env=env,
                       capture_output=True)
        lab.close()
    ratio = statistics.median(eight) / statistics.median(one)
    print(f"deploy to 1 host: median {statistics.median(one):.2f}s  {[round(x, 2) for x in one]}")
    print(f"deploy to 8 hosts: median {statistics.median(eight):.2f}s  {[round(x, 2) for x in eight]}")
    print(f"ratio (median): {ratio:.2f}x  (goal <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}; this machine has {os.cpu_count()} cores)")
    # All eight "hosts" share this machine's cores, so their remote work (sshd sessions, the
    # remote programs, eight doubles importing aiohttp) queues for the same CPUs. The controller's
    # own CPU is what grows with the fleet on real hosts:
    print(f"controller CPU per deploy: 1 host {statistics.median(cpu_one):.2f}s, 8 hosts {statistics.median(cpu_eight):.2f}s "
          f"(ratio {statistics.median(cpu_eight) / statistics.median(cpu_one):.2f}x)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
