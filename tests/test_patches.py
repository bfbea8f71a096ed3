"""patch.* over real sshd, on the real flashinfer-python 0.7.2.post1 file, with real patch(1)."""

import fcntl
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, run_invoke

NAME = "cuda-version-no-subprocess"
CPP_EXT = "flashinfer/jit/cpp_ext.py"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def state_files(lab) -> list[Path]:
    """The venv's patch state: servops keeps it inside the venv (keyed to its real path)."""
    return [p for p in [Path(lab.venv).resolve() / ".servops" / "state.json"] if p.exists()]


def expected_patched(remote_env, tmp_path) -> bytes:
    """What the shipped patch produces, computed independently with patch(1) on a copy."""
    work = tmp_path / "expected"
    (work / "flashinfer/jit").mkdir(parents=True)
    (work / CPP_EXT).write_bytes(remote_env["pristine"][CPP_EXT])
    subprocess.run(["patch", "-p1", "-s", "-d", str(work), "-i",
                    str(REPO / "patches/flashinfer-python" / f"{NAME}.patch")], check=True)
    return (work / CPP_EXT).read_bytes()


def test_apply_preflight_revert_verify_clean(lab, remote_env, tmp_path):
    """The issue's done-when: apply -> preflight passes -> revert -> verify clean."""
    inv = lab.inventory()
    target = remote_env["site"] / CPP_EXT
    res = run_invoke("patch.preflight", NAME, inventory=inv)
    assert res.returncode != 0 and "preflight unsupported" in res.stdout
    assert "torch._dynamo.exc.Unsupported" in res.stdout
    res = run_invoke("patch.preflight", NAME, "--expect-fail", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr

    res = run_invoke("patch.apply", NAME, inventory=inv)
    assert res.returncode == 0, res.stderr
    assert "lab1 : changed - applied" in res.stdout
    assert target.read_bytes() == expected_patched(remote_env, tmp_path)

    res = run_invoke("patch.preflight", NAME, inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "preflight pass" in res.stdout

    # The recorded patch's change is expected, not drift; a hand edit elsewhere is drift.
    res = run_invoke("inspect", "--verify", "flashinfer-python", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"patched by {NAME} (expected)" in res.stdout and CPP_EXT in res.stdout
    env_py = remote_env["site"] / "flashinfer/jit/env.py"
    env_py.write_bytes(env_py.read_bytes() + b"# hand edit\n")
    res = run_invoke("inspect", "--verify", "flashinfer-python,packaging", inventory=inv)
    assert res.returncode != 0 and "modified (unexpected drift)" in res.stdout and "flashinfer/jit/env.py" in res.stdout
    assert "packaging" in res.stdout and "lab1 : failed - 1 file(s) differ from RECORD" in res.stderr
    env_py.write_bytes(remote_env["pristine"]["flashinfer/jit/env.py"])

    res = run_invoke("patch.revert", NAME, inventory=inv)
    assert res.returncode == 0, res.stderr
    assert "reverted (exact restore)" in res.stdout
    res = run_invoke("inspect", "--verify", "flashinfer-python", inventory=inv)
    assert res.returncode == 0 and "files match RECORD" in res.stdout
    assert target.read_bytes() == remote_env["pristine"][CPP_EXT]


def test_status_reapply_is_ok_and_state_recorded(lab, remote_env):
    inv = lab.inventory()
    res = run_invoke("patch.status", inventory=inv)
    assert res.returncode == 0 and "not applied" in res.stdout and "0.7.2.post1" in res.stdout
    assert run_invoke("patch.apply", NAME, inventory=inv).returncode == 0
    res = run_invoke("patch.status", inventory=inv)
    assert " applied" in res.stdout and "not applied" not in res.stdout
    res = run_invoke("patch.apply", NAME, inventory=inv)
    assert res.returncode == 0 and "lab1 : ok - already applied" in res.stdout
    [state] = state_files(lab)
    record = json.loads(state.read_text())["applied"][NAME]
    assert record["version"] == "0.7.2.post1" and CPP_EXT in record["files"]
    # bytecode refreshed: the .pyc was compiled from the patched source
    target = remote_env["site"] / CPP_EXT
    pyc = Path(importlib.util.cache_from_source(str(target)))
    assert pyc.exists() and int.from_bytes(pyc.read_bytes()[12:16], "little") == target.stat().st_size


def test_dry_run_with_diff_changes_nothing(lab, remote_env):
    inv = lab.inventory()
    target = remote_env["site"] / CPP_EXT
    before = sha(target)
    res = run_invoke("patch.apply", NAME, "--dry-run", "--diff", inventory=inv)
    assert res.returncode == 0, res.stderr
    assert "would apply (check mode)" in res.stdout
    assert "+def _query_cuda_version() -> Version:" in res.stdout and "--- a/flashinfer/jit/cpp_ext.py" in res.stdout
    assert sha(target) == before and not state_files(lab)
    # --check is the Ansible spelling of the same
    res = run_invoke("patch.apply", NAME, "--check", inventory=inv)
    assert res.returncode == 0 and sha(target) == before


def test_conflict_leaves_every_file_byte_identical(lab, remote_env):
    inv = lab.inventory()
    target = remote_env["site"] / CPP_EXT
    # A line inside the patch's hunk (an edit elsewhere in the file would still apply cleanly).
    edited = target.read_text().replace("def get_cuda_version() -> Version:", 'def get_cuda_version() -> "Version":')
    target.write_text(edited)
    res = run_invoke("patch.status", inventory=inv)
    assert res.returncode != 0 and "conflicts" in res.stdout
    res = run_invoke("patch.apply", NAME, inventory=inv)
    assert res.returncode != 0 and "does not apply" in res.stderr and "nothing was changed" in res.stderr
    assert target.read_text() == edited and not list(target.parent.glob(".servops-*"))


def test_multi_file_patch_is_all_or_nothing(lab, remote_env, tmp_path):
    """Second file conflicts -> the first, which would apply, is untouched too."""
    site = remote_env["site"]
    patches = tmp_path / "patches" / "flashinfer-python"
    patches.mkdir(parents=True)
    env_py = (site / "flashinfer/jit/env.py").read_text().splitlines(True)
    init_first = (site / "flashinfer/__init__.py").read_text().splitlines(True)[0]
    diff = (
        "--- a/flashinfer/jit/env.py\n+++ b/flashinfer/jit/env.py\n@@ -1,1 +1,1 @@\n"
        f"-{env_py[0]}+# servops test edit\n"
        "--- a/flashinfer/__init__.py\n+++ b/flashinfer/__init__.py\n@@ -1,1 +1,1 @@\n"
        f"-{init_first.rstrip()} (not really)\n+changed\n"
    )
    (patches / "two-files.patch").write_text(diff)
    (patches / "two-files.yml").write_text(
        "applies_to: 'flashinfer-python==0.7.2.post1'\nwhy: test\nfiles: [flashinfer/jit/env.py, flashinfer/__init__.py]\n")
    before = {p: sha(site / p) for p in ("flashinfer/jit/env.py", "flashinfer/__init__.py")}
    res = run_invoke("patch.apply", "two-files", inventory=lab.inventory(),
                     env={"SERVOPS_PATCHES": str(tmp_path / "patches")})
    assert res.returncode != 0 and "does not apply" in res.stderr
    assert {p: sha(site / p) for p in before} == before


def test_version_mismatch_refused_unless_forced(lab, remote_env, tmp_path):
    root = tmp_path / "patches"
    (root / "flashinfer-python").mkdir(parents=True)
    src = REPO / "patches/flashinfer-python"
    (root / "flashinfer-python" / "old.patch").write_text((src / f"{NAME}.patch").read_text())
    (root / "flashinfer-python" / "old.yml").write_text(
        (src / f"{NAME}.yml").read_text().replace('"flashinfer-python>=0.2.14.post1,<0.8"', '"flashinfer-python<0.5"'))
    target = remote_env["site"] / CPP_EXT
    before = sha(target)
    env = {"SERVOPS_PATCHES": str(root)}
    res = run_invoke("patch.status", inventory=lab.inventory(), env=env)
    assert "version does not match" in res.stdout
    res = run_invoke("patch.apply", "old", inventory=lab.inventory(), env=env)
    assert res.returncode == 2 and "0.7.2.post1 is outside applies_to '<0.5'" in res.stderr and "--force" in res.stderr
    assert sha(target) == before
    res = run_invoke("patch.apply", "old", "--force", inventory=lab.inventory(), env=env)
    assert res.returncode == 0 and sha(target) != before


def test_lock_held_refuses_with_holder(lab, remote_env):
    inv = lab.inventory()
    # Learn where the lock lives (status creates nothing); apply+revert once to create it.
    assert run_invoke("patch.apply", NAME, "--dry-run", inventory=inv).returncode == 0
    [lockfile] = [Path(lab.venv).resolve() / ".servops" / "lock"]
    target = remote_env["site"] / CPP_EXT
    before = sha(target)
    with open(lockfile, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write("pid 4242 (test holder)\n")
        fh.flush()
        res = run_invoke("patch.apply", NAME, "--lock-timeout", "1", inventory=inv)
    assert res.returncode != 0 and "another servops patch operation holds" in res.stderr
    assert sha(target) == before


def test_concurrent_apply_one_changes_one_waits(lab, remote_env, tmp_path):
    inv = lab.inventory()
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv), NO_COLOR="1")
    procs = [subprocess.Popen([sys.executable, "-m", "invoke", "patch.apply", NAME], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    target = remote_env["site"] / CPP_EXT
    expected = expected_patched(remote_env, tmp_path)
    pristine = remote_env["pristine"][CPP_EXT]
    seen = set()
    while any(p.poll() is None for p in procs):
        data = target.read_bytes()
        seen.add(data == pristine or data == expected)  # never a half-written file
        time.sleep(0.01)
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert seen == {True}
    assert sorted(("changed - applied" in o, "ok - already applied" in o) for o in outs) == [(False, True), (True, False)]
    assert target.read_bytes() == expected


def test_create_from_a_hand_edit_then_revert_with_it(lab, remote_env, tmp_path):
    inv = lab.inventory()
    target = remote_env["site"] / CPP_EXT
    target.write_text(target.read_text().replace("def is_cuda_version_at_least(version_str: str) -> bool:",
                                                 "def is_cuda_version_at_least(version_str: str) -> bool:  # edited"))
    root = tmp_path / "patches"
    env = {"SERVOPS_PATCHES": str(root)}
    res = run_invoke("patch.create", "--file", CPP_EXT, "--name", "hand-edit", "--why", "test edit",
                     inventory=inv, env=env)
    assert res.returncode == 0, res.stderr
    assert "flashinfer-python 0.7.2.post1 wheel" in res.stdout
    patch = (root / "flashinfer-python/hand-edit.patch").read_text()
    assert "+def is_cuda_version_at_least(version_str: str) -> bool:  # edited" in patch
    meta = (root / "flashinfer-python/hand-edit.yml").read_text()
    assert "flashinfer-python==0.7.2.post1" in meta and "flashinfer/jit/cpp_ext.py" in meta
    # the captured patch is a real one: status sees it applied, revert undoes the hand edit
    res = run_invoke("patch.status", inventory=inv, env=env)
    assert " applied" in res.stdout
    res = run_invoke("patch.revert", "hand-edit", inventory=inv, env=env)
    assert res.returncode == 0 and "reverted" in res.stdout
    assert target.read_bytes() == remote_env["pristine"][CPP_EXT]
    # refusing to overwrite an existing patch
    res = run_invoke("patch.create", "--file", CPP_EXT, "--name", "hand-edit", inventory=inv, env=env)
    assert res.returncode == 2


def test_create_after_servops_apply_uses_the_backup(lab, remote_env, tmp_path):
    inv = lab.inventory()
    assert run_invoke("patch.apply", NAME, inventory=inv).returncode == 0
    res = run_invoke("patch.create", "--file", CPP_EXT, "--name", "again", inventory=inv,
                     env={"SERVOPS_PATCHES": str(tmp_path / "p")})
    assert res.returncode == 0, res.stderr
    assert "servops backup of patch cuda-version-no-subprocess" in res.stdout
    created = (tmp_path / "p/flashinfer-python/again.patch").read_text()
    assert "+def _query_cuda_version() -> Version:" in created


def test_revert_when_not_applied_is_ok(lab):
    res = run_invoke("patch.revert", NAME, inventory=lab.inventory())
    assert res.returncode == 0 and "ok - not applied" in res.stdout
