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

from conftest import REPO, RUN_DIR, playbooks_with, run_invoke
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
    assert d["queued"]["outcome"] == "infeasible"
    assert re.fullmatch(r"p99_ttft_ms@16 = [\d,.]+ > 300", d["queued"]["violations"][0]), d["queued"]["violations"]
    assert d["dup"]["outcome"] == "duplicate" and d["dup"]["same_as"] == "base"
    feasible = {t: e["objective"] for t, e in d.items() if e["outcome"] == "ok"}
    assert max(feasible, key=feasible.get) == "grid-32"
    # the flag really moves the numbers: graphs up to 32 beat eager steps above 4
    assert feasible["grid-32"] > 1.5 * feasible["base"]
    # no min_gain in the campaign: the base was benched twice, and their spread is the noise band
    noise = d["base"]["noise"]
    assert len(noise["values"]) == 2 and noise["band"] == pytest.approx(
        abs(noise["values"][0] - noise["values"][1]) / (sum(noise["values"]) / 2))


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
    printed = tmp_path / "tune.out"
    with open(printed, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "invoke", "tune", "labcamp", "-H", "lab1"], cwd=REPO,
                                env=dict(os.environ, SERVOPS_INVENTORY=str(inv), NO_COLOR="1", PYTHONUNBUFFERED="1",
                                         **env), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while time.time() < deadline and not any(e.get("trial") == "grid-32" and e["phase"] == "start"
                                                 for e in trials(results)):
            assert proc.poll() is None, "tune ended before the kill"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = done(trials(results))
    assert {"base", "piece", "piece-with-cuda-version-no-subprocess", "grid-8"} <= set(before) and "grid-32" not in before
    check_compact_output(printed.read_text(), before)

    res = run_invoke("tune", "labcamp", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 2 and "--resume" in res.stderr  # never silently starts over
    res = run_invoke("tune", "labcamp", "-H", "lab1", "--resume", "-v", inventory=inv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lab1 : changed - winner grid-32" in res.stdout
    assert re.search(r"lab1  \[ *[\d.]+s\] health", res.stdout), res.stdout  # -v: the deploys' own phase lines
    entries = trials(results)
    check_outcomes(entries)
    check_summary(res.stdout, done(entries))
    assert "unreadable" not in res.stderr and "chain broken" not in res.stderr, res.stderr  # the log is whole
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
    assert "**winner: grid-32**" in md and "--cuda-graph-max-bs: 4 -> 32" in md and "dynamo-get-cuda-version-subprocess" in md
    drift = next(e for e in entries if e["phase"] == "drift")
    assert drift["outcome"] == "measured" and f"{drift['drift_pct']:+.1f}%" in md
    page = d / "report.html"
    assert "src='data:image/png;base64," in page.read_text() and "http" not in re.sub(r"data:[^']+", "", page.read_text())
    check_report(Dom(browser_dom(page, tmp_path)), done(entries))


def check_compact_output(text: str, finished: dict[str, dict]) -> None:
    """Issue 20.3: one line per trial phase, a real ETA after the first trial, a crash as its
    diagnosis and the command that shows it; no deploy details (they are behind -v)."""
    lines = [l for l in text.splitlines() if l.strip()]
    assert "Traceback" not in text and "server.log excerpt" not in text and "lab1  [" not in text, text
    phases = [l for l in lines if re.match(r"\[\d+/\d+\] ", l)]
    assert len(lines) <= len(phases) + 3, text  # the opening line, nothing else per trial
    for tid in finished:
        mine = [l.split()[2] for l in phases if l.split()[1] == tid]
        assert mine and mine[-1] == "done" and len(mine) == len(set(mine)), (tid, mine)
    first_done = next(i for i, l in enumerate(phases) if l.split()[2] == "done")
    assert "ETA after the first trial" not in phases[first_done]
    assert all(re.search(r"ETA \d+m\d\ds \(\d+ left x \d+m\d\ds\)|last trial", l)
               for l in phases if l.split()[2] == "done" and "not run again" not in l), text
    crash = next(l for l in phases if l.split()[1:3] == ["piece", "diagnose"])
    release = finished["piece"]["release"]
    assert "dynamo-get-cuda-version-subprocess (dynamo-trace): torch._dynamo.exc.Unsupported" in crash, crash
    assert crash.endswith(f"see: invoke diagnose --release {release} -H lab1"), crash
    assert any(l.split()[1:3] == ["base", "noise"] and "min_gain" in l for l in phases), text


def check_summary(text: str, final: dict[str, dict]) -> None:
    """The table at the end: every trial, its changed flags, objective, constraints, verdict."""
    table = text[text.index("campaign labcamp: maximize output_tps@16"):]
    for tid in final:
        assert re.search(rf"│ {re.escape(tid)} +│", table), tid
    assert "--cuda-graph-max-bs: 4 -> 32" in table and "+ patch cuda-version-no-subprocess" in table and "WINNER" in table
    assert re.search(r"p99_ttft_ms@16 = [\d,.]+ > +│|p99_ttft_ms@16 = [\d,.]+ >", table)
    assert "duplicate of base" in table and "crashed: dynamo-get-cuda-version-subprocess" in table


def check_report(dom: "Dom", final: dict[str, dict]) -> None:
    """Issue 20.4, read from the page as Chromium rendered it."""
    from servops.tunereport import fmt

    heads = [th.text() for th in dom.find("th")]
    assert len(heads) == len(set(heads)) and "output tok/s" not in heads, heads  # the objective is output_tps@16
    assert "output_tps@16" in heads and "vs base" in heads
    rows = {tr.attrs["data-trial"]: tr for tr in dom.find("tr") if "data-trial" in tr.attrs}
    assert set(rows) == set(final)
    base = final["base"]["objective"]
    for tid, e in final.items():
        cell = {td.attrs["data-key"]: td for td in rows[tid].find("td")}
        m = (e.get("metrics") or {}).get("16") or {}
        assert cell["objective"].text() == fmt(e.get("objective")), tid  # one run: no ± anywhere
        assert cell["ttft_p99"].text() == fmt(m.get("ttft_p99")), tid
        if e.get("objective") is not None and tid != "base":
            assert cell["vs_base"].text() == f"{(e['objective'] - base) / base * 100:+.1f}%", tid
    flags = [div.text() for div in rows["piece-with-cuda-version-no-subprocess"].find("div", **{"class": "flag"})]
    assert flags == ["--enable-piecewise-cuda-graph: unset -> on"], flags  # one flag per line
    assert [div.text() for div in rows["grid-32"].find("div", **{"class": "flag"})] == ["--cuda-graph-max-bs: 4 -> 32"]
    assert re.search(r"violates p99_ttft_ms@16 = [\d,.]+ > 300$", rows["queued"].find("td")[3].text())
    assert [c.text() for c in dom.find("code", **{"class": "constraint"})] == ["p99_ttft_ms@16 <= 300", "failed == 0"]
    assert "±" not in dom.find("p", id="footnote")[0].text()
    assert [li.text() for li in dom.find("ul", id="winner-flags")[0].find("li")] == ["--cuda-graph-max-bs: 4 -> 32"]
    # the Pareto front of each level, never across levels
    for li in dom.find("ul", id="pareto")[0].find("li"):
        lv = li.attrs["data-level"]
        pts = {t: (e["metrics"][lv]["ttft_p99"], e["metrics"][lv]["output_tps"])
               for t, e in final.items() if lv in (e.get("metrics") or {})}
        front = {t for t, p in pts.items() if not any(q[0] <= p[0] and q[1] >= p[1] and q != p for q in pts.values())}
        assert {s.attrs["data-trial"] for s in li.find("span", **{"class": "front"})} == front, (lv, front)
    crash = next(li for li in dom.find("ul", id="crashes")[0].find("li") if li.attrs.get("data-trial") == "piece")
    assert crash.find("li", **{"class": "exception"})[0].text().startswith(
        "exception: torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped")
    assert dom.find("p", id="winner")[0].attrs["data-trial"] == "grid-32"
    assert len([i for i in dom.find("img") if i.attrs.get("src", "").startswith("data:image/png;base64,")]) == 2


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


class Dom(HTMLParser):
    """The page as a tree of elements: find(tag, **attrs) below a node, text() of a node."""

    VOID = {"br", "img", "meta", "hr", "input", "link"}

    def __init__(self, page: str = ""):
        super().__init__()
        self.tag, self.attrs, self.children, self.parts = "root", {}, [], []
        self.stack = [self]
        if page:
            self.feed(page)

    def handle_starttag(self, tag, attrs):
        node = Dom.__new__(Dom)
        node.tag, node.attrs, node.children, node.parts = tag, dict(attrs), [], []
        self.stack[-1].children.append(node)
        self.stack[-1].parts.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        self.stack[-1].parts.append(data)

    def text(self) -> str:
        return " ".join("".join(p if isinstance(p, str) else p.text() for p in self.parts).split())

    def find(self, tag: str, **attrs) -> list["Dom"]:
        out = []
        for c in self.children:
            if c.tag == tag and all(c.attrs.get(k) == v for k, v in attrs.items()):
                out.append(c)
            out.extend(c.find(tag, **attrs))
        return out


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


def test_a_difference_within_min_gain_is_a_tie_the_incumbent_keeps(tmp_path):
    """Issue 20.2: the lab crowned a trial "best so far" on a 0.4% single-run difference. A trial
    now takes the lead only when it beats the incumbent by more than min_gain."""
    from servops.campaign import load_campaign
    from servops.campaignrecord import DEFAULT_MIN_GAIN, min_gain, standings

    path = tmp_path / "c.yml"
    path.write_text("base: baseline\nbench: {levels: [16]}\nobjective: {maximize: output_tps@16, min_gain: 2%}\n")
    camp = load_campaign(str(path))
    assert camp.min_gain == pytest.approx(0.02)
    done = [{"trial": "base", "outcome": "ok", "objective": 1000.0},
            {"trial": "a", "outcome": "ok", "objective": 1004.0},       # +0.4%
            {"trial": "b", "outcome": "infeasible", "objective": 5000.0},
            {"trial": "c", "outcome": "ok", "objective": 1030.0},       # +3.0%
            {"trial": "d", "outcome": "ok", "objective": 1040.0},       # +1.0% over c
            {"trial": "e", "outcome": "ok", "objective": 900.0}]
    gain, how = min_gain(camp, done)
    assert (gain, how) == (pytest.approx(0.02), "the campaign's min_gain")
    winner, verdicts = standings(camp, done, gain)
    assert winner["trial"] == "c"
    assert verdicts["a"] == "tie: +0.4% vs base, within min_gain 2.0%; base stays best"
    assert verdicts["c"] == "+3.0% over base: the new best" and verdicts["d"].startswith("tie: +1.0% vs c")
    assert verdicts["e"] == "-12.6% vs c" and "b" not in verdicts
    # minimize: lower is better, the same band
    path.write_text("base: baseline\nbench: {levels: [16]}\nobjective: {minimize: p99_ttft_ms@16}\n")
    camp = load_campaign(str(path))
    assert camp.min_gain is None and min_gain(camp, [])[0] == DEFAULT_MIN_GAIN  # no repeat of the base measured
    noisy = [{"trial": "base", "outcome": "ok", "objective": 100.0, "noise": {"band": 0.05, "how": "two runs"}},
             {"trial": "f", "outcome": "ok", "objective": 96.0}, {"trial": "g", "outcome": "ok", "objective": 90.0}]
    assert min_gain(camp, noisy) == (0.05, "two runs")
    winner, verdicts = standings(camp, noisy, 0.05)
    assert winner["trial"] == "g" and verdicts["f"].startswith("tie: +4.0% vs base")
    path.write_text("base: baseline\nbench: {levels: [16]}\nobjective: {maximize: output_tps@16, min_gain: 150%}\n")
    from servops.campaign import CampaignError
    with pytest.raises(CampaignError, match="objective.min_gain: expected a share like 2%"):
        load_campaign(str(path))


# -- search: random / tpe over the Optuna study (servops/search.py, servops/study.py) -------------

SEARCH_CAMPAIGN = """description: a sampled campaign over the double's speed knobs
base: tbase
search: {search}
seed: {seed}
candidates:
  - name: knobs
    grid:
      server_args:
        cuda-graph-max-bs: {{low: 4, high: 32, log: true}}
        max-running-requests: [4, 16]
      env: {env}
bench: {{levels: [1, 16], requests: 16, input_len: 16, output_len: 12, warmup: 1}}
objective:
  maximize: output_tps@16
  constraints: ["p99_ttft_ms@1 <= 300", "failed == 0"]
budget: {{max_trials: {max_trials}}}
leave: best
"""


def search_campaign(tmp_path, name: str, search: str, max_trials: int, seed: int = 1, env: str = "{}") -> None:
    (tmp_path / "camps" / f"{name}.yml").write_text(SEARCH_CAMPAIGN.format(search=search, seed=seed, env=env,
                                                                           max_trials=max_trials))


def log_of(results: Path, name: str) -> list[dict]:
    path = results / "lab1" / "campaigns" / name / "trials.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def study_trials(results: Path, name: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{results / 'lab1' / 'campaigns' / name / 'study.db'}"
    return optuna.load_study(study_name=name, storage=url).get_trials()


def test_a_tpe_campaign_samples_the_space_and_leaves_the_best(tune_lab, tmp_path):
    import optuna

    lab, inv, env, results = tune_lab
    search_campaign(tmp_path, "tpecamp", "tpe", max_trials=4)
    res = run_invoke("tune", "tpecamp", "-H", "lab1", inventory=inv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "search tpe (seed 1) over knobs" in res.stdout and "max_trials 4" in res.stdout, res.stdout
    study = study_trials(results, "tpecamp")
    entries = log_of(results, "tpecamp")
    assert len(study) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in study), (
        [(t.number, t.state, t.user_attrs) for t in study], res.stdout)
    finished = done(entries)
    # every study trial is a trial of the log: its value there is the study's, its flags the sampled ones
    for t in study:
        d = finished[t.user_attrs["tid"]]
        assert d["outcome"] == "ok" and d["objective"] == pytest.approx(t.value)
        start = next(e for e in entries if e.get("trial") == d["trial"] and e["phase"] == "start")
        assert start["spec"]["server_args"]["cuda-graph-max-bs"] == t.params["server_args.cuda-graph-max-bs"]
        assert 4 <= t.params["server_args.cuda-graph-max-bs"] <= 32
    # the winner (ties within min_gain keep the incumbent) is left deployed, and nothing beats it clearly:
    # by no more than the campaign's own noise band (the base benched twice: its min_gain), the
    # interval inside which two trials are a tie -- on a loaded machine wider than a fixed 5%
    winner = re.search(r"winner (\S+), deployed", res.stdout)[1]
    assert current_variant(lab) == f"tpecamp-{winner}" or winner == "base"
    band = finished["base"]["noise"]["band"]
    best = max(e.get("objective") or 0 for e in finished.values())
    assert best <= finished[winner]["objective"] * (1 + band) * (1 + 1e-9), (best, winner, band)
    res = run_invoke("tune.report", "tpecamp", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    md = (results / "lab1" / "campaigns" / "tpecamp" / "report.md").read_text()
    for t in study:
        assert t.user_attrs["tid"] in md


def test_a_random_campaign_prunes_a_trial_at_its_failing_level(tune_lab, tmp_path):
    import optuna

    lab, inv, env, results = tune_lab
    # every sampled point has a 400 ms prefill: p99 TTFT at concurrency 1 is over its 300 ms bound,
    # so the trial stops there, before the (slower) level 16 is benched
    search_campaign(tmp_path, "randcamp", "random", max_trials=3, seed=5, env="{SGLANG_DOUBLE_TTFT: ['0.4']}")
    res = run_invoke("tune", "randcamp", "-H", "lab1", inventory=inv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    study = study_trials(results, "randcamp")
    ran = [t for t in study if not t.user_attrs.get("same_as")]
    assert len(ran) == 2 and all(t.state == optuna.trial.TrialState.PRUNED for t in ran)
    finished = done(log_of(results, "randcamp"))
    for t in ran:
        d = finished[t.user_attrs["tid"]]
        assert d["outcome"] == "pruned" and d["pruned_at"] == 1 and d.get("objective") is None
        assert re.match(r"p99_ttft_ms@1 = [\d.]+ > 300", d["violations"][0]), d
        assert "below the objective's 16: higher load can only make it worse" in d["reason"]
        assert list(d["metrics"]) == ["1"]  # level 16 was never benched
        assert "higher load can only make it worse" in t.user_attrs["pruned"]
    assert "winner base" in res.stdout, res.stdout
    assert re.search(r"s\d+ +prune +p99_ttft_ms@1", res.stdout), res.stdout
    res = run_invoke("tune.report", "randcamp", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    md = (results / "lab1" / "campaigns" / "randcamp" / "report.md").read_text()
    assert "pruned" in md and "p99_ttft_ms@1 = " in md


def test_a_sigkilled_search_resumes_from_its_sqlite_study(tune_lab, tmp_path):
    import optuna

    lab, inv, env, results = tune_lab
    search_campaign(tmp_path, "killcamp", "tpe", max_trials=4, seed=3)
    with open(tmp_path / "kill.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "invoke", "tune", "killcamp", "-H", "lab1"], cwd=REPO,
                                env=dict(os.environ, SERVOPS_INVENTORY=str(inv), NO_COLOR="1", PYTHONUNBUFFERED="1",
                                         **env), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while time.time() < deadline and not any(e.get("trial") == "s001" and e["phase"] == "start"
                                                 for e in log_of(results, "killcamp")):
            assert proc.poll() is None, "tune ended before the kill: " + (tmp_path / "kill.out").read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    cut = {t.number: t for t in study_trials(results, "killcamp")}
    assert cut[1].state == optuna.trial.TrialState.RUNNING and cut[0].state == optuna.trial.TrialState.COMPLETE
    res = run_invoke("tune", "killcamp", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 2 and "--resume" in res.stderr  # never silently starts over
    res = run_invoke("tune", "killcamp", "-H", "lab1", "--resume", inventory=inv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "study trial #1 was cut off mid-trial" in res.stdout, res.stdout
    study = study_trials(results, "killcamp")
    states = [t.state for t in study if not t.user_attrs.get("same_as")]  # (a point asked again: not run twice)
    # the cut-off trial failed and its point ran again under the same id: 3 sampled trials, one FAIL
    assert states.count(optuna.trial.TrialState.FAIL) == 1 and states.count(optuna.trial.TrialState.COMPLETE) == 3
    failed = next(t for t in study if t.state == optuna.trial.TrialState.FAIL)
    retry = next(t for t in study if t.user_attrs.get("reclaims") == failed.number)
    assert retry.params == failed.params and retry.user_attrs["tid"] == "s001"
    entries = log_of(results, "killcamp")
    dones = [e for e in entries if e["phase"] == "done" and "trial" in e]
    assert sorted(e["trial"] for e in dones) == sorted(["base"] + [t.user_attrs["tid"] for t in study
                                                                   if t.state == optuna.trial.TrialState.COMPLETE])
    assert [e["outcome"] for e in dones if e["trial"] == "s001"] == ["ok"]  # finished once, counted once
    assert "budget: 4 trials run (max_trials 4)" in res.stdout


@pytest.fixture
def postgres():
    """A real PostgreSQL server on loopback (Debian's binaries), trust auth, for the test only."""
    import glob
    import tempfile

    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    if not bins:
        pytest.fail("no PostgreSQL server binaries: run scripts/setup.sh (it installs postgresql)")
    bin_dir = Path(bins[-1])
    root = Path(tempfile.mkdtemp(prefix="pg-", dir=RUN_DIR))  # (a killed run's server: ended by the next run)
    data = root / "data"
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as Debian's postgres user
        as_user = ["runuser", "-u", "postgres", "--"]
        os.chmod(root, 0o755)
        shutil.chown(root, "postgres", "postgres")
    port = free_port()
    subprocess.run(as_user + [str(bin_dir / "initdb"), "-D", str(data), "-U", "servops", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True, timeout=120)
    subprocess.run(as_user + [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60",
                              "-o", f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={root}",
                              "start"], check=True, capture_output=True, timeout=120)
    try:
        yield f"postgresql://servops@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(as_user + [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def test_two_controllers_share_one_study_through_a_real_postgresql(lab, tmp_path, postgres):
    import optuna

    inv = lab.inventory(n_hosts=2, host_vars={"lab1": {"server_port": free_port(), "lease_timeout": 60},
                                              "lab2": {"server_port": free_port(), "lease_timeout": 60}})
    books = playbooks_with(tmp_path, tbase=TBASE)
    (tmp_path / "camps").mkdir()
    search_campaign(tmp_path, "shared", "tpe", max_trials=5, seed=11)
    results = tmp_path / "results"
    env = {"SERVOPS_PLAYBOOKS": str(books), "SERVOPS_RESULTS": str(results),
           "SERVOPS_CAMPAIGNS": str(tmp_path / "camps")}
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "invoke", "tune", "shared", "-H", h, "--storage", postgres],
                                  cwd=REPO, env=dict(os.environ, SERVOPS_INVENTORY=str(inv), NO_COLOR="1",
                                                     PYTHONUNBUFFERED="1", COLUMNS="200", **env),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for h in ("lab1", "lab2")]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out
    finally:
        run_invoke("stop", "--grace", "2", "--break-lock", inventory=inv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="shared", storage=postgres.replace("postgresql://", "postgresql+psycopg2://"))
    study = study.get_trials()
    ran = [t for t in study if not t.user_attrs.get("same_as")]
    # one study, both controllers' points in it; each host's trials.jsonl holds its own, none twice
    assert {t.user_attrs["host"] for t in ran} == {"lab1", "lab2"}
    # every trial finished (under load one may fail or be pruned: told as such, never left running)
    assert all(t.state.is_finished() for t in ran), [(t.number, t.state) for t in ran]
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in ran) >= 2
    assert 4 <= len(ran) <= 5  # the budget (each host's base counts on its own host) -- at most one over, as
    #                            Optuna's MaxTrialsCallback, when both ask at the same moment
    for host in ("lab1", "lab2"):
        path = results / host / "campaigns" / "shared" / "trials.jsonl"
        finished = [e["trial"] for e in map(json.loads, path.read_text().splitlines())
                    if e.get("phase") == "done" and "trial" in e and e.get("outcome") != "duplicate"]
        assert sorted(finished) == sorted(["base"] + [t.user_attrs["tid"] for t in ran if t.user_attrs["host"] == host])
        assert not (path.parent / "study.db").exists()  # the study is the shared one


def test_the_report_shows_flags_as_rendered_on_the_host():
    """A variant's `{{ max_num_seqs | default(256) }}` is shown as the 256 the host ran, from the
    log's rendered_args; a log written before they were kept shows the variant as written."""
    from servops.tunereport import flags_diff

    base = {"server_args": {"max-num-seqs": "{{ max_num_seqs | default(256) }}", "api-key": "{{ key }}"},
            "rendered_args": {"max-num-seqs": "256", "api-key": "[REDACTED]"}}
    trial = {"server_args": {"max-num-seqs": 4, "enforce-eager": True, "api-key": "{{ key }}"},
             "rendered_args": {"max-num-seqs": 4, "enforce-eager": True, "api-key": "[REDACTED]"}}
    assert flags_diff(base, trial) == ["--enforce-eager: unset -> on", "--max-num-seqs: 256 -> 4"]
    old = {k: v for k, v in base.items() if k != "rendered_args"}
    assert flags_diff(old, {"server_args": trial["server_args"]})[1] == \
        "--max-num-seqs: {{ max_num_seqs | default(256) }} -> 4"
