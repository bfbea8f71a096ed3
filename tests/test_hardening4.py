"""Issue 18 (hardening round 4), items 1-5, 8 and 11, over the real sshd lab: a misbehaving
server tree, a stepped clock or a killed controller never leaves a host down; the journal tells
the truth or says it cannot; a full disk after a patch's commit point is reported as it is.

Hostile servers run from tests/hostile/ (shipped to the host with `server_files`, as any server
module is); clocks are stepped through the guard's test hook, since this machine's clock is
everyone's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import LOADED, REPO, current, healthy, live_guards, playbooks_with, root_of, run_invoke, wait_for
from servops.remote.jsonl import append_entry, read_entries
from servops.remote.procs import RELEASE_ENV

TREE = "tests/hostile/tree_server.py"


# ---- what the test sees of the host, independently of servops --------------------------------

def processes_of(root: Path) -> dict[int, str]:
    """pid -> comm of every process whose environment or working directory places it in a
    release of this deploy root (read from /proc here, not through servops)."""
    releases = str((root / "releases").resolve())
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes()
            cwd = os.path.realpath(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if f"{RELEASE_ENV}={releases}/".encode() in env or cwd.startswith(releases + "/"):
            found[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
    return found


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(comm, ppid, state) of a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return stat.split("(", 1)[1].rsplit(")", 1)[0], int(fields[1]), fields[0]


def host_commands_in_flight(lab) -> list[int]:
    """pids of commands still running from a session of this lab's sshd. A controller SIGKILLed
    mid-command leaves its last command running on the host for a moment, and that command sees
    a dead guard as the next one would and starts a new guard. Found two ways: under a session's
    sshd (a login shell still sourcing the user's rc files, which pyenv's can make take seconds
    on a busy machine, is a host program that has not begun yet), and by the SSH_CONNECTION in
    its environment, since a session whose client is gone exits and leaves its command to init.
    The guards (daemons that fork from a host program) and the servers are not commands."""
    me, found = os.getpid(), set()
    sshd = lab.sshd_hosts(0)
    session_of_lab = f" {sshd.address} {sshd.port}".encode()
    guards = set(live_guards(lab.tmp))
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not (own := _stat(int(entry))) or own[0].startswith("sshd") or own[2] == "Z":
            continue
        pid = int(entry)
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        connection = next((v for v in env if v.startswith(b"SSH_CONNECTION=")), b"")
        if connection.endswith(session_of_lab) and pid not in guards \
                and not any(v.startswith(f"{RELEASE_ENV}=".encode()) for v in env):
            found.add(pid)
            continue
        up_pid = own[1]
        while up_pid > 1 and (up := _stat(up_pid)):
            if up[0].startswith("sshd") and up[1] == me:  # the session's sshd, under a lab master
                found.add(pid)
                break
            up_pid = up[1]
    return sorted(found)


def port_free(port: int) -> bool:
    import socket

    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def journal_actions(lab) -> list[str]:
    entries, _report = read_entries(str(root_of(lab) / "journal.jsonl"))
    return [e.get("action") for e in entries]


def tree_lab(lab, port: int, **extra):
    return lab.inventory(host_vars={"lab1": {"server_port": port, "server_module": "tree_server",
                                             "server_files": [TREE], "model_path": str(lab.tmp), **extra}},
                         filename="tree.yml")


def tree_books(tmp_path, mode: str) -> Path:
    return playbooks_with(tmp_path, tree=f"extends: baseline\nenv: {{TREE_MODE: {mode}}}\nstop_grace: 2\n")


# ---- 1. the whole process tree, always -----------------------------------------------------------

@pytest.mark.parametrize("mode", ["ignore-term", "setsid", "leader-dies"])
def test_1_stop_ends_every_process_of_the_release(alab, tmp_path, mode):
    """Children deaf to SIGTERM, a child that left the session with setsid(), a child still
    serving the port after its leader died: `stop` ends them all (SIGKILL after the grace), names
    what it killed, the port is free, and the next deploy is not refused."""
    lab, _inv, port = alab
    inv = tree_lab(lab, port)
    env = {"SERVOPS_PLAYBOOKS": str(tree_books(tmp_path, mode))}
    res = run_invoke("deploy", "--variant", "tree", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    root = root_of(lab)
    leader = json.loads((root / "server.pid").read_text())["pid"]
    # the leader's children up (in leader-dies, the leader may be gone already: the deploy's gate
    # on a loaded machine can outlast its 2 s)
    wait_for(lambda: [p for p in processes_of(root) if p != leader], what="the tree's children running")
    if mode == "leader-dies":
        wait_for(lambda: not Path(f"/proc/{leader}").exists() or
                 Path(f"/proc/{leader}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", what="the leader exited")
        assert healthy(port), "the child keeps serving the port"
    before = processes_of(root)
    res = run_invoke("stop", "--grace", "1", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "stopped" in out and "no server running" not in out
    assert not processes_of(root), f"left running: {processes_of(root)} (before: {before})"
    assert port_free(port)
    if mode == "ignore-term":
        assert "SIGKILL" in out
    if mode == "setsid":
        assert "had left the server's session" in out
    history = run_invoke("history", "--json", inventory=inv).stdout
    assert '"action": "stop"' in history
    # the next deploy (the lab's double) is not refused "port in use by a process servops did not start"
    res = run_invoke("deploy", "--variant", "baseline", "--force", inventory=lab.inventory(
        host_vars={"lab1": {"server_port": port}}, filename="plain.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert healthy(port)


def test_1_deploy_replaces_a_server_whose_schedulers_ignore_sigterm(alab, tmp_path):
    """The SGLang double's TP schedulers stuck in NCCL (deaf to SIGTERM): a redeploy ends them
    all and the new server comes up; afterwards only the new release's processes run."""
    lab, inv, port = alab
    books = playbooks_with(tmp_path, stuck="extends: baseline\nstop_grace: 1\n"
                                           "env: {SGLANG_DOUBLE_SCHEDULERS_IGNORE_SIGTERM: '1'}\n")
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    assert run_invoke("deploy", "--variant", "stuck", inventory=inv, env=env).returncode == 0
    root = root_of(lab)
    first = current(lab)
    wait_for(lambda: sum(1 for c in processes_of(root).values() if c.startswith("sglang::")) >= 9,
             what="the double's 8 TP schedulers and its server process")
    res = run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SIGKILL" in res.stdout + res.stderr
    left = {pid for pid in processes_of(root)
            if f"/releases/{first}" in os.path.realpath(f"/proc/{pid}/cwd")}
    assert not left, f"processes of the old release left: {left}"
    assert healthy(port)


