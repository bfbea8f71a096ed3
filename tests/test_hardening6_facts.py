"""Issue 48 (hardening, round 6), items 6 and 7, over the real sshd lab: every field of the facts
round trip's reply is checked before use (a wrapper python on the host rewrites the reply of
servops' own program; a lock file written on the host), and start/restart refuse a release
whose launch files were edited on the host since servops wrote them, unless --allow-drift."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import current, healthy, one_line_error, root_of, run_invoke, server_pid

# The host's python, wrapped: servops' program runs on the real one, and its reply (the last
# line) goes through MUTATE when WHEN says it is the reply under attack; every other line and
# reply passes as it is.
WRAPPER = """#!/bin/bash
set -o pipefail
{real} "$@" | {real} {rewrite}
"""
REWRITE = """import json, sys
lines = sys.stdin.read().splitlines()
try:
    reply = json.loads(lines[-1])
except (ValueError, IndexError):
    reply = None
if isinstance(reply, dict) and ({when}):
{mutate}
    lines[-1] = json.dumps(reply)
sys.stdout.write("\\n".join(lines) + "\\n")
"""
DEPLOY_FACTS = "'deploy' in reply and 'branches' in reply"   # the deploy's facts trip
CTL_FACTS = "'releases' in reply and 'patches' in reply"       # deploy_ctl facts (rollback, restart)
LOCK_REPLY = "'acquired' in reply"                              # deploy_ctl lock


def rewriting(lab, inv_name: str, when: str, mutate: str) -> Path:
    """An inventory for lab1 whose python is the wrapper, its reply rewritten by `mutate`."""
    rewrite = lab.tmp / f"{inv_name}-rewrite.py"
    rewrite.write_text(REWRITE.format(when=when, mutate="\n".join("    " + l for l in mutate.splitlines())))
    wrapper = lab.tmp / f"{inv_name}-python"
    wrapper.write_text(WRAPPER.format(real=Path(lab.venv) / "bin" / "python", rewrite=rewrite))
    wrapper.chmod(0o755)
    return lab.inventory(host_vars={"lab1": {"python": str(wrapper)}}, filename=f"{inv_name}.yml")


def nothing_changed(lab, before: str | None) -> None:
    assert not (root_of(lab) / "deploy.lock").exists()
    assert current(lab) == before


# ---- 6. a malformed field of the host's reply ---------------------------------------------------------

ATTACKS = {
    "lock-is-a-string": ("reply['deploy']['lock'] = 'string'", "deploy.lock 'string' is not an object",
                         "reply['lock'] = 'string'", "lock 'string' is not an object"),
    "pid-abc": ("reply['deploy']['lock'] = {'id': 'x', 'who': 'bo', 'pid': 'abc', 'age': 1.0}",
                "deploy.lock.pid 'abc' is not a pid",
                "reply['lock'] = {'id': 'x', 'who': 'bo', 'pid': 'abc', 'age': 1.0}", "lock.pid 'abc' is not a pid"),
    "pid-huge": ("reply['deploy']['lock'] = {'id': 'x', 'who': 'bo', 'pid': 10**30, 'age': 1.0}",
                 f"deploy.lock.pid {10**30} is not a pid",
                 "reply['lock'] = {'id': 'x', 'who': 'bo', 'pid': 10**30, 'age': 1.0}", f"lock.pid {10**30} is not a pid"),
    "patch-name-5": ("reply['deploy']['patches'][0]['name'] = 5", "deploy.patches[0].name 5 is not text",
                     "reply['patches'][0]['name'] = 5", "patches[0].name 5 is not text"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_6_a_malformed_field_of_the_facts_reply_is_one_line_and_changes_nothing(alab, attack):
    lab, inv, _port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    before = current(lab)
    deploy_mutation, deploy_problem, ctl_mutation, ctl_problem = ATTACKS[attack]
    bad = rewriting(lab, "deploy-" + attack, DEPLOY_FACTS, deploy_mutation)
    for extra in (["--dry-run"], ["--force"]):  # check mode, and a real deploy
        res = run_invoke("deploy", "--variant", "baseline", *extra, "-H", "lab1", inventory=bad)
        one_line_error_for_host(res, f"launch_check+deploy_facts sent a malformed reply ({deploy_problem})")
        nothing_changed(lab, before)
    bad = rewriting(lab, "ctl-" + attack, CTL_FACTS, ctl_mutation)
    for verb in (["rollback", "--dry-run"], ["restart", "--dry-run"], ["restart"]):
        res = run_invoke(*verb, "-H", "lab1", inventory=bad)
        one_line_error_for_host(res, f"deploy_ctl facts sent a malformed reply ({ctl_problem})")
        nothing_changed(lab, before)
    assert healthy(_port)


def one_line_error_for_host(res, needle: str) -> None:
    """lab1's failed line, once, holding `needle`; exit 2 (nothing was changed); no traceback."""
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out and "servops bug" not in out, out
    failed = [l for l in out.splitlines() if "failed" in l or "error" in l]
    assert len(failed) == 1 and needle in failed[0], out


