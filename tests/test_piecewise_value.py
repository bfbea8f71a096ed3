"""bench/piecewise_value.py (issue #46.2's table) on a real campaign over the sshd lab: the double
paced as a batched GPU server, two variants each benched on fresh starts until sure (up to 2
runs), then the Markdown table of TTFT / output tok/s / TPOT with intervals and every start's
phases, as it would be printed from the GPU kit's campaigns."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO, bench_script, playbooks_with, run_invoke
from servops.campaignrecord import read_log
from servops.lab.sshd import free_port

pv = bench_script("piecewise_value")

PACED = """extends: baseline
env: {SGLANG_DOUBLE_TOKEN_DELAY: '0.004', SGLANG_DOUBLE_STEP_PER_SEQ: '0.001', SGLANG_DOUBLE_EAGER_FACTOR: '3',
      SGLANG_DOUBLE_TTFT: '0.01', SGLANG_DOUBLE_CAPTURE_PER_BS: '0.02', SGLANG_DOUBLE_LOAD_TIME: '0.3'}
server_args: {cuda-graph-max-bs: 1}
"""
CAMPAIGN = """base: pvbase
candidates:
  - name: graphs
    server_args: {cuda-graph-max-bs: 8}
bench: {levels: [1, 4], requests: 8, input_len: 16, output_len: 8, warmup: 1, repeat: 2}
objective: {maximize: output_tps@4, constraints: ["failed == 0"], max_repeats: 2, repeat_by: restart, rebench_top: 2}
leave: base
"""


def test_the_table_shows_each_variant_with_intervals_and_its_start_up(lab, tmp_path):
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    camps, results = tmp_path / "camps", tmp_path / "results"
    camps.mkdir()
    (camps / "pv.yml").write_text(CAMPAIGN)
    env = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, pvbase=PACED)), "SERVOPS_RESULTS": str(results),
           "SERVOPS_CAMPAIGNS": str(camps)}
    try:
        res = run_invoke("tune", "pv", "-H", "lab1", inventory=inv, env=env, timeout=900)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        run_invoke("stop", "--grace", "2", "--break-lock", "-H", "lab1", inventory=inv)
    out = subprocess.run([sys.executable, "bench/piecewise_value.py", "-H", "lab1", "--results", str(results), "pv"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    table = out.stdout
    assert "Random weights: the kernels run at the real shape's speed" in table
    sections = table.split("\n\n")
    metric_rows, start_rows = ([l for l in next(s for s in sections if s.startswith(head)).splitlines()[2:]]
                               for head in ("| variant | concurrency", "| variant | starts"))
    assert [r.split(" | ")[1] for r in metric_rows] == ["1", "4", "1", "4"], table
    for row in metric_rows:  # every value a mean with its 95% interval over the trial's runs
        cells = row.split(" | ")
        assert all(re.fullmatch(r"[\d,.]+ ± [\d,.]+", c) for c in cells[2:5]), row
    assert "(base)" in metric_rows[0] and re.search(r"[+-]\d+\.\d% \[[+-]\d+\.\d, [+-]\d+\.\d\]", metric_rows[2])
    assert [r.split(" | ")[0] for r in start_rows] == ["| base (pvbase)", "| graphs"], table
    for row in start_rows:  # the deploy and each restart of the trial: time to healthy and its phases
        cells = row.split(" | ")
        one = r"[\d.]+ ± [\d.]+" if int(cells[1]) > 1 else r"[\d.]+ \(1 start\)"
        assert re.fullmatch(one, cells[2]) and re.fullmatch(one, cells[6]), row  # to healthy; capture
        assert cells[4] == cells[5] == "not in the log", row  # the double builds no JIT here, compiles nothing
    assert start_rows[0].split(" | ")[1] == "2"  # the base: its deploy and the restart before its repeat

    # the same releases benched outside a campaign (gpu_piecewise_8b.sh longpw): --releases, the first the base
    # (trials.jsonl's order), gives the same rows under the release names, and no start-up table
    ran = pv.trials(read_log(results / "lab1" / "campaigns" / "pv" / "trials.jsonl"))
    rel = subprocess.run([sys.executable, "bench/piecewise_value.py", "-H", "lab1", "--results", str(results),
                          "--releases", ",".join(t["release"] for t in ran)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rel.returncode == 0, rel.stderr
    rows = [l for l in rel.stdout.splitlines() if re.match(r"\| \S+ \| \d+ \|", l)]
    assert [r.split(" | ", 1)[1] for r in rows] == [r.split(" | ", 1)[1] for r in metric_rows], rel.stdout
    assert [r.split(" | ")[0] for r in rows] == [f"| {t['release']}" for t in ran for _ in (1, 4)]
    assert "| variant | starts" not in rel.stdout and "prompts 16 tokens, outputs 8 tokens" in rel.stdout
    for bad in ("../lab1", "20260101T000000Z-nope"):  # a path is refused; a release with no results is named
        res = subprocess.run([sys.executable, "bench/piecewise_value.py", "-H", "lab1", "--results", str(results),
                              "--releases", bad], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and bad in res.stderr.strip().splitlines()[-1], res.stderr
