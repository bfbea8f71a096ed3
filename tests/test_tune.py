"""invoke tune on the lab: a campaign of 6 trials whose speed really differs by flag value (the
double's batched decoding model), one that crashes and is retried with the patch its diagnosis
names, one that violates the latency constraint, one skipped as a duplicate; the best feasible
one wins and stays deployed; SIGKILL mid-trial and --resume repeats nothing finished; the HTML
report, opened in a real headless Chromium, shows the numbers of the JSONL."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import REPO, playbooks_with, run_invoke
from servops.lab.sshd import free_port

TBASE = """extends: baseline
# decode steps of 4 ms + 0.5 ms per running request, 3x slower above --cuda-graph-max-bs
env: {SGLANG_DOUBLE_TOKEN_DELAY: '0.004', SGLANG_DOUBLE_STEP_PER_SEQ: '0.0005', SGLANG_DOUBLE_EAGER_FACTOR: '3'}
server_args: {cuda-graph-max-bs: 4}
"""

CAMPAIGN = """description: lab campaign over the double's speed knobs
base: tbase
candidates:
  - name: piece
    server_args: {enable-piecewise-cuda-graph: true}   # no patch: crashes at capture
  - name: grid
    grid: {server_args: {cuda-graph-max-bs: [8, 32]}}
  - name: queued
    server_args: {max-running-requests: 1}             # serialised: TTFT p99 far over the bound
  - name: dup
    server_args: {cuda-graph-max-bs: 4}                # the base again: not run twice
bench: {levels: [1, 16], requests: 16, input_len: 16, output_len: 12, warmup: 1}
objective:
  maximize: output_tps@16
  constraints: ["p99_ttft_ms@16 <= 300", "failed == 0"]
