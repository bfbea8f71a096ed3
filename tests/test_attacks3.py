"""Red team round 3: a hostile host (its files, its replies), planted symlinks, races.

Every attack runs against the real lab (OpenSSH on 127.0.0.x, the real remote programs) or real
files; the host's deploy root is written to directly, as a compromised server process (same
user) or a hostile host could.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import healthy, one_line_error, root_of, run_invoke

DEPLOY = ("deploy", "--variant", "baseline")


def _starttime(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


@pytest.fixture
def bystander():
    """An unrelated process of the same user, leader of its own session (as servops' server is)."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _plant_pidfile(root: Path, pid: int, **extra) -> None:
    root.mkdir(parents=True, exist_ok=True)
    info = {"pid": pid, "pgid": pid, "starttime": _starttime(pid), "release": "20250101T000000Z-lab-tiny",
            "port": 1}
    info.update(extra)
    (root / "server.pid").write_text(json.dumps(info))


@pytest.mark.parametrize("pgid", ["self", "other"])
def test_stop_never_signals_a_process_a_planted_pidfile_names(alab, bystander, pgid):
    """server.pid naming an unrelated process (its real start time copied in), or naming our
    server's pid with another process group: `stop` signals nothing that servops did not start."""
    lab, inv, _port = alab
    root = root_of(lab)
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        if pgid == "self":
            _plant_pidfile(root, bystander.pid)
        else:
            _plant_pidfile(root, bystander.pid, pgid=victim.pid)
        res = run_invoke("stop", "--grace", "1", inventory=inv)
        assert "Traceback" not in res.stderr + res.stdout
        time.sleep(0.3)
        assert bystander.poll() is None and victim.poll() is None, "stop killed a process servops never started"
        assert "no server running" in res.stdout, res.stdout + res.stderr
    finally:
        victim.kill()
        victim.wait()


def _current(lab) -> str:
    return os.readlink(root_of(lab) / "current").rsplit("/", 1)[-1]


def test_symlinks_planted_in_a_release_never_carry_servops_writes(alab, tmp_path):
    """A compromised server replaces its release's server.log with a symlink to the operator's
    ~/.bashrc and plants `restarting` pointing at a new file: a rollback onto that release makes
    its log and markers anew in the release; the targets are never written or created."""
    lab, inv, port = alab
    assert run_invoke(*DEPLOY, inventory=inv).returncode == 0
    first = _current(lab)
    assert run_invoke(*DEPLOY, "--force", inventory=inv).returncode == 0
    assert _current(lab) != first
    victim = tmp_path / "bashrc"
    victim.write_text("original\n")
    created = tmp_path / "created-by-servops"
    rel = root_of(lab) / "releases" / first
    (rel / "server.log").unlink()
    (rel / "server.log").symlink_to(victim)
    (rel / "restarting").symlink_to(created)
    res = run_invoke("rollback", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _current(lab) == first and healthy(port)
    assert victim.read_text() == "original\n" and not created.exists()
    assert not (rel / "server.log").is_symlink() and (rel / "server.log").stat().st_size > 0


def test_a_symlinked_journal_or_releases_dir_stops_every_op_before_it_writes(alab, tmp_path):
    """journal.jsonl or releases/ replaced by a symlink (to the operator's files): every verb is
    one line naming it, and nothing is appended, created or stopped through it."""
    lab, inv, port = alab
    assert run_invoke(*DEPLOY, inventory=inv).returncode == 0
    root = root_of(lab)
    journal = root / "journal.jsonl"
    saved = journal.read_bytes()
    victim = tmp_path / "bashrc"
    victim.write_text("original\n")
    journal.unlink()
    journal.symlink_to(victim)
    for verb in (["stop", "--grace", "1"], [*DEPLOY], ["rollback"], ["releases"]):
        res = run_invoke(*verb, inventory=inv)
        assert res.returncode != 0 and "Traceback" not in res.stdout + res.stderr
        assert "journal.jsonl is a symlink" in res.stdout + res.stderr, res.stdout + res.stderr
        assert victim.read_text() == "original\n"
    assert healthy(port)
    journal.unlink()
    journal.write_bytes(saved)
    # releases/ itself pointing elsewhere: a new release would be written there
    elsewhere = tmp_path / "elsewhere"
    (root / "releases").rename(elsewhere)
    (root / "releases").symlink_to(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    res = run_invoke(*DEPLOY, "--force", inventory=inv)
    assert res.returncode != 0 and "releases is a symlink" in res.stdout + res.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == before and healthy(port)
    (root / "releases").unlink()
    elsewhere.rename(root / "releases")


def test_a_symlinked_release_is_not_a_release(alab, tmp_path):
    """releases/<valid name> planted as a symlink to another directory holding a release.json
    that says "deploying": no op lists it, marks it or writes into it."""
    lab, inv, port = alab
    outside = tmp_path / "outside"
    outside.mkdir()
    record = json.dumps({"status": "deploying", "variant": "x"})
    (outside / "release.json").write_text(record)
    releases = root_of(lab) / "releases"
    releases.mkdir(parents=True)
    (releases / "20250101T000000Z-planted").symlink_to(outside)
    res = run_invoke(*DEPLOY, inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (outside / "release.json").read_text() == record and sorted(os.listdir(outside)) == ["release.json"]
    res = run_invoke("releases", inventory=inv)
    assert "planted" not in res.stdout
    one_line_error(run_invoke("logs", "--release", "20250101T000000Z-planted", inventory=inv), "symlink")


def test_a_symlinked_lock_is_stale_and_breakable(alab, tmp_path):
    """deploy.lock planted as a symlink (dangling, or to a file holding a lock record): no
    permanent lock; it is broken like any stale lock and its target is left alone."""
    lab, inv, port = alab
    root = root_of(lab)
    root.mkdir(parents=True)
    target = tmp_path / "record"
    target.write_text(json.dumps({"id": "x", "who": "someone", "pid": 1, "controller": "elsewhere"}))
    for dest in (tmp_path / "missing", target):
        (root / "deploy.lock").unlink(missing_ok=True)
        (root / "deploy.lock").symlink_to(dest)
        res = run_invoke(*DEPLOY, "--force", inventory=inv)  # the second would be unchanged, lock untouched
        assert res.returncode == 0, res.stdout + res.stderr
        assert not (root / "deploy.lock").exists() and not (root / "deploy.lock").is_symlink()
    assert target.exists() and json.loads(target.read_text())["id"] == "x"


HOSTILE_REPLIES = {
    "nested": "[" * 200000 + "]" * 200000,
    "wrong shapes": json.dumps({"releases": "x", "current": 5, "server": "s", "root": ["a"], "acquired": True,
                                "listing": 3, "lines": 7, "entries": 3, "error_free": True}),
    "paths": json.dumps({"releases": [{"name": "../../../../tmp/servops-evil", "status": "healthy"}],
                         "current": "../../x", "server": None, "root": "/", "acquired": True,
                         "listing": {"releases": [], "current": None, "server": None}, "name": "../../etc/evil",
                         "lines": ["a"], "entries": [{"action": "x"}], "site": ["/etc"]}),
    "error": json.dumps({"error": "first\n" * 50 + "x" * 100000}),
}


@pytest.mark.parametrize("kind", list(HOSTILE_REPLIES))
def test_a_hostile_hosts_replies_are_one_line(lab, tmp_path, kind):
    """The host's python answers every program with crafted JSON: nested past the parser's depth,
    fields of the wrong type, release names that are paths, a huge multi-line error. Every verb
    is a one-line failure for that host: no traceback, no path used, bounded output."""
    payload = tmp_path / "payload"
    payload.write_text(HOSTILE_REPLIES[kind])
    evil = tmp_path / "python"
    evil.write_text(f"#!/bin/sh\ncat >/dev/null\ncat {payload}\n")
    evil.chmod(0o755)
    inv = lab.inventory(host_vars={"lab1": {"python": str(evil)}})
    for verb in (["releases"], ["status"], ["history"], ["logs"], ["stop"], ["rollback"], DEPLOY,
                 ["inspect", "--file", "flashinfer/__init__.py"], ["patch.status"], ["diagnose"]):
        res = run_invoke(*verb, inventory=inv, timeout=60)
        out = res.stdout + res.stderr
        assert res.returncode != 0 and "Traceback" not in out, (verb, out[-2000:])
        failed = [line for line in out.splitlines()
                  if ("lab1" in line and "failed" in line) or line.startswith("error:")]
        assert len(failed) == 1 and len(out) < 20000, (verb, out[-2000:])
        assert not Path("/tmp/servops-evil").exists()


def test_symlinks_planted_in_results_are_replaced_or_refused(alab, tmp_path):
    """A shared results/ directory holding a symlink where servops writes: the compare plot is
    written by rename (the symlink replaced, its target untouched); a campaign's trials.jsonl
    that is a symlink is one line naming it, and its target gets nothing."""
    lab, inv, port = alab
    results = tmp_path / "results"
    env = {"SERVOPS_RESULTS": str(results)}
    assert run_invoke(*DEPLOY, inventory=inv, env=env).returncode == 0
    res = run_invoke("bench", "--levels", "1", "--requests", "2", "--output-len", "4", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    [saved] = list(results.glob("lab1/*-baseline/*.jsonl"))
    other = saved.with_name("20200101T000000Z.jsonl")
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    for line in lines:
        line["servops"]["variant"] = "other"
    other.write_text("".join(json.dumps(line) + "\n" for line in lines))
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA operator\n")
    png = results / "lab1" / "compare-baseline-vs-other.png"
    png.symlink_to(victim)
    res = run_invoke("compare", "baseline", "other", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert victim.read_text() == "ssh-ed25519 AAAA operator\n"
    assert not png.is_symlink() and png.read_bytes()[:4] == b"\x89PNG"
    camp = tmp_path / "c.yml"
    camp.write_text("base: baseline\nbench: {levels: [1], requests: 2, output_len: 4}\n"
                    "objective: {maximize: output_tps@1}\n")
    log = results / "lab1" / "campaigns" / "c" / "trials.jsonl"
    log.parent.mkdir(parents=True)
    log.symlink_to(victim)
    res = run_invoke("tune.run", str(camp), inventory=inv, env=env)
    assert res.returncode != 0 and "Traceback" not in res.stdout + res.stderr
    assert "trials.jsonl is a symlink" in res.stdout + res.stderr, res.stdout + res.stderr
    assert victim.read_text() == "ssh-ed25519 AAAA operator\n"


def test_a_symlink_planted_at_the_patch_lock_is_refused_not_written_through(lab, remote_env, tmp_path):
    """The patch lock's holder line truncates the lock file: a symlink planted there would
    truncate whatever it points at. The operation is refused in one line; nothing changes."""
    state = Path(remote_env["venv"]).resolve() / ".servops"
    state.mkdir(mode=0o700, exist_ok=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (state / "lock").symlink_to(victim)
    target = remote_env["site"] / "flashinfer/jit/cpp_ext.py"
    before = target.read_bytes()
    res = run_invoke("patch.apply", "cuda-version-no-subprocess", inventory=lab.inventory())
    assert res.returncode != 0 and "symlink" in res.stdout + res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert victim.read_text() == "precious\n" and target.read_bytes() == before