# ---- 2. no untracked server ------------------------------------------------------------------

@pytest.mark.parametrize("point", ["start:forked", "start:recorded"])
def test_2_a_start_killed_midway_never_leaves_an_untracked_server(alab, point):
    """The host program SIGKILLed during a rollback's start, after the fork (pid not yet
    recorded) or after recording it (server not yet told to run): no server runs untracked;
    status says nothing runs; the next deploy is not refused."""
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    res = run_invoke("rollback", inventory=inv, env={"SERVOPS_FAULT": point})
    assert res.returncode != 0
    root = root_of(lab)
    wait_for(lambda: not processes_of(root), what="every process of the release ended")
    status = run_invoke("status", inventory=inv)
    assert not healthy(port) and "down" in status.stdout, status.stdout
    res = run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert healthy(port)


def test_2_a_running_server_without_its_pidfile_is_found_again(alab):
    """server.pid lost (an older servops killed mid-start): the next command finds the release's
    server by its processes, records it again, and `stop` stops it."""
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    root = root_of(lab)
    pid = json.loads((root / "server.pid").read_text())["pid"]
    (root / "server.pid").unlink()
    res = run_invoke("status", inventory=inv)
    assert res.returncode == 0 and str(pid) in res.stdout, res.stdout
    assert json.loads((root / "server.pid").read_text())["pid"] == pid
    assert "server.adopted" in journal_actions(lab)
    assert run_invoke("stop", "--grace", "2", inventory=inv).returncode == 0
    assert not processes_of(root) and not healthy(port)


# ---- 3. the guard survives clocks and double faults --------------------------------------------

def _deploy_in_background(inv, books, variant, extra_env=None) -> subprocess.Popen:
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv), SERVOPS_PLAYBOOKS=str(books), **(extra_env or {}))
    return subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--variant", variant], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lease_lab(lab, port):
    return lab.inventory(host_vars={"lab1": {"server_port": port, "lease_timeout": 5}}, filename="lease.yml")


def _wait_current(lab, suffix):
    wait_for(lambda: (current(lab) or "").endswith(suffix), what=f"a {suffix} release current")


