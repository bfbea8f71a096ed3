"""A 16-trial TPE campaign on 4 lab hosts at once against the same campaign on 1 host: wall time.

Real sshd hosts on 127.0.0.2-5 (bench/_lab.py), the SGLang double as each host's server. The
hosts share this machine's cores, so the double is made to spend its time as a GPU server
does, loading weights: SGLANG_DOUBLE_LOAD_TIME (seconds with the port closed before it turns
healthy; set by the inventory's host `env`, as a site fact) dominates a trial, and the bench
is small. 30 s by default (a real TP8 load is 10-20 minutes): with 8 s, servops' own ~2 s of
CPU per deploy, four at once on 2 shared cores, is a third of a trial, which no GPU host sees. The budget counts every trial run: on 1 host the base and 15 sampled points, on 4
hosts each host's base and 12 points -- 16 deploys and benches either way.

    .venv/bin/python bench/tune_fleet.py            # last line: 4 hosts / 1 host wall time (goal <= 0.35)
    LOAD_TIME=8 .venv/bin/python bench/tune_fleet.py   # the contended case
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lab import REPO, BenchLab  # noqa: E402

LOAD_TIME = os.environ.get("LOAD_TIME", "30")
TRIALS = 16
CAMPAIGN = f"""description: fleet bench -- TPE over the double's decode graph size and running-request cap
base: baseline
search: tpe
seed: 1
overrides:
  server_args: {{cuda-graph-max-bs: 4}}
  env: {{SGLANG_DOUBLE_TOKEN_DELAY: "0.004", SGLANG_DOUBLE_STEP_PER_SEQ: "0.0005", SGLANG_DOUBLE_EAGER_FACTOR: "3"}}
candidates:
  - name: knobs
    grid:
      server_args:
        cuda-graph-max-bs: {{low: 4, high: 64, log: true}}
        max-running-requests: [4, 16]
bench: {{levels: [8], requests: 16, input_len: 16, output_len: 8, warmup: 0}}
objective:
  maximize: output_tps@8
  constraints: ["failed == 0"]
  min_gain: 2%
budget: {{max_trials: {TRIALS}}}
leave: best
"""


def tune(lab: BenchLab, hosts: str, env: dict, out: Path) -> float:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "invoke", "tune", "fleetbench", "-H", hosts], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    seconds = time.monotonic() - t0
    out.write_text(res.stdout)
    if res.returncode != 0:
        sys.exit(f"invoke tune -H {hosts} exited {res.returncode}:\n{res.stdout[-4000:]}")
    return seconds


def main() -> None:
    lab = BenchLab(n_hosts=4)
    try:
        cuda = lab.tmp / "cuda"
        cuda.mkdir()
        (cuda / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "12.9.1"}}')
        inv = yaml.safe_load(lab.inventory.read_text())
        inv["all"]["children"]["lab"]["vars"]["env"] = {"CUDA_HOME": str(cuda), "SGLANG_DOUBLE_LOAD_TIME": LOAD_TIME}
        lab.inventory.write_text(yaml.safe_dump(inv))
        camps = lab.tmp / "camps"
        camps.mkdir()
        (camps / "fleetbench.yml").write_text(CAMPAIGN)
        env = dict(os.environ, SERVOPS_INVENTORY=str(lab.inventory), SERVOPS_CAMPAIGNS=str(camps), NO_COLOR="1",
                   COLUMNS="200", PYTHONUNBUFFERED="1", SERVOPS_PERSIST="0")
        env.pop("SERVOPS_HOSTS", None)
        one = tune(lab, "lab1", dict(env, SERVOPS_RESULTS=str(lab.tmp / "results-1")), lab.tmp / "one-host.out")
        subprocess.run([sys.executable, "-m", "invoke", "stop", "--grace", "2", "-H", "lab1"], cwd=REPO, env=env,
                       capture_output=True)
        four = tune(lab, "lab1,lab2,lab3,lab4", dict(env, SERVOPS_RESULTS=str(lab.tmp / "results-4")),
                    lab.tmp / "four-hosts.out")
        subprocess.run([sys.executable, "-m", "invoke", "stop", "--grace", "2", "-H", "all"], cwd=REPO, env=env,
                       capture_output=True)
        print(f"campaign: TPE, {TRIALS} trials (every deploy + bench counted: on 4 hosts each host's base), the double "
              f"loading for {LOAD_TIME}s per deploy; outputs in {lab.tmp}/one-host.out and four-hosts.out")
        print(f"1 host:  {one:.1f}s")
        print(f"4 hosts: {four:.1f}s")
        print(f"4 hosts / 1 host = {four / one:.3f} (goal <= 0.35)")
    finally:
        lab.close()


if __name__ == "__main__":
    main()
