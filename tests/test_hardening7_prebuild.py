"""Hardening round 7, the pre-build beside the serving server: its program (deploy_ctl warmup, the
real host program run here in a deploy root of the test's own) killed mid-way, by SIGKILL as the
OOM killer or a dropped SSH session leaves it, never reaching its `finally`. Before: the warm-up
server it had started (its own session, its own port, GPU memory beside the serving server's)
ran on for good, and the next deploy's warm-up found its port taken and skipped. Now the next
command on the host, whatever its verb, ends it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from servops import remote
from servops.lab.sshd import free_port

RELEASE = "20261207T000000Z-pw"
# the warm-up's server: never healthy, it holds its port as a real one would (a marker in its argv)
SERVER = """#!/bin/bash
exec python3 -c 'import socket, sys, time; s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); time.sleep(600)' {port} h7-warmup-{tag}
"""


def deploy_ctl(root: Path, args: dict, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    proc.stdin.write(remote.with_args("deploy_ctl", dict(args, deploy_root=str(root))))
    proc.stdin.close()
    return proc


def reply_of(proc: subprocess.Popen, timeout: float = 60) -> dict:
    out = proc.stdout.read()
    proc.wait(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def warmup_pids(tag: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"h7-warmup-{tag}$"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def wait_for(predicate, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def start_warmup(tmp_path: Path, tag: str) -> tuple[Path, subprocess.Popen]:
    """A deploy root with one release, and deploy_ctl's warm-up of it running (its server marked `tag`)."""
    root = tmp_path / "deploy"
    (root / "releases" / RELEASE).mkdir(parents=True)
    port = free_port()
    return root, deploy_ctl(root, {"op": "warmup", "name": RELEASE, "port": port, "health": {}, "timeout": 120,
                                   "script": SERVER.format(port=port, tag=tag)})


def test_a_warm_up_whose_program_was_killed_is_ended_by_the_next_command(tmp_path):
    tag = str(os.getpid())
    root, killed = start_warmup(tmp_path, tag)
    try:
        assert wait_for(lambda: warmup_pids(tag)), killed.stderr.read() if killed.poll() is not None else ""
        os.kill(killed.pid, signal.SIGKILL)  # mid-way: the warm-up server up, not yet healthy
        killed.wait()
        time.sleep(1)
        assert warmup_pids(tag), "the warm-up server outlives its killed program (the attack's premise)"
        reply = reply_of(deploy_ctl(root, {"op": "releases"}))  # the next command, any verb
        assert reply.get("orphan_warmups_ended") == [RELEASE]
        assert wait_for(lambda: not warmup_pids(tag), 5)
        assert not (root / "releases" / RELEASE / "warmup.owner").exists()
    finally:
        for pid in warmup_pids(tag):
            os.kill(pid, signal.SIGKILL)


def test_a_warm_up_still_watched_by_its_program_is_left_to_it(tmp_path):
    tag = f"{os.getpid()}-live"
    root, running = start_warmup(tmp_path, tag)
    try:
        assert wait_for(lambda: warmup_pids(tag) and (root / "releases" / RELEASE / "warmup.owner").exists())
        assert "orphan_warmups_ended" not in reply_of(deploy_ctl(root, {"op": "releases"}))
        assert warmup_pids(tag)  # a concurrent status or facts trip never ends a watched warm-up
    finally:
        running.kill()
        running.wait()
        reply_of(deploy_ctl(root, {"op": "releases"}))
        for pid in warmup_pids(tag):
            os.kill(pid, signal.SIGKILL)


def test_a_server_port_near_the_top_gets_a_warm_up_port_that_exists_and_is_free(tmp_path):
    from servops.inventory import Host
    from servops.prebuild import warmup_port
    # port 65500's warm-up was 65600: the host program's bind raised OverflowError and failed the deploy
    port = warmup_port(Host("h1", {"server_port": 65500}))
    assert port == 65400
    root = tmp_path / "deploy"
    (root / "releases" / RELEASE).mkdir(parents=True)
    reply = reply_of(deploy_ctl(root, {"op": "port_check", "port": port}))
    assert "error" not in reply
    assert warmup_port(Host("h1", {"server_port": 30000})) == 30100
    assert warmup_port(Host("h1", {"server_port": 30000, "jit_warmup_port": 31000})) == 31000


def test_discarding_a_release_whose_warm_up_still_runs_ends_the_warm_up_first(tmp_path):
    tag = f"{os.getpid()}-discard"
    root, running = start_warmup(tmp_path, tag)
    try:
        assert wait_for(lambda: warmup_pids(tag))
        # the aborted deploy's undo (Ctrl-C mid pre-build), its warm-up program not yet gone: before, the
        # release directory was removed under the warm-up server, whose owner file went with it (never swept)
        reply = reply_of(deploy_ctl(root, {"op": "discard", "name": RELEASE}))
        assert reply["removed"] == RELEASE and not (root / "releases" / RELEASE).exists()
        assert wait_for(lambda: not warmup_pids(tag), 5)
    finally:
        running.kill()
        running.wait()
        for pid in warmup_pids(tag):
            os.kill(pid, signal.SIGKILL)


def test_an_audit_killed_mid_way_leaves_nothing_once_any_command_runs(tmp_path):
    """An audit program killed by SIGKILL or a dropped session's SIGHUP never reaches its
    `finally`: its work directory (the shrunk model, the audit server's log) and anything still
    running in it stayed in /tmp until the next audit. Now the next deploy_ctl command, any verb,
    removes it; an audit still running (its owner alive) is left alone."""
    from servops.remote.procs import proc_starttime

    tmp = tmp_path / "tmp"
    dead, live = tmp / "servops-audit-killed", tmp / "servops-probe-live"
    for d in (dead, live):
        d.mkdir(parents=True)
    (dead / "owner").write_text(f"{os.getpid()} not-its-start-time")  # a pid reused by another program
    (live / "owner").write_text(f"{os.getpid()} {proc_starttime(os.getpid())}")
    (dead / "server.log").write_text("the audit server's log\n")
    held = subprocess.Popen(["sleep", "600"], cwd=dead)  # the audit server, still running in its dir
    root = tmp_path / "deploy"
    (root / "releases").mkdir(parents=True)
    try:
        reply = reply_of(deploy_ctl(root, {"op": "releases"}, env=dict(os.environ, TMPDIR=str(tmp))))
        assert reply.get("audit_leftovers_removed") == ["servops-audit-killed"], reply
        assert held.wait(timeout=10) == -signal.SIGKILL
        assert not dead.exists() and (live / "owner").exists()
    finally:
        held.kill()
        held.wait()

