"""Crash safety of multi-file patches (issue 9.4-9.6): the host program is SIGKILLed at every
step of a many-file commit, apply and revert; afterwards every file is all-old or all-new by
RECORD hash, no temp file is left in site-packages, and the next command succeeds.

The patch program runs here on a local throwaway venv (remote programs are testable on a local
directory), its real pip distribution patched 24 files at a time; one case goes over real SSH."""

from __future__ import annotations

import csv
import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_invoke
from servops import remote
from servops.lab.venvs import record_hash

N_FILES = 24
NAME = "many-files"


@pytest.fixture(scope="module")
def crash_venv(tmp_path_factory):
    """A fresh venv whose own pip is the distribution the patch edits (24 of its files)."""
    d = tmp_path_factory.mktemp("crashvenv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
    python = d / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    dist_info = next(site.glob("pip-*.dist-info"))
    with open(dist_info / "RECORD", newline="") as fh:
        record = {row[0]: row[1] for row in csv.reader(fh) if len(row) > 1 and row[1]}
    files = sorted(r for r in record if r.startswith("pip/_internal/") and r.endswith(".py")
                   and (site / r).stat().st_size > 200)[:N_FILES]
    pristine = {rel: (site / rel).read_bytes() for rel in files}
    diff = ""
    for rel in files:
        old = pristine[rel].decode().splitlines(True)
        new = [f"# patched by servops test ({rel})\n"] + old
        diff += "".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}"))
    patched = {rel: f"# patched by servops test ({rel})\n".encode() + pristine[rel] for rel in files}
    spec = {"name": NAME, "dist": "pip", "text": diff, "strip": 1, "files": files}
    return {"python": python, "site": site, "record": record, "files": files, "pristine": pristine,
            "patched": patched, "spec": spec, "state": Path(d).resolve() / ".servops"}


def run_patch_op(v, **args) -> tuple[int, dict | None]:
    program = remote.with_args("patch_op", dict(args, operator="test", journal=""))
    proc = subprocess.run([str(v["python"]), "-"], input=program, capture_output=True, text=True)
    out = proc.stdout.strip().splitlines()
    try:
        return proc.returncode, json.loads(out[-1]) if out else None
    except json.JSONDecodeError:
        return proc.returncode, None


def which_side(v) -> str:
    """'old' or 'new' when every file agrees, by RECORD hash; anything else fails the test."""
    sides = set()
    for rel in v["files"]:
        h = record_hash((v["site"] / rel).read_bytes())
        if h == v["record"][rel]:
            sides.add("old")
        elif h == record_hash(v["patched"][rel]):
            sides.add("new")
        else:
            sides.add(f"corrupt:{rel}")
    assert len(sides) == 1, f"files disagree: {sorted(sides)}"
    return sides.pop()


def leftovers(v) -> list[str]:
    temps = [str(p) for p in v["site"].rglob("*.servops-tmp")]
    txn = [str(p) for p in v["state"].glob("txn*")]
    return temps + txn


def recorded(v) -> bool:
    state = v["state"] / "state.json"
    return state.exists() and NAME in json.loads(state.read_text())["applied"]


def points(op: str) -> list[str]:
    return ([f"{op}:journal"] + [f"{op}:rename:{i}" for i in range(N_FILES)]
            + [f"{op}:before-commit-mark", f"{op}:committed", f"{op}:before-state"])


def reset(v, applied: bool) -> None:
    rc, res = run_patch_op(v, op="apply" if applied else "revert", patch=v["spec"])
    assert rc == 0, res
    assert which_side(v) == ("new" if applied else "old") and recorded(v) == applied


