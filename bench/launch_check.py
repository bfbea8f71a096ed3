"""The launch preflight's cost: `check_variant` (one SSH round trip that parses the rendered argv
with the host's own sglang) against a bare `ssh host true` on the same connection, on a host
without sglang (the lab double), with sglang 0.5.23 (its real parser, then its cached flag
table) and 0.5.9 (its source read statically). Then the goal of issue #24.3: the whole
`invoke check` as a user runs it against the real 0.5.23 parser, first (cold: no parser cache
on the host) and second (the cached table), ending with their ratio. The release venvs are the
tests' cached ones (built on first use).

    python bench/launch_check.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _lab import REPO, BenchLab

from servops.inventory import load_inventory
from servops.lab import venvs
from servops.launchcheck import check_variant
from servops.playbooks import load_variant
from servops.releases import deploy_root
from servops.transport import Session

ROUNDS = 5
CACHE = ".launch-cache"


def _inventory(lab: BenchLab, venv: Path, name: str) -> Path:
    path = lab.tmp / name
    path.write_text(lab.inventory.read_text().replace(str(lab.venv), str(venv)))
    return path


def round_trips(lab: BenchLab, label: str, venv: Path, variant: dict) -> None:
    inv = load_inventory(_inventory(lab, venv, "bench-check.yml"))
    with Session(inv) as session:
        hs = session.host(inv.hosts["lab1"])
        hs.run("true")  # connect once: both sides below reuse the connection
        root = deploy_root(hs.host)
        # a host servops has deployed to: the cache lives in its deploy root, which a check never makes
        Path(root).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(Path(root) / CACHE, ignore_errors=True)
        bare, checks, kinds = [], [], []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            hs.run("true")
            bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            check = check_variant(hs, variant, deploy_root=root)
            checks.append(time.perf_counter() - t0)
            kinds.append(check.parser or "none")
        b = statistics.median(bare)
        first, rest = checks[0], statistics.median(checks[1:])
        print(f"{label}: check first {first * 1000:.0f} ms ({kinds[0]}), then {rest * 1000:.0f} ms median "
              f"({kinds[-1]}; {check.branches} argv(s), ok={check.ok}); bare ssh round trip {b * 1000:.1f} ms; "
              f"ratio {rest / b:.1f}x")


def cli_check(inventory: Path) -> tuple[float, str]:
    env = dict(os.environ, SERVOPS_INVENTORY=str(inventory), NO_COLOR="1", COLUMNS="200")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "invoke", "check", "--variant", "piecewise", "-H", "lab1", "--json"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"invoke check failed ({res.returncode}): {res.stderr.strip()[-500:]}")
    import json
    return took, json.loads(res.stdout)["parser"]


def main() -> None:
    lab = BenchLab(1)
    try:
        real = venvs.build_sglang_venv("0.5.23")
        variant = load_variant("piecewise")
        for label, venv in (("no sglang (the double)", lab.venv), ("sglang 0.5.23, real parser", real),
                            ("sglang 0.5.9, static read", venvs.build_sglang_venv("0.5.9"))):
            round_trips(lab, label, venv, variant)
        # the goal: a second `invoke check` against the real sglang parser <= 1.5 s
        inv = _inventory(lab, real, "bench-cli.yml")
        root = load_inventory(inv).hosts["lab1"].get("deploy_root")
        firsts, seconds = [], []
        Path(root).mkdir(parents=True, exist_ok=True)  # as above: deployed to before
        for _ in range(3):
            shutil.rmtree(Path(root) / CACHE, ignore_errors=True)
            t1, p1 = cli_check(inv)
            t2, p2 = cli_check(inv)
            assert (p1, p2) == ("real", "cached"), (p1, p2)
            firsts.append(t1)
            seconds.append(t2)
        f, s = statistics.median(firsts), statistics.median(seconds)
        print(f"invoke check --variant piecewise on sglang 0.5.23 (real parser), median of 3 pairs:")
        print(f"first check (cold, real parser): {f:.2f} s")
        print(f"second check (cached flag table): {s:.2f} s (goal <= 1.5 s: {'met' if s <= 1.5 else 'NOT met'})")
        print(f"ratio first/second: {f / s:.1f}x")
    finally:
        lab.close()


if __name__ == "__main__":
    main()
