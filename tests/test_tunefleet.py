"""invoke tune CAMPAIGN -H lab1,lab2,...: one campaign over several alike lab hosts at once (issue
#23.4). The pure parts first (hosts alike, the fleet's standings), then real sshd labs: a 4-host
TPE campaign where one host's sshd is stopped mid-campaign (its trial failed, the rest finish,
the winner left on the others, the report's host column), unlike hosts refused before anything
changes, and a SIGKILLed fleet campaign resumed without losing or repeating a trial."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, one_line_error, playbooks_with, run_invoke
from servops import campaignrecord, hostfacts, tunefleet, verdict
from servops.campaign import load_campaign
from servops.lab.sshd import free_port, make_server
from servops.remote import procs
from test_tune import SEARCH_CAMPAIGN, TBASE

# -- pure ---------------------------------------------------------------------------------------

FACTS = {"gpus": "8 x NVIDIA H200", "engine": "sglang", "engine_version": "0.5.23", "model_path": "/models/m",
         "model": "dir LlamaForCausalLM", "python": "3.12.3", "patches": "none", "server_module": "sglang.launch_server"}


def test_alike_hosts_have_no_differences_and_unlike_ones_are_named():
    same = {h: dict(FACTS) for h in ("gpu1", "gpu2", "gpu3")}
    assert hostfacts.differences(same) == []
    odd = dict(same, gpu2=dict(FACTS, engine_version="0.5.24"), gpu3=dict(FACTS, gpus="4 x NVIDIA H200"))
    diffs = hostfacts.differences(odd)
    assert [k for k, _v in diffs] == ["gpus", "engine_version"]
    line = hostfacts.refusal(diffs)
    assert "GPUs (gpu3: 4 x NVIDIA H200; gpu1, gpu2: 8 x NVIDIA H200)" in line
    assert "engine version (gpu2: 0.5.24; gpu1, gpu3: 0.5.23)" in line and "nothing was changed" in line


def test_a_host_programs_reply_flattens_to_comparable_text():
    raw = {"gpu": {"count": 2, "names": ["GPU 0: NVIDIA H200 (UUID: GPU-a)", "GPU 1: NVIDIA H200 (UUID: GPU-b)"]},
           "engine": {"dist": "sglang", "version": "0.5.23"}, "python": "3.12.3", "patches": ["p1 0.7.2"],
           "model": {"path": "/m", "state": "dir", "config": True, "architectures": ["X"]}}
    f = hostfacts.flatten(raw, "/m", "sglang.launch_server")
    assert f == {"gpus": "2 x NVIDIA H200", "engine": "sglang", "engine_version": "0.5.23", "model_path": "/m",
                 "model": "dir X", "python": "3.12.3", "patches": "p1 0.7.2", "server_module": "sglang.launch_server"}
    # the UUIDs differ between hosts, the model and count do not: alike
    other = dict(raw, gpu={"count": 2, "names": ["GPU 0: NVIDIA H200 (UUID: GPU-c)", "GPU 1: NVIDIA H200 (UUID: GPU-d)"]})
    assert hostfacts.differences({"a": f, "b": hostfacts.flatten(other, "/m", "sglang.launch_server")}) == []
    assert hostfacts.flatten({}, None, None)["gpus"] == "none (no nvidia-smi)"


def test_the_fleets_winner_is_measured_against_each_hosts_own_base(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("base: baseline\nbench: {levels: [16]}\nobjective: {maximize: output_tps@16, min_gain: 2%}\n")
    camp = load_campaign(str(path))
    done = {  # gpu2 is a slower machine: its trial's raw number is lower, its gain over its own base higher
        "gpu1": [{"trial": "base", "outcome": "ok", "objective": 1000.0, "at": "1"},
                 {"trial": "s001", "outcome": "ok", "objective": 1100.0, "at": "3"}],
        "gpu2": [{"trial": "base", "outcome": "ok", "objective": 500.0, "at": "2"},
                 {"trial": "s002", "outcome": "ok", "objective": 600.0, "at": "4"},
                 {"trial": "s003", "outcome": "crashed", "at": "5"}],
        "gpu3": [{"trial": "base", "outcome": "crashed", "at": "2"}],   # no base: nothing of it compares
    }
    entries = campaignrecord.relative_entries(done)
    assert [(e["host"], e["trial"]) for e in entries] == [("gpu1", "base"), ("gpu2", "base"), ("gpu1", "s001"),
                                                         ("gpu2", "s002"), ("gpu2", "s003")]
    assert entries[3]["objective"] == pytest.approx(1.2) and entries[3]["raw"] == 600.0
    winner, verdicts, gain, how = campaignrecord.fleet_winner(camp, done)
    assert (winner["host"], winner["trial"]) == ("gpu2", "s002") and gain == pytest.approx(0.02)
    assert verdicts[("gpu2", "base")].startswith("tie: +0.0% vs base@gpu1")
    assert verdicts[("gpu1", "s001")] == "+10.0% over base@gpu1: the new best"
    assert verdicts[("gpu2", "s002")] == "+9.1% over s001@gpu1: the new best"
    # without min_gain: the widest of the bases' noise bands
    path.write_text("base: baseline\nbench: {levels: [16]}\nobjective: {maximize: output_tps@16}\n")
    camp = load_campaign(str(path))
    done["gpu1"][0]["noise"], done["gpu2"][0]["noise"] = {"band": 0.01}, {"band": 0.04}
    assert campaignrecord.fleet_gain(camp, done)[0] == pytest.approx(0.04)
    assert tunefleet.batches(["a", "b", "c"], 2) == [["a", "b"], ["c"]] and tunefleet.batches(["a", "b"], None) == [["a", "b"]]
    assert tunefleet.point_key({"x": 1}, "{}", ["p", "q"]) == tunefleet.point_key({"x": 1}, "{}", ["q", "p"])
    assert tunefleet.point_key({"x": 1}, "{}", []) != tunefleet.point_key({"x": 2}, "{}", [])


def test_a_sequential_fleet_compares_intervals_relative_to_each_hosts_base(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("base: baseline\nbench: {levels: [16]}\n"
                    "objective: {maximize: output_tps@16, max_repeats: 3, confidence: 80%}\n")
    camp = load_campaign(str(path))
    done = {  # gpu2 runs at half gpu1's speed; each trial's runs as tune records them
        "gpu1": [{"trial": "base", "outcome": "ok", "objective": 1000.0, "runs": [990.0, 1010.0], "at": "1"},
                 {"trial": "s001", "outcome": "ok", "objective": 1030.0, "runs": [1020.0, 1040.0], "at": "3"}],
        "gpu2": [{"trial": "base", "outcome": "ok", "objective": 500.0, "runs": [505.0, 495.0], "at": "2"},
                 {"trial": "s002", "outcome": "ok", "objective": 600.0, "runs": [600.0], "at": "4"},
                 {"trial": "s003", "outcome": "ok", "objective": 505.0, "runs": [505.0, 500.0, 510.0], "at": "5"}],
    }
    runs = campaignrecord.fleet_runs(done, {})
    assert list(runs) == [("gpu1", "base"), ("gpu2", "base"), ("gpu1", "s001"), ("gpu2", "s002"), ("gpu2", "s003")]
    assert runs[("gpu2", "s002")] == [pytest.approx(1.2)] and runs[("gpu1", "s001")] == [1.02, 1.04]
    noise = verdict.pooled_noise(runs)
    assert noise.df == 1 + 1 + 1 + 2  # every key benched more than once, whichever host
    winner, verdicts, gain, how = campaignrecord.fleet_winner(camp, done)
    assert (winner["host"], winner["trial"]) == ("gpu2", "s002") and gain == 0.0 and how == noise.how
    assert verdicts[("gpu2", "s002")].startswith("better: +16.5% [") and "vs s001@gpu1: the new best" in \
        verdicts[("gpu2", "s002")]
    assert verdicts[("gpu2", "s003")].startswith("worse: ") and verdicts[("gpu2", "s003")].endswith("vs s002@gpu2")
    # the end re-bench: the finalists' runs join theirs; the winner is the best lower bound of the finalists
    rebenched = {"gpu1": {"s001": [1300.0, 1290.0]}, "gpu2": {"s002": [560.0]}}
    winner, verdicts, _g, _h = campaignrecord.fleet_winner(camp, done, rebenched)
    finals = campaignrecord.fleet_runs(done, rebenched)
    lows = {k: verdict.lower_bound(finals[k], verdict.pooled_noise(finals)) for k in (("gpu1", "s001"), ("gpu2", "s002"))}
    assert (winner["host"], winner["trial"]) == max(lows, key=lows.get)
    assert "re-benched: " in verdicts[("gpu1", "s001")] and "over 4 runs" in verdicts[("gpu1", "s001")]
    # repeats against the fleet's incumbent, relative to the trial's own host's base
    again, why, _n = campaignrecord.fleet_repeat_decision(camp, done, "gpu3", "base", [700.0])
    assert again and why == "the first feasible trial: benched again to measure the noise"
    again, why, _n = campaignrecord.fleet_repeat_decision(camp, done, "gpu1", "s004", [1300.0])
    assert not again and why.startswith("better: ") and why.endswith("the intervals separate")
    again, why, _n = campaignrecord.fleet_repeat_decision(camp, done, "gpu2", "s004", [600.0])
    assert again and why.startswith("unsure: ") and why.endswith("(1 run vs 1): benching again")
    again, why, _n = campaignrecord.fleet_repeat_decision(camp, done, "gpu2", "s004", [600.0, 590.0, 605.0])
    assert not again and "max_repeats 3" in why


# -- over real sshd hosts -------------------------------------------------------------------------------

HOSTS = ("lab1", "lab2", "lab3", "lab4")


@pytest.fixture
def fleet_lab(lab, tmp_path):
    """Four lab hosts; lab3 reached through an sshd of its own (`stop_lab3()` stops it). The
    servers are stopped afterwards through an inventory that reaches lab3 directly."""
    ports = {h: {"server_port": free_port(), "lease_timeout": 60} for h in HOSTS}
    direct = lab.inventory(n_hosts=4, host_vars=ports, filename="direct.yml")
    own = make_server(lab.sshd_hosts(2).address, tmp_path / "sshd-lab3", lab.client_key).start()
    vars_ = {h: dict(v) for h, v in ports.items()}
    vars_["lab3"].update(ssh_host=own.address, ssh_port=own.port)
    inv = lab.inventory(n_hosts=4, host_vars=vars_)
    with open(lab.known_hosts, "a") as fh:
        fh.write(own.known_hosts_line)
    books = playbooks_with(tmp_path, tbase=TBASE)
    (tmp_path / "camps").mkdir()
    results = tmp_path / "results"
    env = {"SERVOPS_PLAYBOOKS": str(books), "SERVOPS_RESULTS": str(results), "SERVOPS_CAMPAIGNS": str(tmp_path / "camps")}
    yield lab, inv, env, results, lambda: stop_hard(own)
    stop_hard(own)
    run_invoke("stop", "--grace", "2", "--break-lock", "-H", "all", inventory=direct)


def stop_hard(server) -> None:
    """The host is gone from the network: its sshd and every connection it serves (their sshd
    processes) killed. What those connections started keeps running, as on a host cut off by a
    network fault; killing it too once SIGKILLed a `pyenv rehash` that this machine's ~/.bashrc
    runs for every ssh command, and its lock left behind made every later command of every lab
    host wait 60 s for it: the other hosts' leases expired and their guards rolled them back."""
    if not server.proc or server.proc.poll() is not None:
        return
    table = procs.process_table()
    doomed, todo = [], [server.proc.pid]
    while todo:
        pid = todo.pop()
        doomed.append(pid)
        # (sshd, or OpenSSH 9.8+'s sshd-session)
        todo.extend(c for c, facts in table.items() if facts["ppid"] == pid and procs._comm(c).startswith("sshd"))
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    server.proc.wait()
    server.proc = None