def test_6_a_lock_reply_servops_cannot_use_leaves_no_lock(alab):
    """The lock op's reply rewritten (acquired is not true or false): the deploy stops in one line
    and the lock the host took for it is released: nothing on the host is as it was not."""
    lab, inv, _port = alab
    bad = rewriting(lab, "lock", LOCK_REPLY, "reply['acquired'] = 'yes'")
    res = run_invoke("deploy", "--variant", "baseline", "-H", "lab1", inventory=bad)
    one_line_error_for_host(res, "deploy_ctl lock sent a malformed reply (acquired 'yes' is not true or false)")
    nothing_changed(lab, None)
    assert not (root_of(lab) / "releases").exists() or not list((root_of(lab) / "releases").iterdir())


def write_lock(lab, record) -> Path:
    lock = root_of(lab) / "deploy.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps(record))
    return lock


def test_6_a_lock_file_with_a_3mb_holder_name_is_named_in_one_short_line(alab):
    lab, inv, _port = alab
    write_lock(lab, {"id": "f" * 32, "who": "x" * (3 << 20), "user": "bo", "controller": "elsewhere", "pid": 4242,
                     "action": "deploy baseline", "acquired_at": "2026-12-08T10:00:00Z"})
    res = run_invoke("deploy", "--variant", "baseline", "--dry-run", inventory=inv)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and len(out) < 20000, out[-3000:]
    assert f"the deploy lock is held by {'x' * 80}... [{(3 << 20) - 80:,} more characters] pid 4242" in out, out[-3000:]
    assert "the real run would refuse unless it is released first" in out
    res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and len(out) < 20000 and "wait for it, or pass --break-lock" in out, out[-3000:]


def test_6_a_lock_file_whose_pid_is_no_pid_is_a_damaged_lock_stale_and_broken(alab):
    lab, inv, port = alab
    lock = write_lock(lab, {"id": "f" * 32, "who": "bo", "controller": "elsewhere", "pid": "abc",
                            "action": "deploy", "acquired_at": "2026-12-08T10:00:00Z"})
    res = run_invoke("deploy", "--variant", "baseline", "--dry-run", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("the deploy lock is held by a damaged lock file: the real run would break it (stale: the lock file is "
            "damaged (pid 'abc' is not a pid))") in res.stdout, res.stdout
    assert json.loads(lock.read_text())["pid"] == "abc"  # check mode changed nothing
    res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "breaking the deploy lock held by a damaged lock file" in res.stderr and healthy(port)
    assert not lock.exists()


# ---- 7. a release edited on the host is not restarted without a word -----------------------------------

def test_7_restart_and_start_refuse_a_release_whose_launch_sh_was_edited_unless_allowed(alab):
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    name, pid = current(lab), server_pid(lab)
    script = root_of(lab) / "releases" / name / "launch.sh"
    script.write_text(script.read_text() + "# edited on the host\n")
    res = run_invoke("restart", "--dry-run", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"would restart {name}; {name}: launch.sh was changed on the host (sha256 " in res.stdout
    assert "the real run would refuse (--allow-drift runs it) (check mode)" in res.stdout
    res = run_invoke("restart", inventory=inv)
    one_line_error_for_host(res, f"lab1: restart refused: {name}: launch.sh was changed on the host (sha256 ")
    assert "bytes, modified " in res.stderr and "then restart --allow-drift to run it as it is" in res.stderr
    assert current(lab) == name and server_pid(lab) == pid and healthy(port)  # untouched, still serving
    assert run_invoke("stop", inventory=inv).returncode == 0
    res = run_invoke("start", inventory=inv)
    one_line_error_for_host(res, f"lab1: start refused: {name}: launch.sh was changed on the host (sha256 ")
    assert not healthy(port)  # down, as it was found
    assert run_invoke("start", "--allow-drift", inventory=inv).returncode == 0 and healthy(port)
    pid = server_pid(lab)
    res = run_invoke("restart", "--allow-drift", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "--allow-drift: " in res.stdout and "running it as edited" in res.stdout
    assert current(lab) == name and server_pid(lab) != pid and healthy(port)
    journal = [json.loads(l) for l in (root_of(lab) / "journal.jsonl").read_text().splitlines() if l.strip()]
    begun = [e for e in journal if e.get("action") == "restart.begin"][-1]
    assert begun["detail"].startswith(f"--allow-drift: {name}: launch.sh was changed on the host")
    # a launch file replaced by a FIFO is named, never read (no hang); a fresh deploy clears it all
    script.unlink()
    os.mkfifo(script)
    res = run_invoke("restart", inventory=inv)
    one_line_error_for_host(res, f"{name}: launch.sh is no longer the file servops wrote ({script} is a FIFO, "
                                 f"not a regular file)")
    assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    res = run_invoke("restart", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
