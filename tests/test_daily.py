"""Issue 19: safe and efficient by default in daily operation, over the real sshd lab: no pointless
restarts, no accidental fleet-wide change, nothing the operator relies on thrown away, an exit
status a script can rely on, the CLI's own mistakes as one clear line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from conftest import (REPO, current, healthy, newcomer_home, one_line_error, playbooks_with, root_of, run_invoke,
                      server_pid, wait_for)
from servops.lab import venvs
from servops.lab.sshd import free_port

NO_HOSTS = {"SERVOPS_HOSTS": ""}  # as a user's shell: no default host selection


def release_names(lab) -> list[str]:
    d = root_of(lab) / "releases"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# ---- 1. idempotent deploy --------------------------------------------------------------------

def test_1_a_redeploy_of_the_current_variant_restarts_nothing(alab, tmp_path):
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    first, pid, names = current(lab), server_pid(lab), release_names(lab)
    res = run_invoke("deploy", "--variant", "baseline", "--dry-run", "--diff", inventory=inv)
    assert res.returncode == 0 and f"lab1 : ok - no change (current: {first})" in res.stdout, res.stdout
    res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"lab1 : ok - unchanged (current: {first})" in res.stdout
    assert "stop" not in res.stdout.split("lab1 :")[0]  # no stop phase was printed
    assert server_pid(lab) == pid and release_names(lab) == names and healthy(port)
    # a changed env is a change
    books = playbooks_with(tmp_path, tweaked="extends: baseline\nenv: {SGLANG_DOUBLE_TTFT: '0.001'}\n")
    res = run_invoke("deploy", "--variant", "tweaked", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)})
    assert res.returncode == 0 and "changed - deployed" in res.stdout and server_pid(lab) != pid
    # --force restarts the same thing anyway
    pid = server_pid(lab)
    res = run_invoke("deploy", "--variant", "tweaked", "--force", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)})
    assert res.returncode == 0 and "changed - deployed" in res.stdout and server_pid(lab) != pid


def test_1_a_down_server_is_not_unchanged(alab):
    """Same files but the server is not running: deploy brings it up (a new release)."""
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    assert run_invoke("stop", "--grace", "2", inventory=inv).returncode == 0
    res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
    assert res.returncode == 0 and "changed - deployed" in res.stdout and healthy(port)


def test_1_in_a_fleet_each_host_decides_alone(lab):
    p1, p2 = free_port(), free_port()
    inv = lab.inventory(n_hosts=2, host_vars={"lab1": {"server_port": p1}, "lab2": {"server_port": p2}})
    try:
        assert run_invoke("deploy", "--variant", "baseline", "-H", "lab1", inventory=inv).returncode == 0
        res = run_invoke("deploy", "--variant", "baseline", "-H", "lab1,lab2", inventory=inv)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "lab1 : ok - unchanged" in res.stdout and "lab2 : changed - deployed" in res.stdout
    finally:
        run_invoke("stop", "--grace", "2", "--break-lock", "-H", "all", inventory=inv)


# ---- 2. start, restart, run; status says down -------------------------------------------------

def test_2_start_after_stop_and_status_says_down(alab):
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    rel, names = current(lab), release_names(lab)
    assert run_invoke("stop", "--grace", "2", inventory=inv).returncode == 0
    res = run_invoke("status", inventory=inv)
    assert res.returncode == 0 and f"server down: the current release {rel} is not serving; invoke start -H lab1" \
        in res.stdout + res.stderr, res.stdout
    res = run_invoke("status", "--check", inventory=inv)
    assert res.returncode == 1 and "lab1 : failed - server down" in res.stderr
    res = run_invoke("start", "--dry-run", inventory=inv)
    assert res.returncode == 0 and f"would start {rel}" in res.stdout and not healthy(port)
    res = run_invoke("start", inventory=inv)
    assert res.returncode == 0 and f"started {rel}" in res.stdout, res.stdout + res.stderr
    assert healthy(port) and current(lab) == rel and release_names(lab) == names  # no new release
    res = run_invoke("start", inventory=inv)
    assert res.returncode == 0 and "already running" in res.stdout
    assert run_invoke("status", "--check", inventory=inv).returncode == 0
    entries = [json.loads(l) for l in (root_of(lab) / "journal.jsonl").read_text().splitlines() if l.strip()]
    assert any(e.get("action") == "start" and e.get("outcome") == "healthy" for e in entries)


def test_2_restart_keeps_the_release_and_a_crash_rolls_back(alab):
    """restart: a new server of the same release. A release whose server file has since vanished
    from the host is refused; run as it is (--allow-drift) it crashes: rolled back to the previous
    healthy release (exit 4)."""
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    good = current(lab)
    assert run_invoke("deploy", "--variant", "piecewise", inventory=inv).returncode == 0
    rel, pid = current(lab), server_pid(lab)
    res = run_invoke("restart", inventory=inv)
    assert res.returncode == 0 and f"restarted {rel}" in res.stdout, res.stdout + res.stderr
    assert current(lab) == rel and server_pid(lab) != pid and healthy(port)
    (root_of(lab) / "releases" / rel / "sglang_double.py").unlink()
    res = run_invoke("restart", inventory=inv)  # a release that drifted is refused, the server left serving
    assert res.returncode == 2 and "sglang_double.py is gone" in res.stderr, res.stdout + res.stderr
    assert current(lab) == rel and healthy(port)
    res = run_invoke("restart", "--allow-drift", inventory=inv)  # run as it is: it crashes, and goes back
    assert res.returncode == 4, res.stdout + res.stderr
    assert f"rolled back to {good}" in res.stderr and current(lab) == good and healthy(port)


def test_2_a_failed_deploy_goes_back_to_the_release_that_ran_not_the_newest_healthy_one(alab, tmp_path):
    """baseline, then piecewise, then `rollback` (baseline runs again); a deploy that never gets
    healthy goes back to baseline, the release it found running, not to the newer piecewise."""
    lab, inv, port = alab
    books = playbooks_with(tmp_path, sick="extends: baseline\nenv: {SGLANG_DOUBLE_NEVER_HEALTHY: '1'}\n"
                                           "health: {timeout: 4}\n")
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv, env=env).returncode == 0
    first = current(lab)
    assert run_invoke("deploy", "--variant", "piecewise", inventory=inv, env=env).returncode == 0
    newer = current(lab)
    assert run_invoke("rollback", inventory=inv, env=env).returncode == 0 and current(lab) == first
    res = run_invoke("deploy", "--variant", "sick", inventory=inv, env=env, timeout=300)
    assert res.returncode == 4, res.stdout + res.stderr
    assert f"rolled back to {first}" in res.stderr and newer not in res.stderr.split("rolled back to")[-1]
    assert current(lab) == first and healthy(port)


def test_2_run_an_ad_hoc_command_per_host(lab):
    inv = lab.inventory(n_hosts=2)
    res = run_invoke("run", "echo hello from $(hostname); exit 0", "-H", "all", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("hello from") == 2 and "---- lab1: exit 0 ----" in res.stdout
    assert "lab1 : ok - exit 0" in res.stdout and "lab2 : ok - exit 0" in res.stdout
    res = run_invoke("run", "echo oops >&2; exit 7", "-H", "lab2", inventory=inv)
    assert res.returncode == 1 and "lab2 : failed - exit 7" in res.stderr and "oops" in res.stderr
    res = run_invoke("run", "sleep 30", "-H", "lab1", "--timeout", "1", inventory=inv)
    assert res.returncode != 0 and "timed out after 1s" in res.stderr


# ---- 3. no implicit "all hosts" for verbs that change hosts ------------------------------------

@pytest.mark.parametrize("verb", [["deploy", "--variant", "baseline"], ["rollback"], ["start"], ["restart"],
                                  ["stop"], ["patch.apply", "cuda-version-no-subprocess"],
                                  ["patch.revert", "cuda-version-no-subprocess"], ["tune", "lab"], ["run", "true"]])
def test_3_changing_verbs_need_hosts(lab, verb):
    inv = lab.inventory(n_hosts=2)
    res = run_invoke(*verb, inventory=inv, env=NO_HOSTS)
    one_line_error(res, "changes hosts: name them with -H", "lab1, lab2")
    assert not (lab.tmp / "deploy-lab1").exists() and not (lab.tmp / "deploy-lab2").exists()


def test_3_read_only_verbs_keep_the_all_default_and_local_verbs_name_hosts_without_data(lab):
    inv = lab.inventory(n_hosts=2)
    res = run_invoke("status", inventory=inv, env=NO_HOSTS)
    assert res.returncode == 0 and "lab1" in res.stdout and "lab2" in res.stdout
    res = run_invoke("compare", "baseline", "piecewise", inventory=inv, env=NO_HOSTS)
    # no host has data: nothing to compare anywhere, so it fails, naming each host's missing bench
    assert res.returncode == 2 and all(f"{h} : failed - no saved bench" in res.stdout + res.stderr
                                       for h in ("lab1", "lab2"))
    res = run_invoke("compare", "baseline", "piecewise", "-H", "lab1", inventory=inv, env=NO_HOSTS)
    assert res.returncode == 2 and "lab1 : failed - no saved bench" in res.stderr


# ---- 4. releases the operator relies on are never pruned ----------------------------------------

def test_4_pinned_current_and_previous_releases_survive_pruning(alab):
    lab, _inv, port = alab
    inv = lab.inventory(host_vars={"lab1": {"server_port": port, "keep_releases": 1}}, filename="keep1.yml")
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    pinned = current(lab)
    res = run_invoke("releases", "--pin", pinned, "--why", "the one that worked", inventory=inv)
    assert res.returncode == 0 and f"pinned {pinned}: the one that worked" in res.stdout
    for _ in range(3):
        assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    names = release_names(lab)
    assert pinned in names and current(lab) in names and len(names) == 3  # pinned, previous healthy, current
    listing = run_invoke("releases", inventory=inv).stdout
    assert "the one that worked" in listing and "previous healthy" in listing and "current" in listing
    assert run_invoke("releases", "--unpin", pinned, inventory=inv).returncode == 0
    assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    assert pinned not in release_names(lab)
    res = run_invoke("releases", "--pin", "20990101T000000Z-nothing", inventory=inv)
    assert res.returncode == 2 and "no release 20990101T000000Z-nothing" in res.stderr


def test_4_a_campaign_never_prunes_the_release_it_started_from_nor_its_base_and_best(alab, tmp_path):
    lab, _inv, port = alab
    inv = lab.inventory(host_vars={"lab1": {"server_port": port, "keep_releases": 1}}, filename="keep1.yml")
    assert run_invoke("deploy", "--variant", "piecewise", inventory=inv).returncode == 0
    before = current(lab)
    camp = tmp_path / "small.yml"
    camp.write_text(yaml.safe_dump({
        "base": "baseline", "overrides": {"env": {"SGLANG_DOUBLE_TOKEN_DELAY": "0.002"}},
        "candidates": [{"name": "g", "grid": {"server_args": {"cuda-graph-max-bs": [8, 16, 32]}}}],
        "bench": {"levels": [1, 4], "requests": 8, "input_len": 8, "output_len": 8},
        "objective": {"maximize": "output_tps@4"}, "budget": {"max_trials": 10}, "leave": "best"}))
    env = {"SERVOPS_RESULTS": str(tmp_path / "results")}
    res = run_invoke("tune", str(camp), inventory=inv, env=env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    trials = [json.loads(l) for l in (tmp_path / "results/lab1/campaigns/small/trials.jsonl").read_text().splitlines()]
    done = {e["trial"]: e for e in trials if e.get("phase") == "done"}
    names = release_names(lab)
    assert before in names, "the release current when the campaign started was pruned"
    assert done["base"]["release"] in names, "the campaign's base was pruned"
    pins = json.loads((root_of(lab) / "pins.json").read_text())
    assert any("campaign small: best" in why for why in sum(pins.values(), []))
    best = next(n for n, why in pins.items() if "campaign small: best" in why)
    assert best in names and current(lab) == best  # leave: best switched back to the existing release
    leave = [e for e in trials if e.get("phase") == "leave"][0]
    assert leave["release"] == best
    # resuming the finished campaign says what is deployed now; nothing runs
    res = run_invoke("tune", str(camp), "--resume", inventory=inv, env=env)
    assert res.returncode == 0 and "lab1 : ok - campaign finished earlier" in res.stdout
    assert f"deployed now: {best}" in res.stdout


# ---- 5. the exit-status contract ----------------------------------------------------------------

def test_5_each_exit_status_comes_from_a_real_scenario(alab, tmp_path, sshd_hosts):
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0           # 0
    assert run_invoke("deploy", "--variant", "nope", inventory=inv).returncode == 2             # bad input
    res = run_invoke("deploy", "--variant", "piecewise", "--skip-patches", inventory=inv)
    assert res.returncode == 4 and "rolled back to" in res.stderr                              # restored
    res = run_invoke("deploy", "--variant", "piecewise", "--skip-patches", "--no-rollback", inventory=inv)
    assert res.returncode == 5 and "left as is" in res.stderr                                  # not as before
    assert run_invoke("rollback", inventory=inv).returncode == 0
    clean = tmp_path / "clean.log"
    clean.write_text("INFO server started\nINFO all good\n")
    assert run_invoke("diagnose", "--log", str(clean), "--offline", inventory=inv).returncode == 0
    dead = lab.inventory(host_vars={"lab1": {"ssh_port": free_port(), "connect_timeout": 2}}, filename="dead.yml")
    res = run_invoke("status", inventory=dead)
    assert res.returncode == 3, res.stdout + res.stderr                                        # unreachable
    books = playbooks_with(tmp_path, slow="extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: '30'}\n")
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--variant", "slow", "-H", "lab1"], cwd=REPO,
                            env=dict(os.environ, SERVOPS_INVENTORY=str(inv), SERVOPS_PLAYBOOKS=str(books)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: (current(lab) or "").endswith("-slow"), what="the slow release current")
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out                                                         # interrupted


# ---- 6. the CLI's own mistakes -----------------------------------------------------------------

@pytest.mark.parametrize("argv, needles", [
    (["deploy", "--varient", "baseline"], ["deploy has no flag --varient; did you mean --variant?"]),
    (["bench", "--level", "1"], ["bench has no flag --level; did you mean --levels?"]),
    (["status", "-h", "lab1"], ["-h is --help; hosts are -H: did you mean -H lab1?"]),
    (["patch.apply"], ["patch.apply needs --name"]),
    (["deplyo"], ["no verb 'deplyo'; did you mean deploy?"]),
    (["deploy", "--variant"], ["--variant needs a value"]),
    (["deploy", "--variant", "basline", "-H", "lab1"], ["unknown variant 'basline'; did you mean baseline?"]),
    (["tune", "lba", "-H", "lab1"], ["did you mean lab?"]),
    (["patch.apply", "cuda-version-no-subproces", "-H", "lab1"], ["did you mean cuda-version-no-subprocess?"]),
    (["status", "-H", "lab11"], ["no host or group named 'lab11'; did you mean lab1?"]),
])
def test_6_cli_mistakes_are_one_line_with_the_closest_spelling(lab, argv, needles):
    one_line_error(run_invoke(*argv, inventory=lab.inventory()), *needles)


def test_6_an_unknown_symbol_suggests_the_closest_one(lab):
    res = run_invoke("inspect", "--file", "flashinfer/jit/cpp_ext.py", "--symbol", "get_cuda_versoin",
                     inventory=lab.inventory())
    assert res.returncode == 2 and "did you mean get_cuda_version?" in res.stderr, res.stderr


# ---- 7. only true statements, once ---------------------------------------------------------------

def test_7_a_first_deploy_says_only_what_happened(alab):
    lab, inv, _port = alab
    res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
    out = res.stdout + res.stderr
    assert "stopping" not in out and "(none)" not in out and "None" not in out, out
    assert out.count("deployed 2") == 1  # the outcome once: the recap's line
    res = run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv)
    out = res.stdout + res.stderr
    assert "stopping pid" in out and "invoke rollback goes back to" in out and "lab1 lab1" not in out


# ---- 8. the lab is per checkout and checks for real ------------------------------------------

@pytest.mark.lab_home
def test_8_another_checkouts_lab_is_refused_and_the_lab_checks_with_a_real_sglang(tmp_path):
    lab = yaml.safe_load((REPO / "inventory" / "lab.yml").read_text())
    hosts = lab["all"]["children"]["lab"]["hosts"]
    for name in list(hosts)[1:]:
        del hosts[name]
    hosts["lab1"].update(ssh_port=free_port(), server_port=free_port())
    inv = tmp_path / "lab.yml"
    inv.write_text(yaml.safe_dump(lab, sort_keys=False))
    _home, env = newcomer_home(tmp_path)
    other = tmp_path / "other-checkout"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(other)], cwd=REPO, check=True)
    try:
        assert run_invoke("lab.up", inventory=inv, env=env, timeout=1200).returncode == 0
        res = subprocess.run([sys.executable, "-m", "invoke", "lab.down", "-I", str(inv)], cwd=other, text=True,
                             capture_output=True, env=dict(os.environ, **env))
        assert res.returncode == 2 and f"is up from another checkout, {REPO}" in res.stderr, res.stderr
        books = playbooks_with(tmp_path, typo="extends: baseline\nserver_args: {cuda-graph-max-bz: 8}\n")
        res = run_invoke("check", "--variant", "typo", "-H", "lab1", inventory=inv,
                         env=dict(env, SERVOPS_PLAYBOOKS=str(books)))
        assert res.returncode == 2, res.stdout + res.stderr
        assert "--cuda-graph-max-bz: unrecognized on sglang 0.5.21" in res.stdout + res.stderr
        res = run_invoke("check", "--variant", "baseline", "-H", "lab1", inventory=inv, env=env)
        assert res.returncode == 0 and "launch ok on sglang 0.5.21 (sglang's parser" in res.stdout + res.stderr
    finally:
        run_invoke("lab.down", inventory=inv, env=env)
        subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=REPO)


# ---- 9. who did it ----------------------------------------------------------------------------

def test_9_the_journal_names_the_operator(alab):
    lab, inv, _port = alab
    res = run_invoke("deploy", "--variant", "baseline", inventory=inv, env={"SERVOPS_OPERATOR": "alice@example.org"})
    assert res.returncode == 0
    res = run_invoke("history", inventory=inv)
    assert "alice@example.org" in res.stdout
    git_email = subprocess.run(["git", "config", "user.email"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    res = run_invoke("stop", "--grace", "2", inventory=inv, env={"SERVOPS_OPERATOR": ""})
    who = [json.loads(l).get("who") for l in (root_of(lab) / "journal.jsonl").read_text().splitlines() if l.strip()][-1]
    assert who == (git_email or who) and "@" in who


# ---- 10. drift checks where the files are -----------------------------------------------------

def test_10_console_scripts_outside_site_packages_are_not_drift(lab, tmp_path):
    """A `pip --target` install (the GPU kit's layout): RECORD's console scripts point outside
    site-packages and are absent; every library file matches. Reported apart, not as drift."""
    venv = tmp_path / "tvenv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = venvs.site_packages(venv)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    "tqdm"], check=True, capture_output=True)
    record = next(site.glob("tqdm-*.dist-info")) / "RECORD"
    assert "../../bin/tqdm," in record.read_text()  # pip --target: the script went to site-packages/bin
    inv = lab.inventory(group_vars={"venv": str(venv)})
    res = run_invoke("inspect", "--verify", "tqdm", inventory=inv)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "1 console script(s) not installed here (tqdm)" in out, out
    assert "files match RECORD" in out and "differ" not in out, out