def test_3_a_backward_clock_step_does_not_disarm_the_guard(alab, tmp_path):
    """The guard's wall clock stepped back an hour (and the lease file's mtime in the future, as
    a clock step leaves it): the controller is killed mid-gate of a never-healthy release; the
    guard still takes over on its monotonic clock and brings the old release back."""
    lab, _inv, port = alab
    inv = _lease_lab(lab, port)
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    good = current(lab)
    books = playbooks_with(tmp_path, sick="extends: baseline\nenv: {SGLANG_DOUBLE_NEVER_HEALTHY: '1'}\n"
                                          "health: {timeout: 40}\n")
    proc = _deploy_in_background(inv, books, "sick", {"SERVOPS_TEST_GUARD_CLOCK_STEP": "-3600"})
    _wait_current(lab, "-sick")
    lease = next((root_of(lab) / "releases").glob("*-sick")) / "lease"
    os.utime(lease, (time.time() + 3600, time.time() + 3600))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the guard's rollback stops the sick server and starts the good one, on the guard's clock: two
    # server operations (a loaded warm run spent more than 120 s on them)
    wait_for(lambda: current(lab) == good and healthy(port) and "guard.rollback" in journal_actions(lab),
             timeout=2 * LOADED, what="the guard's rollback to the good release", step=0.5)
    actions = journal_actions(lab)
    assert actions.count("guard.takeover") == 1 and actions.count("guard.rollback") == 1
    wait_for(lambda: not (root_of(lab) / "deploy.lock").exists(), what="the deploy lock released")


def test_3_a_forward_clock_step_with_a_live_controller_changes_nothing(alab, tmp_path):
    """The guard's clock jumps an hour ahead while the controller is alive and renewing: no
    takeover; the deploy ends healthy by the controller alone."""
    lab, _inv, port = alab
    inv = _lease_lab(lab, port)
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    books = playbooks_with(tmp_path, slow="extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: '8'}\n")
    proc = _deploy_in_background(inv, books, "slow", {"SERVOPS_TEST_GUARD_CLOCK_STEP": "3600"})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "guard.takeover" not in journal_actions(lab)
    assert current(lab).endswith("-slow") and healthy(port)


def test_3_a_frozen_controller_and_the_guard_never_both_act(alab, tmp_path):
    """The controller frozen past its lease (a laptop lid) during the gate of a never-healthy
    release, then resumed: the guard took the decision; the controller stands down and says so;
    the old release is restarted once, and the journal has one takeover and one rollback."""
    lab, _inv, port = alab
    inv = _lease_lab(lab, port)
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    good = current(lab)
    books = playbooks_with(tmp_path, sick="extends: baseline\nenv: {SGLANG_DOUBLE_NEVER_HEALTHY: '1'}\n"
                                          "health: {timeout: 12}\n")
    proc = _deploy_in_background(inv, books, "sick")
    _wait_current(lab, "-sick")
    proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: "guard.takeover" in journal_actions(lab), what="the guard's takeover")
    proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "guard took over" in out, out
    wait_for(lambda: current(lab) == good and healthy(port) and "guard.rollback" in journal_actions(lab),
             what="the guard's rollback to the good release")
    time.sleep(2)  # a second actor, were there one, would act now
    actions = journal_actions(lab)
    assert actions.count("guard.takeover") == 1, actions
    assert actions.count("guard.rollback") == 1 and "rollback" not in actions, actions
    starts = [e for e in read_entries(str(root_of(lab) / "journal.jsonl"))[0] if e.get("action") == "server.stop"]
    assert len(starts) <= 1, starts  # the controller never restarted anything after the guard acted


