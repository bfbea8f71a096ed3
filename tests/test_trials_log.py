"""A campaign's trials.jsonl and the results servops reads (issue 18, items 4 and 8, local side):
a damaged line -- a list, a string, wrong field types, nesting past the parser, a torn last
line -- is skipped and named by `tune --resume` and `tune.report`, never a KeyError; a FIFO or a
directory at trials.jsonl or at a results file is one line naming it, never a hang."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_invoke
from servops.remote import jsonl

CAMPAIGN = "base: baseline\nbench: {levels: [1], requests: 2, output_len: 4}\nobjective: {maximize: output_tps@1}\n"


def finished_log(log) -> None:
    """A finished one-trial campaign, as tune writes it (chained lines), with damage between."""
    log.parent.mkdir(parents=True)
    metrics = {"1": {"output_tps": 100.0, "ttft_p99": 12.0}}
    for entry in ({"phase": "campaign", "outcome": "started", "objective": "output_tps@1", "campaign": "c"},
                  {"phase": "start", "trial": "base", "label": "base (baseline)", "campaign": "c",
                   "spec": {"server_args": {}, "env": "{}", "patches": []}, "script": "#!/bin/sh\n"},
                  {"phase": "done", "trial": "base", "label": "base (baseline)", "outcome": "ok", "objective": 100.0,
                   "metrics": metrics, "seconds": 3.0, "campaign": "c", "violations": []}):
        jsonl.append_entry(str(log), entry)
    with open(log, "ab") as fh:
        fh.write(b'["a", "list"]\n"a string"\n')
        fh.write(json.dumps({"phase": "done", "trial": "ghost", "seconds": "soon", "outcome": "ok"}).encode() + b"\n")
        fh.write(json.dumps({"phase": "done", "trial": "ghost2", "metrics": {"1": "fast"}}).encode() + b"\n")
        fh.write(b"[" * 100_000 + b"\n")
    jsonl.append_entry(str(log), {"phase": "leave", "trial": None, "outcome": "kept", "label": "base already deployed"})
    with open(log, "ab") as fh:
        fh.write(b'{"phase": "done", "trial": "torn", "outco')  # a write cut by a full disk


def test_tune_report_skips_and_names_damaged_lines(lab, tmp_path):
    results = tmp_path / "results"
    camp = tmp_path / "c.yml"
    camp.write_text(CAMPAIGN)
    log = results / "lab1" / "campaigns" / "c" / "trials.jsonl"
    finished_log(log)
    res = run_invoke("tune.report", str(camp), inventory=lab.inventory(), env={"SERVOPS_RESULTS": str(results)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "unexpected data" not in res.stderr
    warning = next(l for l in res.stderr.splitlines() if "unreadable entries skipped" in l)
    assert warning.startswith(f"warning: {log}: 6 unreadable entries skipped: line 4 (not a JSON object), "
                              "line 5 (not a JSON object), line 6 (seconds is not a number)"), warning
    md = (log.parent / "report.md").read_text()
    assert "6 unreadable entries skipped" in md and "**winner: base**" in md and "ghost" not in md


def test_tune_resume_skips_and_names_damaged_lines(lab, tmp_path):
    results = tmp_path / "results"
    camp = tmp_path / "c.yml"
    camp.write_text(CAMPAIGN)
    log = results / "lab1" / "campaigns" / "c" / "trials.jsonl"
    finished_log(log)
    res = run_invoke("tune", str(camp), "--resume", inventory=lab.inventory(), env={"SERVOPS_RESULTS": str(results)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lab1 : ok - campaign finished earlier (winner base)" in res.stdout
    assert "Traceback" not in res.stderr and "KeyError" not in res.stdout + res.stderr
    assert f"warning: {log}: 6 unreadable entries skipped: line 4 (not a JSON object)" in res.stderr
    assert not (lab.tmp / "deploy-lab1" / "releases").exists()  # finished: nothing deployed again


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_at_trials_jsonl_is_one_line(lab, tmp_path, kind):
    results = tmp_path / "results"
    camp = tmp_path / "c.yml"
    camp.write_text(CAMPAIGN)
    log = results / "lab1" / "campaigns" / "c" / "trials.jsonl"
    log.parent.mkdir(parents=True)
    os.mkfifo(log) if kind == "fifo" else log.mkdir()
    what = "a FIFO" if kind == "fifo" else "a directory"
    env = {"SERVOPS_RESULTS": str(results)}
    inv = lab.inventory()
    for args in (("tune.report", str(camp)), ("tune", str(camp), "--resume")):
        res = run_invoke(*args, inventory=inv, env=env, timeout=120)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert f"{log} is {what}, not a regular file" in res.stderr and "Errno" not in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    assert not (lab.tmp / "deploy-lab1" / "releases").exists()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_among_the_results_is_one_line(lab, tmp_path, kind):
    results = tmp_path / "results"
    d = results / "lab1" / "20260101T000000Z-baseline"
    d.mkdir(parents=True)
    bad = d / "20260101T000000Z.jsonl"
    os.mkfifo(bad) if kind == "fifo" else bad.mkdir()
    res = run_invoke("compare", "baseline", "piecewise", inventory=lab.inventory(),
                     env={"SERVOPS_RESULTS": str(results)}, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{bad} is {'a FIFO' if kind == 'fifo' else 'a directory'}, not a regular file" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "Errno" not in res.stderr
