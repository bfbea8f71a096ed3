"""The launch preflight's cost: `check_variant` (one SSH round trip that parses the rendered argv
with the host's own sglang) against a bare `ssh host true` on the same connection, on a host
without sglang (the lab double), with sglang 0.5.23 (its real parser) and 0.5.9 (its source read
statically). The release venvs are the tests' cached ones (built on first use).

    python bench/launch_check.py
"""

from __future__ import annotations

import statistics
import time

from _lab import BenchLab

from servops.inventory import load_inventory
from servops.lab import venvs
from servops.launchcheck import check_variant
from servops.playbooks import load_variant
from servops.releases import deploy_root
from servops.transport import Session

ROUNDS = 5


def main() -> None:
    lab = BenchLab(1)
    try:
        hosts = [("no sglang (the double)", lab.venv), ("sglang 0.5.23, real parser", venvs.build_sglang_venv("0.5.23")),
                 ("sglang 0.5.9, static read", venvs.build_sglang_venv("0.5.9"))]
        variant = load_variant("piecewise")
        for label, venv in hosts:
            text = lab.inventory.read_text()
            inv_path = lab.tmp / "bench-check.yml"
            inv_path.write_text(text.replace(str(lab.venv), str(venv)))
            inv = load_inventory(inv_path)
            with Session(inv) as session:
                hs = session.host(inv.hosts["lab1"])
                hs.run("true")  # connect once: both sides below reuse the connection
                bare, checks = [], []
                for _ in range(ROUNDS):
                    t0 = time.perf_counter()
                    hs.run("true")
                    bare.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    check = check_variant(hs, variant, deploy_root=deploy_root(hs.host))
                    checks.append(time.perf_counter() - t0)
                b, c = statistics.median(bare), statistics.median(checks)
                print(f"{label}: check {c * 1000:.0f} ms median ({check.branches} argv(s), parser "
                      f"{check.parser or 'none'}, ok={check.ok}); bare ssh round trip {b * 1000:.1f} ms; "
                      f"ratio {c / b:.1f}x")
    finally:
        lab.close()


if __name__ == "__main__":
    main()