def test_3_a_dead_guard_is_restarted_by_the_next_command(alab, tmp_path):
    """Controller and guard both SIGKILLed during the gate: `status` says the deploy never
    finished and starts a new guard, which rolls the host back by itself."""
    lab, _inv, port = alab
    inv = _lease_lab(lab, port)
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    good = current(lab)
    books = playbooks_with(tmp_path, sick="extends: baseline\nenv: {SGLANG_DOUBLE_NEVER_HEALTHY: '1'}\n"
                                          "health: {timeout: 30}\n")
    proc = _deploy_in_background(inv, books, "sick")
    _wait_current(lab, "-sick")
    release = next((root_of(lab) / "releases").glob("*-sick"))
    guard = json.loads((release / "guard.pid").read_text())["pid"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the controller's last host program ends before the guard dies, so that `status` is the next command
    wait_for(lambda: not host_commands_in_flight(lab), what="the killed controller's host commands ended")
    os.kill(guard, signal.SIGKILL)
    res = run_invoke("status", inventory=inv)
    assert "never finished" in res.stdout + res.stderr, res.stdout + res.stderr
    assert "guard.restarted" in journal_actions(lab)
    wait_for(lambda: current(lab) == good and healthy(port) and "guard.rollback" in journal_actions(lab),
             what="the restarted guard's rollback to the good release")
    assert json.loads((release / "release.json").read_text())["status"] == "failed"
    res = run_invoke("status", inventory=inv)
    assert "never finished" not in res.stdout + res.stderr


# ---- 4. special files in the deploy root -------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_4_a_fifo_or_directory_at_the_journal_is_one_line(alab, kind):
    """A FIFO or a directory planted at journal.jsonl: `history` and a deploy refuse at once
    with one line naming it (never a hang, never "0 entries" or an unnamed Errno)."""
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    journal = root_of(lab) / "journal.jsonl"
    journal.unlink()
    os.mkfifo(journal) if kind == "fifo" else journal.mkdir()
    started = time.monotonic()
    for verb in (["history"], ["deploy", "--variant", "baseline"]):
        res = run_invoke(*verb, inventory=inv, timeout=60)
        assert res.returncode != 0
        assert f"journal.jsonl is a {'FIFO' if kind == 'fifo' else 'directory'}" in res.stdout + res.stderr
        assert "Traceback" not in res.stdout + res.stderr
    assert time.monotonic() - started < 40
    assert healthy(port)


def test_4_a_fifo_at_a_release_marker_is_refused_not_waited_on(alab):
    """A FIFO planted at a release's `restarting` marker: the rollback onto that release is
    refused with one line naming it, and nothing stopped."""
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    first = current(lab)
    assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    os.mkfifo(root_of(lab) / "releases" / first / "restarting")
    res = run_invoke("rollback", inventory=inv, timeout=60)
    assert res.returncode != 0 and "restarting is a FIFO" in res.stdout + res.stderr, res.stdout + res.stderr


# ---- 5. locks cover what a release depends on -------------------------------------------------

def test_5_a_patch_revert_during_another_roots_deploy_is_refused(lab, tmp_path):
    """Two inventory entries share one venv: while entry A's deploy of piecewise (which needs the
    patch) is in its health gate, reverting that patch through entry B is refused naming A's
    deploy; the patch stays on disk."""
    from servops.lab.sshd import free_port

    pa, pb = free_port(), free_port()
    inv = lab.inventory(n_hosts=2, host_vars={"lab1": {"server_port": pa}, "lab2": {"server_port": pb}})
    books = playbooks_with(tmp_path, slowpw="extends: piecewise\nenv: {SGLANG_DOUBLE_LOAD_TIME: '12'}\n")
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv), SERVOPS_PLAYBOOKS=str(books))
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--variant", "slowpw", "-H", "lab1"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        root_a = lab.tmp / "deploy-lab1"
        wait_for(lambda: (root_a / "current").is_symlink() and os.readlink(root_a / "current").endswith("-slowpw"),
                 what="lab1's slowpw release current")
        res = run_invoke("patch.revert", "cuda-version-no-subprocess", "-H", "lab2", "--lock-timeout", "1",
                         inventory=inv)
        assert res.returncode != 0, res.stdout + res.stderr
        assert str(root_a) in res.stdout + res.stderr and "deploy" in res.stdout + res.stderr
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
    finally:
        proc.kill()
        run_invoke("stop", "--grace", "2", "--break-lock", "-H", "lab1", inventory=inv)
    status = run_invoke("patch.status", "-H", "lab1", inventory=inv)
    assert "cuda-version-no-subprocess" in status.stdout and "applied" in status.stdout


def test_5_a_release_whose_patch_is_gone_is_not_restarted(alab):
    """A release whose patch is no longer on disk is never started: the host program's check
    (the first step of every restart, and of start itself) refuses, naming the missing patch."""
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "piecewise", inventory=inv).returncode == 0
    pw = current(lab)
    assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    # the piecewise release asks for the patch; the venv no longer has it: a bare host-side start
    # (what a guard's rollback does after its patch plan failed) refuses
    from servops import remote
    program = remote.with_args("deploy_ctl", {"op": "verify_patches", "name": pw,
                                              "deploy_root": str(root_of(lab))})
    py = str(Path(lab.venv) / "bin" / "python")
    res = subprocess.run([py, "-"], input=program, capture_output=True, text=True)
    assert res.returncode != 0 and "needs patches cuda-version-no-subprocess" in res.stdout
    assert "not applied" in res.stdout


