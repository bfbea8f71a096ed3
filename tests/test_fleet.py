"""Fleet runs over four real sshd hosts on 127.0.0.2-5."""

import os
import re

import pytest

from servops.lab.sshd import free_port
from conftest import playbooks_with, run_invoke




@pytest.fixture
def fleet(lab):
    made = []

    def make(broken: str | None = None):
        host_vars = {f"lab{i}": {"server_port": free_port()} for i in range(1, 5)}
        if broken:
            host_vars[broken]["venv"] = "/nonexistent/venv"
        inv = lab.inventory(n_hosts=4, host_vars=host_vars)
        made.append(inv)
        return inv

    yield lab, make
    for inv in made:
        run_invoke("stop", "--grace", "2", inventory=inv)


def current(lab, host):
    link = lab.tmp / f"deploy-{host}" / "current"
    return os.readlink(link).split("/")[-1] if link.is_symlink() else None


def test_parallel_deploy_with_one_broken_host(fleet):
    lab, make = fleet
    inv = make(broken="lab3")
    res = run_invoke("deploy", "--variant", "baseline", "-H", "lab", inventory=inv, merged=True)
    assert res.returncode == 2
    recap = [l for l in res.stdout.splitlines() if re.match(r"lab\d : ", l)]
    assert [l.split(" : ")[0] for l in recap] == ["lab1", "lab2", "lab3", "lab4"]
    assert "lab3 : failed" in res.stdout and "cannot run remote python /nonexistent/venv/bin/python" in res.stdout
    assert res.stdout.count("cannot run remote python") == 1  # each host's error is printed once
    for host in ("lab1", "lab2", "lab4"):
        assert f"{host} : changed - deployed" in res.stdout
        assert current(lab, host).endswith("-baseline")
    assert current(lab, "lab3") is None
    # every read-only verb fans out too
    res = run_invoke("status", "-H", "lab", inventory=inv)
    assert res.returncode == 2 and len(re.findall(r"│\s*healthy\s*│", res.stdout)) == 3, res.stdout


def test_serial_stops_on_the_first_failed_batch(fleet):
    lab, make = fleet
    inv = make(broken="lab2")
    res = run_invoke("deploy", "--variant", "baseline", "-H", "lab", "--serial", "1", inventory=inv)
    assert res.returncode == 2
    assert "lab1 : changed - deployed" in res.stdout and "lab2 : failed" in res.stderr
    assert "lab3 : skipped - not started: an earlier batch failed" in res.stdout
    assert "lab4 : skipped" in res.stdout
    assert current(lab, "lab1") and current(lab, "lab3") is None and current(lab, "lab4") is None


def test_serial_batches_tolerate_failures_within_max_fail_percentage(fleet):
    lab, make = fleet
    inv = make(broken="lab1")
    res = run_invoke("deploy", "--variant", "baseline", "-H", "lab", "--serial", "2",
                     "--max-fail-percentage", "50", inventory=inv)
    assert res.returncode == 2
    assert "lab1 : failed" in res.stderr
    for host in ("lab2", "lab3", "lab4"):
        assert f"{host} : changed - deployed" in res.stdout


def test_multi_node_variant_renders_per_node_and_gates_on_rank0(fleet, tmp_path):
    lab, make = fleet
    inv = make()
    books = playbooks_with(tmp_path, tp16="extends: baseline\nnnodes: 2\nserver_args: {tp: 16}\n")
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    bad = run_invoke("deploy", "--variant", "tp16", "-H", "lab1,lab2,lab3", inventory=inv, env=env)
    assert bad.returncode == 2 and "select a multiple of 2 hosts (got 3)" in bad.stderr
    res = run_invoke("deploy", "--variant", "tp16", "--force", "-H", "lab1,lab2", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lab1 : changed - deployed" in res.stdout and "on 2 nodes" in res.stdout
    scripts = {h: (lab.tmp / f"deploy-{h}" / "current" / "launch.sh").read_text() for h in ("lab1", "lab2")}
    rank0 = lab.sshd_hosts(0).address  # the first node's address (127.0.0.2 without xdist)
    for rank, host in enumerate(("lab1", "lab2")):
        assert f"--nnodes 2 --node-rank {rank} --dist-init-addr {rank0}:5000" in scripts[host]
        assert "--tp 16" in scripts[host]
        log = (lab.tmp / f"deploy-{host}" / "current" / "server.log").read_text()
        assert f"node_rank={rank}/2" in log
