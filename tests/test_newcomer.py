"""Issue 12: a newcomer's first hour. The lab as a product feature, one host-selection convention,
a recap for every verb, render == deploy, Ctrl-C, readable progress, clear one-line failures."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import HOME_LEFTOVERS, LOADED, REPO, newcomer_home, playbooks_with, run_invoke
from servops.lab.sshd import free_port
from servops.progress import cut_words
from test_cli_help import task_names


def listening(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((address, port)) == 0


@pytest.fixture
def own_lab(tmp_path):
    """inventory/lab.yml as shipped, on free ports, with HOME (and so ~/.servops-lab) in a tmp dir."""
    lab = yaml.safe_load((REPO / "inventory" / "lab.yml").read_text())
    hosts = lab["all"]["children"]["lab"]["hosts"]
    for vars_ in hosts.values():
        vars_["ssh_port"] = free_port()
        vars_["server_port"] = free_port()
    inv = tmp_path / "lab.yml"
    inv.write_text(yaml.safe_dump(lab, sort_keys=False))
    _home, env = newcomer_home(tmp_path)
    yield inv, env, hosts
    run_invoke("lab.down", inventory=inv, env=env)


@pytest.mark.lab_home
def test_lab_up_down_twenty_cycles_with_four_hosts(own_lab):
    inv, env, hosts = own_lab
    addrs = [(v["ssh_host"], v["ssh_port"]) for v in hosts.values()]
    for cycle in range(20):
        res = run_invoke("lab.up", inventory=inv, env=env)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
        assert all(listening(*a) for a in addrs), cycle
        if cycle == 0:  # the lab answers as an inventory host should: key-checked SSH
            ok = run_invoke("inspect", "--file", "flashinfer/jit/cpp_ext.py", "--lines", "1", "-H", "lab2",
                            inventory=inv, env=env)
            assert ok.returncode == 0, ok.stdout + ok.stderr
        res = run_invoke("lab.down", inventory=inv, env=env)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
        assert not any(listening(*a) for a in addrs), cycle
    res = run_invoke("lab.down", inventory=inv, env=env)  # idempotent
    assert res.returncode == 0 and res.stdout.count("nothing running") == 4


@pytest.mark.lab_home
def test_lab_down_stops_the_lab_servers_too(own_lab):
    inv, env, hosts = own_lab
    assert run_invoke("lab.up", "-H", "lab1", inventory=inv, env=env).returncode == 0
    res = run_invoke("deploy", "--variant", "baseline", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert listening("127.0.0.1", hosts["lab1"]["server_port"])
    res = run_invoke("lab.down", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 0 and "stopped lab1 pid" in res.stdout
    assert not listening("127.0.0.1", hosts["lab1"]["server_port"])
    assert not listening(hosts["lab1"]["ssh_host"], hosts["lab1"]["ssh_port"])


@pytest.mark.lab_home
def test_an_unreachable_lab_host_says_how_to_start_the_lab(own_lab):
    inv, env, _hosts = own_lab
    res = run_invoke("deploy", "--variant", "baseline", "-H", "lab3", inventory=inv, env=env)
    assert res.returncode == 2 and "is the lab up? invoke lab.up -H lab3" in res.stderr


def test_render_prints_byte_for_byte_what_deploy_writes(lab, tmp_path):
    """Even with a home-relative venv and deploy root (~ resolves on the host, not in quotes)."""
    port = free_port()
    home_venv = Path.home() / f"{HOME_LEFTOVERS}render-{os.getpid()}"  # (a killed run's: the next run removes it)
    home_venv.symlink_to(lab.venv)
    try:
        inv = lab.inventory(host_vars={"lab1": {"server_port": port, "venv": f"~/{home_venv.name}",
                                                "deploy_root": f"~/{home_venv.name}-deploy"}})
        for variant in ("baseline", "piecewise"):
            rendered = run_invoke("render", "--variant", variant, inventory=inv)
            assert rendered.returncode == 0, rendered.stderr
            assert "'~" not in rendered.stdout  # a quoted tilde would never expand
            res = run_invoke("deploy", "--variant", variant, inventory=inv)
            assert res.returncode == 0, res.stdout + res.stderr
            root = Path.home() / f"{home_venv.name}-deploy"
            deployed = (root / "current" / "launch.sh").read_bytes()
            assert rendered.stdout.encode() == deployed
    finally:
        run_invoke("stop", "--grace", "2", inventory=inv)
        home_venv.unlink()
        subprocess.run(["rm", "-rf", str(Path.home() / f"{home_venv.name}-deploy")])


def test_every_verb_takes_H_and_I_with_the_same_help():
    """One --inventory text; one --hosts text for read-only verbs and one for the verbs that
    change hosts (issue 19: those require -H), and exactly those verbs say so."""
    names, _ = task_names()
    texts, changing = {}, set()
    for name in names:
        out = run_invoke("--help", name).stdout
        assert "-H STRING, --hosts=STRING" in out and "-I STRING, --inventory=STRING" in out, name
        for flag in ("--hosts", "--inventory"):
            m = re.search(rf"{flag}=STRING\s+(.*?)(?=\n  -|\n\n|\Z)", out, re.S)
            text = " ".join(m.group(1).split())
            texts.setdefault(flag, set()).add(text)
            if flag == "--hosts" and "required (this verb changes hosts)" in text:
                changing.add(name)
    assert len(texts["--hosts"]) == 2 and len(texts["--inventory"]) == 1, texts
    assert changing == {"deploy", "rollback", "start", "restart", "stop", "patch.apply", "patch.revert", "tune.run",
                        "run"}, changing


def test_float_flags_show_their_type():
    out = run_invoke("--help", "stop").stdout
    assert "--grace=FLOAT" in out
    out = run_invoke("--help", "deploy").stdout
    assert "--max-fail-percentage=FLOAT" in out and "--serial=INT" in out


def test_every_verb_ends_with_the_recap(lab):
    inv = lab.inventory()
    for args in (["releases"], ["render", "--variant", "baseline"], ["inspect", "--file", "flashinfer/jit/env.py",
                                                                      "--lines", "1"], ["history"]):
        res = run_invoke(*args, inventory=inv, merged=True)
        assert res.returncode == 0, res.stdout
        assert re.search(r"^lab1 : ok", res.stdout, re.M), (args, res.stdout[-300:])


def test_ctrl_c_during_a_deploy_rolls_back_and_says_so(lab, tmp_path):
    port = free_port()
    inv = lab.inventory(host_vars={"lab1": {"server_port": port}})
    books = playbooks_with(tmp_path, slow="extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: '30'}\n")
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv), SERVOPS_PLAYBOOKS=str(books), NO_COLOR="1")
    try:
        assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
        root = lab.tmp / "deploy-lab1"
        good = os.readlink(root / "current").split("/")[-1]
        # Ctrl-C as a terminal delivers it (a background CI job inherits SIGINT ignored)
        proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--variant", "slow", "--force"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        out = ""
        deadline = time.time() + LOADED
        while time.time() < deadline and "health" not in out:
            out += proc.stdout.readline()
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        out += rest
        assert proc.returncode == 130, out
        assert "Ctrl-C during health" in out and f"rolled back to {good}" in out
        assert os.readlink(root / "current").split("/")[-1] == good
        slow = next(p for p in (root / "releases").iterdir() if p.name.endswith("-slow"))
        assert json.loads((slow / "release.json").read_text())["status"] == "interrupted"
        assert not (root / "deploy.lock").exists()
    finally:
        run_invoke("stop", "--grace", "2", "--break-lock", inventory=inv)


def test_deploy_prints_a_phase_line_per_step_and_a_summary(lab):
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    try:
        res = run_invoke("deploy", "--variant", "piecewise", inventory=inv)
        assert res.returncode == 0, res.stdout + res.stderr
        phases = re.findall(r"^lab1  \[\s*[\d.]+s\] (\w+)", res.stdout, re.M)
        assert phases[:2] == ["preflight", "preflight"] and {"upload", "patches", "start", "health", "done"} <= set(phases)
        # a compiled variant's region is audited before anything on the host changes (the lock)
        assert set(phases[2:phases.index("lock")]) == {"audit"}, phases
        assert "stop" not in phases  # nothing ran on that port: no "stopping the server" line (issue 19 #7)
        res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
        assert res.returncode == 0, res.stdout + res.stderr
        phases = re.findall(r"^lab1  \[\s*[\d.]+s\] (\w+)", res.stdout, re.M)
        assert {"upload", "patches", "stop", "start", "health", "done"} <= set(phases), phases
        assert re.search(r"^lab1 : changed - deployed \S+-baseline .*invoke rollback goes back to \S+-piecewise$",
                         res.stdout, re.M), res.stdout
    finally:
        run_invoke("stop", "--grace", "2", inventory=inv)


def test_cut_words_cuts_at_a_word_boundary():
    line = "Load weight begin. avail mem=79.12 GB, model loading takes a while on eight GPUs"
    assert cut_words(line, 40) == "Load weight begin. avail mem=79.12 GB,…"
    assert cut_words("short", 40) == "short"
    assert cut_words("a" * 100, 10) == "a" * 9 + "…"


def test_invoke_from_a_subdirectory_and_without_servops(tmp_path):
    invoke = str(Path(sys.executable).parent / "invoke")  # the command the README's venv puts on PATH
    for sub in ("servops", "tests", "inventory"):
        res = subprocess.run([invoke, "--list"], cwd=REPO / sub, capture_output=True, text=True)
        assert res.returncode == 0 and "deploy" in res.stdout, (sub, res.stderr)
    # a python that has invoke but not servops' dependencies (pyyaml shadowed by a broken one):
    # one line saying what to run, not a traceback
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "yaml.py").write_text("raise ImportError('No module named yaml')\n")
    res = subprocess.run([sys.executable, "-m", "invoke", "--list"], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(shadow)))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().startswith("error: servops cannot load") and len(res.stderr.strip().splitlines()) == 1


def test_status_piped_never_cuts_a_release_name(lab, tmp_path):
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    name = "a-variant-with-a-rather-long-name-as-tuning-trials-get"
    books = playbooks_with(tmp_path, **{name: "extends: baseline\n"})
    env = {"SERVOPS_PLAYBOOKS": str(books), "COLUMNS": "60"}  # a narrow terminal width, but piped
    try:
        assert run_invoke("deploy", "--variant", name, inventory=inv, env=env).returncode == 0
        res = run_invoke("status", inventory=inv, env=env)
        release = os.readlink(lab.tmp / "deploy-lab1" / "current").split("/")[-1]
        assert res.returncode == 0 and any(release in line for line in res.stdout.splitlines()), res.stdout
    finally:
        run_invoke("stop", "--grace", "2", inventory=inv)