budget: {max_trials: 10, max_wall_time: 30m}
auto_patch: true
leave: best
drift_check_after: 1s                                  # a "long" campaign: the base is benched again
"""


@pytest.fixture
def tune_lab(lab, tmp_path):
    port = free_port()
    inv = lab.inventory(host_vars={"lab1": {"server_port": port, "lease_timeout": 60}})
    books = playbooks_with(tmp_path, tbase=TBASE)
    camp = tmp_path / "camps" / "labcamp.yml"
    camp.parent.mkdir()
    camp.write_text(CAMPAIGN)
    results = tmp_path / "results"
    env = {"SERVOPS_PLAYBOOKS": str(books), "SERVOPS_RESULTS": str(results), "SERVOPS_CAMPAIGNS": str(camp.parent)}
    yield lab, inv, env, results
    run_invoke("stop", "--grace", "2", "--break-lock", inventory=inv)


def trials(results: Path) -> list[dict]:
    path = results / "lab1" / "campaigns" / "labcamp" / "trials.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def done(entries: list[dict]) -> dict[str, dict]:
    return {e["trial"]: e for e in entries if e.get("phase") == "done" and "trial" in e}


def current_variant(lab) -> str:
    root = lab.tmp / "deploy-lab1"
    return json.loads((root / "current" / "release.json").read_text())["variant"]


def check_outcomes(entries: list[dict]) -> None:
    d = done(entries)
    assert set(d) == {"base", "piece", "piece-with-cuda-version-no-subprocess", "grid-8", "grid-32", "queued", "dup"}, set(d)
    assert d["piece"]["outcome"] == "crashed"
    assert d["piece"]["findings"][0]["entry"] == "dynamo-get-cuda-version-subprocess"
    assert d["piece-with-cuda-version-no-subprocess"]["outcome"] == "ok"
    assert d["queued"]["outcome"] == "infeasible" and "p99_ttft_ms@16 <= 300" in " ".join(d["queued"]["violations"])
    assert d["dup"]["outcome"] == "duplicate" and d["dup"]["same_as"] == "base"
    feasible = {t: e["objective"] for t, e in d.items() if e["outcome"] == "ok"}
    assert max(feasible, key=feasible.get) == "grid-32"
    # the flag really moves the numbers: graphs up to 32 beat eager steps above 4
    assert feasible["grid-32"] > 1.5 * feasible["base"]


def test_campaign_runs_resumes_and_reports(tune_lab, tmp_path):
    lab, inv, env, results = tune_lab
    # bad campaigns are one line naming the file and key, before any connection
    bad = tmp_path / "camps" / "broken.yml"
    bad.write_text(CAMPAIGN.replace("maximize: output_tps@16", "maximize: output_tps@99"))
    res = run_invoke("tune", "broken", inventory=inv, env=env)
    assert res.returncode == 2 and "broken.yml: objective.maximize: level 99 is not one of bench.levels" in res.stderr
    bad.write_text(CAMPAIGN.replace("failed == 0", "failed >= 0"))
    res = run_invoke("tune", "broken", inventory=inv, env=env)
    assert res.returncode == 2 and "broken.yml: objective.constraints" in res.stderr
    assert not lab.tmp.joinpath("deploy-lab1").exists()

    # check mode: every launch preflighted, the duplicate found, nothing deployed
    res = run_invoke("tune", "labcamp", "--dry-run", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "would run 5 trial(s) (check mode)" in res.stdout and "duplicate of base" in res.stdout
    assert not lab.tmp.joinpath("deploy-lab1", "releases").exists()

    # run, and SIGKILL the controller in the middle of the fifth trial
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "tune", "labcamp", "-H", "lab1"], cwd=REPO,
                            env=dict(os.environ, SERVOPS_INVENTORY=str(inv), NO_COLOR="1", **env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not any(e.get("trial") == "grid-32" and e["phase"] == "start"
                                             for e in trials(results)):
        assert proc.poll() is None, "tune ended before the kill"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = done(trials(results))
    assert {"base", "piece", "piece-with-cuda-version-no-subprocess", "grid-8"} <= set(before) and "grid-32" not in before

    res = run_invoke("tune", "labcamp", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 2 and "--resume" in res.stderr  # never silently starts over
    res = run_invoke("tune", "labcamp", "-H", "lab1", "--resume", inventory=inv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lab1 : changed - winner grid-32" in res.stdout
    entries = trials(results)
    check_outcomes(entries)
    for tid, e in before.items():  # nothing finished is repeated
        assert [x for x in entries if x.get("trial") == tid and x["phase"] == "done"] == [e]
    assert current_variant(lab) == "labcamp-grid-32"  # leave: best
    hist = run_invoke("history", "-H", "lab1", inventory=inv, env=env)
    assert "tune.done" in hist.stdout and "tune.start" in hist.stdout

    # the report: Markdown + self-contained HTML, checked in a real headless browser
    res = run_invoke("tune.report", "labcamp", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    d = results / "lab1" / "campaigns" / "labcamp"
    md = (d / "report.md").read_text()
    assert "**winner: grid-32**" in md and "--cuda-graph-max-bs 32" in md and "dynamo-get-cuda-version-subprocess" in md
    drift = next(e for e in entries if e["phase"] == "drift")
    assert drift["outcome"] == "measured" and f"{drift['drift_pct']:+.1f}%" in md
    page = d / "report.html"
    assert "src='data:image/png;base64," in page.read_text() and "http" not in re.sub(r"data:[^']+", "", page.read_text())
    dom = browser_dom(page, tmp_path)
    rows = TableRows()
    rows.feed(dom)
    from servops.tunereport import fmt

    final = done(entries)
    shown = {r["trial"]: r for r in rows.rows}
    assert set(shown) == set(final)
    for tid, e in final.items():
        m = (e.get("metrics") or {}).get("16") or {}
        assert shown[tid]["output_tps"] == fmt(m.get("output_tps")), tid
        assert shown[tid]["ttft_p99"] == fmt(m.get("ttft_p99")), tid
        assert shown[tid]["objective"].split(" ± ")[0] == fmt(e.get("objective")), tid
    assert rows.winner == "grid-32" and rows.images == 2


def browser_dom(page: Path, tmp_path: Path) -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.fail("chromium is not installed: run the README's install command (scripts/setup.sh)")
    out = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'chromium'}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "<table" in out.stdout, out.stderr[-2000:]
    return out.stdout


class TableRows(HTMLParser):
    """The rendered trials table: per row, the trial and each data-key cell's text."""

    def __init__(self):
        super().__init__()
        self.rows, self.row, self.key, self.winner, self.images = [], None, None, None, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-trial" in a:
            self.row = {"trial": a["data-trial"]}
            self.rows.append(self.row)
        elif tag == "td" and self.row is not None and "data-key" in a:
            self.key = a["data-key"]
            self.row[self.key] = ""
        elif tag == "p" and a.get("id") == "winner":
            self.winner = a.get("data-trial")
        elif tag == "img" and (a.get("src") or "").startswith("data:image/png;base64,"):
            self.images += 1

    def handle_endtag(self, tag):
        if tag == "td":
            self.key = None
        elif tag == "tr":
            self.row = None

    def handle_data(self, data):
        if self.key and self.row is not None:
            self.row[self.key] += data


def test_every_candidate_passes_the_launch_preflight_before_the_first_restart(lab, sglang_release, tmp_path):
    """On a host with sglang 0.5.23, a typo in the last candidate is refused in seconds, naming the
    trial, the flag and the version, before any trial is deployed."""
    env = sglang_release("0.5.23")
    inv = lab.inventory(host_vars={"lab1": {"venv": str(env["venv"]), "server_port": free_port()}})
    camp = tmp_path / "camps" / "typo.yml"
    camp.parent.mkdir()
    camp.write_text("base: baseline\ncandidates:\n  - variant: piecewise\n  - name: later\n"
                    "    server_args: {cuda-graph-max-bz: 128}\n"
                    "bench: {levels: [1]}\nobjective: {maximize: output_tps@1}\n")
    started = time.monotonic()
    res = run_invoke("tune", "typo", "-H", "lab1", inventory=inv,
                     env={"SERVOPS_CAMPAIGNS": str(camp.parent), "SERVOPS_RESULTS": str(tmp_path / "results")})
    assert res.returncode == 2 and time.monotonic() - started < 120
    assert "trial later" in res.stderr and "--cuda-graph-max-bz: unrecognized on sglang 0.5.23" in res.stderr
    assert not (lab.tmp / "deploy-lab1" / "releases").exists()