def log_of(results: Path, host: str, name: str) -> list[dict]:
    path = results / host / "campaigns" / name / "trials.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def dones(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e.get("phase") == "done" and "trial" in e]


def study_of(results: Path, name: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{results / '_fleet' / name / 'study.db'}"
    return optuna.load_study(study_name=name, storage=url).get_trials()


def variant_of(lab, host: str) -> str | None:
    rel = lab.tmp / f"deploy-{host}" / "current" / "release.json"
    return json.loads(rel.read_text())["variant"] if rel.exists() else None


def popen_tune(args: list[str], inv: Path, env: dict, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "invoke", "tune", *args], cwd=REPO,
                            env=dict(os.environ, SERVOPS_INVENTORY=str(inv), NO_COLOR="1", PYTHONUNBUFFERED="1",
                                     COLUMNS="250", **env), stdout=open(out, "w"), stderr=subprocess.STDOUT)


def test_a_fleet_campaign_goes_on_when_a_host_drops_out(fleet_lab, tmp_path):
    import optuna

    lab, inv, env, results, stop_lab3 = fleet_lab
    (tmp_path / "camps" / "fleetcamp.yml").write_text(SEARCH_CAMPAIGN.format(search="tpe", seed=2, env="{}",
                                                                            max_trials=8))
    out = tmp_path / "fleet.out"
    proc = popen_tune(["fleetcamp", "-H", ",".join(HOSTS), "--serial", "2"], inv, env, out)
    try:
        deadline = time.time() + 300
        # lab3 starts its first sampled point (its base is done): its sshd goes away mid-trial
        while time.time() < deadline and not any(e.get("phase") == "start" and e["trial"] != "base"
                                                 for e in log_of(results, "lab3", "fleetcamp")):
            assert proc.poll() is None, out.read_text()
            time.sleep(0.2)
        stop_lab3()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert proc.returncode == 3, text  # lab3: unreachable; the others finished
    assert "tune fleetcamp on 4 alike hosts (lab1, lab2, lab3, lab4)" in text, text
    assert re.search(r"lab3 : failed - dropped out of the campaign: .*lab3", text), text
    for h in ("lab1", "lab2", "lab4"):
        assert re.search(rf"{h} : changed - winner \S+ \(ran on lab\d\), deployed: ", text), text
    # one line per trial phase, each after its host's name
    phases = [l for l in text.splitlines() if re.match(r"lab\d \[\d+/8\] ", l)]
    assert {l[:4] for l in phases} == set(HOSTS), text
    # lab3's running trial: failed in its log and in the study; every study trial finished
    lab3 = {e["trial"]: e for e in dones(log_of(results, "lab3", "fleetcamp"))}
    cut = [e for t, e in lab3.items() if t != "base" and e["outcome"] != "duplicate"]
    assert len(cut) == 1 and cut[0]["outcome"] == "failed", lab3
    study = study_of(results, "fleetcamp")
    assert all(t.state.is_finished() for t in study), [(t.number, t.state) for t in study]
    mine = next(t for t in study if t.user_attrs.get("tid") == cut[0]["trial"])
    assert mine.state == optuna.trial.TrialState.FAIL and mine.user_attrs["host"] == "lab3"
    # the budget: every host's base and every point asked, 8 in all, none run twice
    ran = [(h, e["trial"]) for h in HOSTS for e in dones(log_of(results, h, "fleetcamp")) if e["outcome"] != "duplicate"]
    assert len(ran) == 8 and len(set(t for _h, t in ran if t != "base")) == len(ran) - 4, ran
    assert {t.user_attrs["tid"] for t in study if not t.user_attrs.get("same_as")} == {t for _h, t in ran if t != "base"}
    # the winner is left on every host still there (lab3 was not touched again)
    winner = re.search(r"lab1 : changed - winner (\S+)", text)[1]
    want = "tbase" if winner == "base" else f"fleetcamp-{winner}"
    if winner != "base":
        assert {variant_of(lab, h) for h in ("lab1", "lab2", "lab4")} == {want}
    # the summary, and the fleet's report: a host column
    assert re.search(r"┃ host +┃ trial +┃", text) and re.search(r"│ lab3 +│ " + re.escape(cut[0]["trial"]), text), text
    res = run_invoke("tune.report", "fleetcamp", "-H", ",".join(HOSTS), inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    md = (results / "_fleet" / "fleetcamp" / "report.md").read_text()
    assert md.splitlines()[0] == "# Tuning campaign `fleetcamp` on lab1, lab2, lab3, lab4"
    assert "| host | trial |" in md and f"| lab3 | {cut[0]['trial']} |" in md and "| lab1 | base@lab1 |" in md
    page = (results / "_fleet" / "fleetcamp" / "report.html").read_text()
    assert f"data-trial='{cut[0]['trial']}' data-host='lab3'" in page and "<th>host</th>" in page
    # --resume of the finished campaign on the hosts still there: nothing runs again
    before = {h: dones(log_of(results, h, "fleetcamp")) for h in HOSTS}
    res = run_invoke("tune", "fleetcamp", "-H", "lab1,lab2,lab4", "--resume", inventory=inv, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lab1 : ok - winner" in res.stdout
    assert {h: dones(log_of(results, h, "fleetcamp")) for h in HOSTS} == before


def test_unlike_hosts_are_refused_before_anything_changes(lab, tmp_path):
    inv = lab.inventory(n_hosts=3, host_vars={"lab1": {"server_port": free_port()}, "lab2": {"server_port": free_port()},
                                              "lab3": {"server_port": free_port(), "model_path": "/models/Other-7B"}})
    books = playbooks_with(tmp_path, tbase=TBASE)
    (tmp_path / "camps").mkdir()
    (tmp_path / "camps" / "unlike.yml").write_text(SEARCH_CAMPAIGN.format(search="tpe", seed=1, env="{}", max_trials=4))
    results = tmp_path / "results"
    env = {"SERVOPS_PLAYBOOKS": str(books), "SERVOPS_RESULTS": str(results), "SERVOPS_CAMPAIGNS": str(tmp_path / "camps")}
    res = run_invoke("tune", "unlike", "-H", "lab1,lab2,lab3", inventory=inv, env=env)
    one_line_error(res, "the hosts are not alike", "model path (lab3: /models/Other-7B; lab1, lab2: /models/GLM-5-NVFP4)")
    assert re.search(r"\* model path +│ /models/GLM-5-NVFP4 +│ /models/GLM-5-NVFP4 +│ /models/Other-7B", res.stdout), res.stdout
    for h in ("lab1", "lab2", "lab3"):  # nothing changed on any host, nothing journaled here
        assert not (lab.tmp / f"deploy-{h}").exists()
        assert not (results / h).exists()
    assert not (results / "_fleet" / "unlike").exists()


def test_a_killed_fleet_campaign_resumes_without_losing_or_repeating_a_trial(fleet_lab, tmp_path):
    import optuna

    lab, inv, env, results, _stop = fleet_lab
    (tmp_path / "camps" / "killfleet.yml").write_text(SEARCH_CAMPAIGN.format(search="tpe", seed=4, env="{}",
                                                                            max_trials=6))
    out = tmp_path / "kill.out"
    proc = popen_tune(["killfleet", "-H", "lab1,lab2"], inv, env, out)
    deadline = time.time() + 300
    while time.time() < deadline and not any(e.get("phase") == "start" and e["trial"] != "base"
                                             for h in ("lab1", "lab2") for e in log_of(results, h, "killfleet")):
        assert proc.poll() is None, out.read_text()
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(t.state == optuna.trial.TrialState.RUNNING for t in study_of(results, "killfleet"))
    res = run_invoke("tune", "killfleet", "-H", "lab1,lab2", inventory=inv, env=env)
    assert res.returncode == 2 and "--resume" in res.stderr  # never silently starts over
    res = run_invoke("tune", "killfleet", "-H", "lab1,lab2", "--resume", inventory=inv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"lab\d +tune: study trial #\d+ was cut off mid-trial", res.stdout), res.stdout
    study = study_of(results, "killfleet")
    assert all(t.state.is_finished() for t in study), [(t.number, t.state, t.user_attrs) for t in study]
    ran = [t for t in study if not t.user_attrs.get("same_as")]
    # each trial cut off (one per host that was mid-trial) failed, and its point ran again under its id
    # (one cut off inside its ask, before it had a point, failed uncounted: no point to run again)
    failed = [t for t in ran if t.state == optuna.trial.TrialState.FAIL and t.user_attrs.get("reclaimed_as") == "enqueued"]
    assert 1 <= len(failed) <= 2, [(t.number, t.state, t.user_attrs) for t in study]
    for cut in failed:
        again = next(t for t in ran if t.user_attrs.get("reclaims") == cut.number)
        assert again.params == cut.params and again.user_attrs["tid"] == cut.user_attrs["tid"]
        assert again.state == optuna.trial.TrialState.COMPLETE
    # each point finished once, on one host; each host's base once; the budget: 2 bases + 4 points
    finished = [(h, e["trial"]) for h in ("lab1", "lab2") for e in dones(log_of(results, h, "killfleet"))
                if e["outcome"] != "duplicate"]
    points = [t for _h, t in finished if t != "base"]
    assert len(points) == len(set(points)) == 4 and sorted(t for _h, t in finished if t == "base") == ["base", "base"]
    assert "budget: 6 trials run (max_trials 6)" in res.stdout
