"""What a killed run of this slot left behind, found and cleaned when the next run starts.

A suite killed halfway (SIGKILL to pytest and its workers) leaves its lab running: sshd servers,
the servers its deploys started and their guards, connection agents, a PostgreSQL server, all
still holding ports, CPU and files. Every one of them names the run's directory (conftest
RUN_DIR, one per SERVOPS_TEST_SLOT) in its command line, working directory or environment: the
tests start them there, with that directory in their environment. At the start of the next run
of the same slot they are ended and the directory is emptied.

Only a dead run's things: the run takes its slot's lock for the whole session (claim_slot), so
while a suite runs in a slot, no other can start there and clean it; the slot's directory and
addresses are its own, so other slots' suites beside it are never touched. The test cache
needs nothing here: its locks are flocks (released by the kernel with their holder), a
half-built entry lacks its ready marker and is rebuilt (servops/lab/venvs.py build_once), and a
copy a killed test left patched is repaired before use (venvs.repair).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path


class SlotTaken(Exception):
    pass


def claim_slot(run_dir: Path, slot: int):
    """The slot's lock, held (the returned file kept open) until this process ends."""
    lock = run_dir.parent / f"{run_dir.name}.lock"
    fh = open(lock, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise SlotTaken(f"test slot {slot} is in use by a running suite ({holder}): wait for it, or run this one "
                        f"with SERVOPS_TEST_SLOT set to a free slot (0-3)") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} in {os.getcwd()}\n")
    fh.flush()
    return fh


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def processes_naming(places: list[str]) -> dict[int, str]:
    """pid -> comm of every live process whose command line, working directory or environment
    names one of `places` (this process and its ancestors excepted)."""
    mine, found = _ancestors(), {}
    needles = [p.encode() for p in places]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            blobs = [(entry / "cmdline").read_bytes(), os.readlink(entry / "cwd").encode(),
                     (entry / "environ").read_bytes()]
            if any(n in blob for n in needles for blob in blobs):
                found[int(entry.name)] = (entry / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
    return found


def end_processes(places: list[str], rounds: int = 10) -> Counter:
    """SIGKILL every process naming `places` (again, for those started meanwhile by the dying:
    a guard restarting its server); comm -> how many."""
    ended: Counter = Counter()
    for _ in range(rounds):
        found = processes_naming(places)
        if not found:
            break
        for pid, comm in found.items():
            try:
                os.kill(pid, signal.SIGKILL)
                ended[comm] += 1
            except OSError:
                continue
        time.sleep(0.2)
    return ended


def clean(run_dir: Path, keep: set[Path], home_dirs: list[Path]) -> str | None:
    """End what a killed run of this slot left running and remove its files (all of `run_dir`
    but `keep`: this run's own, and pytest's temporary directory, which pytest empties itself;
    and `home_dirs`, what its tests made in $HOME). A line saying what was cleaned, or None
    when there was nothing."""
    places = [f"{run_dir}/"] + [str(d) for d in home_dirs]
    ended = end_processes(places)
    removed = 0
    for entry in [*run_dir.iterdir(), *home_dirs]:
        if entry in keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed += 1
    if not ended and not removed:
        return None
    procs = ", ".join(f"{comm} x{n}" for comm, n in ended.most_common()) or "none"
    return (f"servops tests: cleaned what an earlier run of this slot left: processes ended: {procs}; "
            f"{removed} entries removed under {run_dir} and $HOME")