@pytest.mark.parametrize("op", ["apply", "revert"])
def test_kill_at_every_step_leaves_all_old_or_all_new(crash_venv, op):
    v = crash_venv
    before = "new" if op == "revert" else "old"
    for point in points(op):
        reset(v, applied=(op == "revert"))
        rc, _ = run_patch_op(v, op=op, patch=v["spec"], _fault=point)
        assert rc == -9, f"{point}: the program was not killed there (rc {rc})"
        # The next command, whatever it is, first finishes or undoes the transaction.
        rc, res = run_patch_op(v, op="status", patches=[v["spec"]])
        assert rc == 0, res
        assert res["recovered"], point
        committed = point.endswith(("committed", "before-state"))
        side = which_side(v)
        assert side == ({"old": "new", "new": "old"}[before] if committed else before), point
        assert recorded(v) == (side == "new"), point  # state and files agree
        assert leftovers(v) == [], point
        assert res["patches"][0]["state"] == ("applied" if side == "new" else "not-applied")
    reset(v, applied=False)


def test_patch_state_is_per_venv_not_per_inventory(lab, remote_env):
    """Two inventory entries (other sshd, other deploy_root) on one venv see one patch state."""
    inv = lab.inventory(n_hosts=2)
    res = run_invoke("patch.apply", "cuda-version-no-subprocess", "-H", "lab1", inventory=inv)
    assert res.returncode == 0 and "lab1 : changed - applied" in res.stdout
    res = run_invoke("patch.status", "-H", "lab2", inventory=inv)
    row = next(l for l in res.stdout.splitlines() if "cuda-version-no-subprocess" in l)
    assert " applied" in row and "not applied" not in row
    res = run_invoke("patch.apply", "cuda-version-no-subprocess", "-H", "lab2", inventory=inv)
    assert "lab2 : ok - already applied" in res.stdout and "recorded it now" not in res.stdout
    assert run_invoke("patch.revert", "cuda-version-no-subprocess", "-H", "lab2", inventory=inv).returncode == 0
    res = run_invoke("patch.status", "-H", "lab1", inventory=inv)
    assert "not applied" in res.stdout


def test_applied_but_unrecorded_is_derived_from_the_files(crash_venv):
    """A patch on disk with no record (state lost) is still seen as applied, and reverted."""
    v = crash_venv
    reset(v, applied=True)
    (v["state"] / "state.json").unlink()
    rc, res = run_patch_op(v, op="status", patches=[v["spec"]])
    assert rc == 0 and res["patches"][0]["state"] == "applied" and not res["patches"][0]["recorded"]
    rc, res = run_patch_op(v, op="revert", patch=v["spec"])
    assert rc == 0 and res["message"] == "reverted" and which_side(v) == "old"


def test_a_stale_record_is_dropped_when_the_files_are_pristine(crash_venv):
    v = crash_venv
    reset(v, applied=True)
    for rel in v["files"]:  # a pip reinstall, say
        (v["site"] / rel).write_bytes(v["pristine"][rel])
    rc, res = run_patch_op(v, op="status", patches=[v["spec"]])
    assert rc == 0 and res["patches"][0]["state"] == "not-applied" and not recorded(v)


def test_killed_over_ssh_mid_commit_then_next_command_recovers(lab, remote_env, tmp_path):
    """The real path: invoke patch.apply of the shipped patch is killed on the host mid-commit."""
    inv = lab.inventory()
    target = remote_env["site"] / "flashinfer/jit/cpp_ext.py"
    res = run_invoke("patch.apply", "cuda-version-no-subprocess", inventory=inv,
                     env={"SERVOPS_FAULT": "apply:before-commit-mark"})
    assert res.returncode != 0
    assert target.read_bytes() != remote_env["pristine"]["flashinfer/jit/cpp_ext.py"]  # killed after the rename
    res = run_invoke("patch.status", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "undid an interrupted apply cuda-version-no-subprocess" in res.stderr
    assert "not applied" in res.stdout
    assert target.read_bytes() == remote_env["pristine"]["flashinfer/jit/cpp_ext.py"]
    assert not list(target.parent.glob(".*servops-tmp"))
    assert run_invoke("patch.apply", "cuda-version-no-subprocess", inventory=inv).returncode == 0
