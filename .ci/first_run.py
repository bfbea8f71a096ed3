#!/usr/bin/env python3
"""CI's run: the README's two commands on a fresh machine, and what the README promises a newcomer.

    .ci/run [PYTEST ARGS]

A fresh clone of this checkout's commit (no .venv, nothing untracked), `bash scripts/setup.sh`
there, then `.venv/bin/python -m pytest` with the test cache and the lab's home pointed at empty
directories of this run's own:

    SERVOPS_TEST_CACHE   the test cache (default ~/.cache/servops-tests): the venvs, wheels and
                         sources the suite builds on its first run and reuses after
    SERVOPS_LAB_HOME     the lab's home (default ~/.servops-lab): `invoke lab.up`'s keys, records
                         and venv links

so every CI run is a first run, the one every new user and every new CI machine meets: a warm
cache cannot hide a broken first run. Then it checks the README's promise: the first run needed
nothing by hand (the suite passed), left nothing half-built in the cache and nothing running, and
the whole run (setup, cache builds, suite) took less than the hard limit (SERVOPS_CI_LIMIT_MIN, 70: past
it the suite must be split, not CI's 90 minutes waited out). The goal is 40 minutes on a quiet 2-core
machine (SERVOPS_CI_BUDGET_MIN): a run past it on a loaded machine is said loudly, not failed.
The run's directory (SERVOPS_CI_WORK, default a new one under /tmp; ~12 GB after the run): its
clone, cache and lab home are removed at the end unless SERVOPS_CI_KEEP=1. pip's own download cache is the machine's: a first run downloads from
it (or from PyPI where it is empty), as a newcomer's pip would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
BUDGET_MIN = float(os.environ.get("SERVOPS_CI_BUDGET_MIN", "40"))  # the goal: the whole run on a quiet 2-core machine
LIMIT_MIN = float(os.environ.get("SERVOPS_CI_LIMIT_MIN", "70"))  # past it a run fails (CI itself stops at 90)
READY_MARKERS = (".servops-test-ready", ".servops-worker-ready", ".servops-bench-serving-ready", ".complete")
UNMARKED = {"wheels", "workers", "tiny-models", "vllm-compile", "sglang-src", "flashinfer-src", "parity"}  # folders of entries


def say(text: str) -> None:
    print(f"ci: {text}", flush=True)


def run(argv: list[str], cwd: Path, env: dict | None = None) -> tuple[int, float]:
    started = time.monotonic()
    rc = subprocess.run(argv, cwd=cwd, env=env).returncode
    return rc, time.monotonic() - started


def half_built(cache: Path) -> list[str]:
    """What a build started in the test cache and never finished: an entry without its ready
    marker (servops/lab/venvs.py build_once and the sweeps write it last), an unpacking never
    renamed into place, a download's scratch folder."""
    found = [str(p) for p in [*cache.glob("wheels/.download-*"), *cache.glob("*.partial")]]
    entries = [p for p in cache.iterdir() if p.is_dir() and p.name not in UNMARKED and not p.name.endswith(
        (".partial", "-src"))]  # flashinfer-X-src: complete by its rename from .partial
    for group in ("workers/*/*", "tiny-models/*", "sglang-src/*", "flashinfer-src/*"):
        entries += [p for p in cache.glob(group) if p.name != "dl"]
    return found + [str(e) for e in entries if e.is_dir() and not any((e / m).exists() for m in READY_MARKERS)]


def still_running(places: list[Path]) -> list[str]:
    sys.path.insert(0, str(CHECKOUT / "tests"))
    import leftovers

    return [f"{pid} {comm}" for pid, comm in leftovers.processes_naming([f"{p}/" for p in places]).items()]


def main() -> int:
    given = os.environ.get("SERVOPS_CI_WORK")
    work = Path(given or tempfile.mkdtemp(prefix="servops-ci-"))
    clone, cache, lab_home = work / "clone", work / "test-cache", work / "lab-home"
    for fresh in (clone, cache, lab_home):
        if fresh.exists() and any(fresh.iterdir()):
            say(f"{fresh} is not empty: a first run needs an empty one (remove it, or set SERVOPS_CI_WORK elsewhere)")
            return 2
    # where the suite's own processes and temporary files live (tests/conftest.py RUN_DIR)
    run_dir = Path(tempfile.gettempdir()) / f"servops-tests-{os.getuid()}" / f"slot{os.environ.get('SERVOPS_TEST_SLOT') or 0}"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain"], cwd=CHECKOUT, capture_output=True, text=True).stdout.strip():
        say("the checkout has uncommitted changes: a fresh clone tests the commit only")
    say(f"commit {commit[:12]} in a fresh clone at {clone}; test cache {cache}, lab home {lab_home}")
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(CHECKOUT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=clone, check=True)
    env = dict(os.environ, SERVOPS_TEST_CACHE=str(cache), SERVOPS_LAB_HOME=str(lab_home))
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    failures = []
    try:
        rc, setup_s = run(["bash", "scripts/setup.sh"], clone, env)
        say(f"setup: exit {rc} in {setup_s / 60:.1f} min")
        if rc != 0:
            return 1
        rc, suite_s = run([str(clone / ".venv" / "bin" / "python"), "-m", "pytest", *sys.argv[1:]], clone, env)
        say(f"suite (its first run: every cache built): exit {rc} in {suite_s / 60:.1f} min")
        if rc == 5:
            failures.append("pytest collected no tests")
        elif rc != 0:
            failures.append(f"the first run failed (pytest exit {rc}): a newcomer's would too")
        if cache.is_dir() and (broken := half_built(cache)):
            failures.append(f"left half-built in the test cache: {', '.join(broken)}")
        if left := still_running([work, run_dir]):
            failures.append(f"left running after the suite: {', '.join(left)}")
        total_min = (time.monotonic() - started) / 60
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        say(f"whole run {total_min:.1f} min (goal {BUDGET_MIN:g}, limit {LIMIT_MIN:g}); load average now {load}")
        if total_min > LIMIT_MIN:
            failures.append(f"the whole run took {total_min:.1f} min, over CI's {LIMIT_MIN:g}-minute limit")
        elif total_min > BUDGET_MIN:
            say(f"WARNING: the whole run took {total_min:.1f} min, past the {BUDGET_MIN:g}-minute goal "
                f"(load average {load} on {os.cpu_count()} cores)")
    finally:
        if os.environ.get("SERVOPS_CI_KEEP") != "1":
            for made in (clone, cache, lab_home) if given else (work,):
                shutil.rmtree(made, ignore_errors=True)
    for failure in failures:
        say(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
