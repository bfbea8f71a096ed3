"""`invoke inspect --lines 60:90` against raw `ssh host sed -n 60,90p FILE`, interleaved.

Both are whole commands a user types, each paying its own connect. Goal: ratio <= 1.3x.
Usage: python bench/inspect_overhead.py [RUNS]
"""

import os
import statistics
import subprocess
import sys
import time

from _lab import REPO, BenchLab, summary


def timed(argv, env=None):
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env, cwd=REPO)
    return time.perf_counter() - t0


def main(runs: int = 15):
    lab = BenchLab()
    srv = lab.servers[0]
    target = str(lab.site / "flashinfer/jit/cpp_ext.py")
    raw = ["ssh", "-q", "-p", str(srv.port), "-i", str(lab.key), "-o", f"UserKnownHostsFile={lab.known_hosts}",
           "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"{srv.user}@{srv.address}",
           "sed", "-n", "60,90p", target]
    ours = [sys.executable, "-m", "invoke", "inspect", "--file", "flashinfer/jit/cpp_ext.py", "--lines", "60:90"]
    env = dict(os.environ, SERVOPS_INVENTORY=str(lab.inventory))
    try:
        timed(raw), timed(ours, env)  # warm caches
        raw_t, ours_t = [], []
        for _ in range(runs):
            raw_t.append(timed(raw))
            ours_t.append(timed(ours, env))
    finally:
        lab.close()
    print(summary("ssh sed -n 60,90p", raw_t))
    print(summary("invoke inspect --lines 60:90", ours_t))
    ratio = statistics.median(ours_t) / statistics.median(raw_t)
    print(f"ratio (median): {ratio:.2f}x  (goal <= 1.3x: {'met' if ratio <= 1.3 else 'NOT met'})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
