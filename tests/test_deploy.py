"""deploy / rollback end to end over real sshd, with the SGLang double as the server."""

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from servops.lab.sshd import free_port
from conftest import REPO, append_until_followed, playbooks_with, root_of, run_invoke, wait_for

NAME = "cuda-version-no-subprocess"


@pytest.fixture
def deploy_lab(lab):
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    yield lab, inv
    # never leave a server running: stop whatever the test started
    run_invoke("stop", "--grace", "2", inventory=inv)




def remote_programs(ssh_port: int) -> list[int]:
    """servops programs (`python -`) still running from an SSH session on this lab sshd."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if args[-2:] == [b"-", b""] and f" {ssh_port}\0".encode() in env.split(b"SSH_CONNECTION=", 1)[-1][:80] + b"\0":
            pids.append(int(pid))
    return pids


def port_of(inv: Path) -> int:
    import yaml
    return yaml.safe_load(inv.read_text())["all"]["children"]["lab"]["hosts"]["lab1"]["server_port"]


def current(lab) -> str:
    return os.readlink(root_of(lab) / "current").split("/")[-1]


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_model_info", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def test_render_prints_the_script_without_a_host(lab):
    inv = lab.inventory()
    res = run_invoke("render", "--variant", "piecewise", "-H", "lab1", inventory=inv)
    assert res.returncode == 0, res.stderr
    assert "-m sglang_double" in res.stdout and "--enable-piecewise-cuda-graph" in res.stdout
    assert "--tp-size 8" in res.stdout and "--model-path /models/GLM-5-NVFP4" in res.stdout
    assert "export CUDA_HOME=" in res.stdout
    bad = run_invoke("render", "--variant", "nope", "-H", "lab1", inventory=inv)
    assert bad.returncode == 2 and "unknown variant 'nope'" in bad.stderr and "baseline" in bad.stderr


def test_piecewise_unpatched_crashes_rolls_back_then_patched_is_healthy(deploy_lab, remote_env):
    lab, inv = deploy_lab
    port = port_of(inv)
    res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lab1 : changed - deployed" in res.stdout
    baseline = current(lab)
    assert baseline.endswith("-baseline") and health(port)["piecewise_cuda_graph"] is False

    res = run_invoke("deploy", "--variant", "piecewise", "--force", "--skip-patches", inventory=inv)
    assert res.returncode == 4  # failed, and servops restored the host
    assert "crashed: server.log: torch._dynamo.exc.Unsupported" in res.stderr  # the matched line, not its regex
    assert "Traceback (most recent call last)" in res.stderr  # the real traceback excerpt
    assert "is_cuda_version_at_least" in res.stderr
    # ... to its end: the last frame's code line and dynamo's closing line (issue 20.6)
    excerpt = res.stderr[res.stderr.index("--- server.log excerpt"):res.stderr.index("--- full log:")]
    assert excerpt.rstrip().splitlines()[-1].startswith("Set TORCHDYNAMO_VERBOSE=1"), excerpt[-600:]
    assert "self._waitpid_lock = threading.Lock()" in excerpt
    assert f"rolled back to {baseline}" in res.stderr
    assert current(lab) == baseline and health(port)["piecewise_cuda_graph"] is False
    failed = [r for r in (root_of(lab) / "releases").iterdir() if r.name.endswith("-piecewise")]
    assert json.loads((failed[0] / "release.json").read_text())["status"] == "failed"

    res = run_invoke("deploy", "--variant", "piecewise", "--force", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"patches: apply {NAME}" in res.stdout
    assert current(lab).endswith("-piecewise") and health(port)["piecewise_cuda_graph"] is True

    res = run_invoke("status", inventory=inv)
    assert res.returncode == 0 and "healthy" in res.stdout and NAME in res.stdout

    res = run_invoke("rollback", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert current(lab) == baseline and health(port)["piecewise_cuda_graph"] is False
    # baseline's patch set is empty: the flashinfer file is pristine again
    assert (remote_env["site"] / "flashinfer/jit/cpp_ext.py").read_bytes() == remote_env["pristine"]["flashinfer/jit/cpp_ext.py"]


def test_rollback_twice_and_releases_listing(deploy_lab):
    lab, inv = deploy_lab
    names = []
    for _ in range(3):
        res = run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv)
        assert res.returncode == 0, res.stdout + res.stderr
        names.append(current(lab))
    assert len(set(names)) == 3
    assert run_invoke("rollback", inventory=inv).returncode == 0 and current(lab) == names[1]
    assert run_invoke("rollback", inventory=inv).returncode == 0 and current(lab) == names[0]
    res = run_invoke("rollback", inventory=inv)
    assert res.returncode == 2 and "no healthy release before" in res.stderr
    res = run_invoke("rollback", "--to", names[2], inventory=inv)
    assert res.returncode == 0 and current(lab) == names[2]
    res = run_invoke("releases", inventory=inv)
    assert all(n in res.stdout for n in names) and "current" in res.stdout


def test_dry_run_changes_nothing_and_shows_the_script_diff(deploy_lab):
    lab, inv = deploy_lab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    before = sorted(p.name for p in (root_of(lab) / "releases").iterdir())
    res = run_invoke("deploy", "--variant", "piecewise", "--force", "--dry-run", "--diff", inventory=inv)
    assert res.returncode == 0, res.stderr
    assert "would deploy" in res.stdout and f"apply {NAME}" in res.stdout
    assert "+exec" in res.stdout and "--enable-piecewise-cuda-graph" in res.stdout
    assert "+def _query_cuda_version() -> Version:" in res.stdout
    assert sorted(p.name for p in (root_of(lab) / "releases").iterdir()) == before
    # --diff on a real deploy shows what it changed; rollback --check --diff what it would
    res = run_invoke("deploy", "--variant", "piecewise", "--force", "--diff", inventory=inv)
    assert res.returncode == 0, res.stderr
    assert "+def _query_cuda_version() -> Version:" in res.stdout and "+exec" in res.stdout
    res = run_invoke("rollback", "--check", "--diff", inventory=inv)
    assert res.returncode == 0 and "would roll back" in res.stdout
    assert "-def _query_cuda_version() -> Version:" in res.stdout
    assert current(lab).endswith("-piecewise")


def test_lock_held_refuses_second_deploy_and_break_lock(deploy_lab):
    lab, inv = deploy_lab
    root = root_of(lab)
    root.mkdir(parents=True, exist_ok=True)
    holder = {"id": "x1", "user": "alice", "controller": "other-laptop", "pid": 1, "action": "deploy baseline",
              "acquired_at": "2026-12-02T00:00:00Z"}
    (root / "deploy.lock").write_text(json.dumps(holder))
    res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
    assert res.returncode == 2 and "the deploy lock is held by alice@other-laptop pid 1" in res.stderr
    assert not (root / "releases").exists()
    res = run_invoke("deploy", "--variant", "baseline", "--force", "--break-lock", inventory=inv)
    assert res.returncode == 0, res.stderr
    assert "breaking the deploy lock held by alice@other-laptop" in res.stderr
    assert not (root / "deploy.lock").exists()


def test_never_healthy_times_out_and_rolls_back(deploy_lab, tmp_path):
    lab, inv = deploy_lab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    good = current(lab)
    books = playbooks_with(tmp_path, stuck="extends: baseline\nenv: {SGLANG_DOUBLE_NEVER_HEALTHY: '1'}\n"
                                          "health: {timeout: 3, interval: 0.5}\n")
    res = run_invoke("deploy", "--variant", "stuck", "--force", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)})
    assert res.returncode != 0
    assert "timeout: not healthy after 3s" in res.stdout + res.stderr
    assert f"rolled back to {good}" in res.stderr and current(lab) == good


def test_port_in_use_is_a_clear_error(deploy_lab):
    lab, inv = deploy_lab
    port = port_of(inv)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen()
        res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
    assert res.returncode == 2
    assert f"port {port} is already in use by a process servops did not start" in res.stderr
    assert not (root_of(lab) / "releases").exists()


def test_killed_mid_deploy_next_deploy_recovers(deploy_lab, tmp_path):
    lab, inv = deploy_lab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    good = current(lab)
    books = playbooks_with(tmp_path, slow="extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: '30'}\n")
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv), SERVOPS_PLAYBOOKS=str(books), NO_COLOR="1")
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--variant", "slow", "--force"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: [d for d in (root_of(lab) / "releases").glob("*-slow")  # its server started, its guard up
                      if (d / "server.log").exists() and (d / "guard.pid").exists()], what="the slow deploy in its gate")
    proc.send_signal(signal.SIGKILL)  # the operator's laptop dies: the SSH connection goes with it
    proc.wait()
    assert (root_of(lab) / "deploy.lock").exists()
    assert (root_of(lab) / "current").is_symlink()  # current is always a whole release
    res = run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "breaking the deploy lock" in res.stderr and "is gone" in res.stderr
    assert current(lab).endswith("-baseline") and current(lab) != good
    assert health(port_of(inv))["piecewise_cuda_graph"] is False


def test_logs_stop_and_status(deploy_lab):
    lab, inv = deploy_lab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    res = run_invoke("logs", "--lines", "3", inventory=inv)
    assert res.returncode == 0 and "Uvicorn running on" in res.stdout and len(res.stdout.splitlines()) <= 3
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv))
    follower = subprocess.Popen([sys.executable, "-m", "invoke", "logs", "-f", "--lines", "0"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, text=True)
    out = append_until_followed(follower, root_of(lab) / "current" / "server.log", "a line written while following")
    assert "a line written while following" in out
    # the follower's program on the host goes with its SSH session: nothing left tailing
    port = yaml.safe_load(inv.read_text())["all"]["children"]["lab"]["hosts"]["lab1"]["ssh_port"]
    wait_for(lambda: not remote_programs(port), what="the follower's host program ended")
    res = run_invoke("stop", "--dry-run", inventory=inv)
    assert res.returncode == 0 and "would stop pid" in res.stdout
    assert health(port_of(inv)) is not None
    res = run_invoke("stop", inventory=inv)
    assert res.returncode == 0 and "stopped pid" in res.stdout and "(SIGTERM)" in res.stdout
    assert health(port_of(inv)) is None
    res = run_invoke("status", inventory=inv)
    assert res.returncode == 0 and "down" in res.stdout
    res = run_invoke("stop", inventory=inv)
    assert "ok - no server running" in res.stdout