# ---- 8. the journal tells the truth or says it cannot ------------------------------------------

def test_8_journal_damage_is_skipped_counted_and_named(tmp_path):
    """A torn last line (a full disk) never swallows the next entry; malformed lines (a list, a
    string, wrong field types, 100,000-deep nesting) are skipped and counted; a removed entry
    breaks the chain; cutting entries off the end shows against the head."""
    path = str(tmp_path / "journal.jsonl")
    for i in range(3):
        append_entry(path, {"action": f"a{i}", "at": "t"})
    with open(path, "ab") as fh:
        fh.write(b'{"action": "torn", "at"')  # the disk filled mid-write
    append_entry(path, {"action": "after-torn", "at": "t"})
    with open(path, "ab") as fh:
        fh.write(b'[1, 2]\n"text"\n{"action": 5, "at": "t"}\n' + b"[" * 100000 + b"\n")
    append_entry(path, {"action": "last", "at": "t"})
    entries, report = read_entries(path, lambda e: None if isinstance(e.get("action"), str) else "action not text")
    assert [e["action"] for e in entries] == ["a0", "a1", "a2", "after-torn", "last"]
    assert len(report["skipped"]) == 5 and not report["breaks"] and not report["truncated"]
    # remove one entry from the middle: the chain says so
    lines = Path(path).read_bytes().split(b"\n")
    Path(path).write_bytes(b"\n".join(l for l in lines if b'"a1"' not in l))
    _entries, report = read_entries(path)
    assert report["breaks"] and "does not follow" in report["breaks"][0][1]
    # cut the last entry off: the head says the log was truncated
    lines = Path(path).read_bytes().rstrip(b"\n").split(b"\n")
    Path(path).write_bytes(b"\n".join(lines[:-1]) + b"\n")
    _entries, report = read_entries(path)
    assert report["truncated"]


def test_8_history_reports_damage_instead_of_failing(alab):
    """Over SSH: a journal with damaged lines and a removed entry; `history` still lists the
    good entries, says how many it skipped and that the chain is broken; --json is valid JSON."""
    lab, inv, _port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    journal = root_of(lab) / "journal.jsonl"
    lines = journal.read_bytes().rstrip(b"\n").split(b"\n")
    damaged = lines[:1] + lines[2:] + [b'{"action": ["x"]', b"[" * 100000, b'"just text"']
    journal.write_bytes(b"\n".join(damaged) + b"\n")
    res = run_invoke("history", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "3 unreadable entries skipped" in out and "chain broken" in out, out
    res = run_invoke("history", "--json", inventory=inv)
    for line in res.stdout.splitlines():
        json.loads(line)


# ---- 11. ENOSPC after a patch's commit point -----------------------------------------------------

def test_11_a_full_disk_after_the_commit_point_is_reported_as_applied_not_recorded(lab, remote_env):
    """The venv's patch state cannot be saved after the files were patched (ENOSPC): the host
    and the message agree: "applied, not yet recorded", and the next patch operation records it."""
    inv = lab.inventory()
    res = run_invoke("patch.apply", "cuda-version-no-subprocess", inventory=inv,
                     env={"SERVOPS_FAULT": "apply:enospc-before-state"})
    out = res.stdout + res.stderr
    assert "applied, not yet recorded" in out, out
    assert remote_env["site"].joinpath("flashinfer/jit/cpp_ext.py").read_bytes() != \
        remote_env["pristine"]["flashinfer/jit/cpp_ext.py"]
    res = run_invoke("patch.status", inventory=inv)
    assert "finished an interrupted apply" in res.stdout + res.stderr and "applied" in res.stdout


def test_11_a_full_disk_before_the_commit_point_changes_nothing(lab, remote_env):
    """ENOSPC while the patched files are being written: everything is rolled back before the
    failure is reported, and the message says nothing was changed."""
    inv = lab.inventory()
    res = run_invoke("patch.apply", "cuda-version-no-subprocess", inventory=inv,
                     env={"SERVOPS_FAULT": "apply:enospc-rename:0"})
    assert res.returncode != 0
    assert "nothing was changed" in res.stdout + res.stderr, res.stdout + res.stderr
    assert remote_env["site"].joinpath("flashinfer/jit/cpp_ext.py").read_bytes() == \
        remote_env["pristine"]["flashinfer/jit/cpp_ext.py"]
