"""diagnose on hostile logs (issue 48), through the real CLI and the real sshd lab host: time linear in
the log's size whatever one line holds, a log of one huge line read (bounded) and its failure
reported, a user's traceback quoted inside a logged request read as data. The hostile input is
made here, to size (servops/lab/hostile_logs.py); bench/diagnose_linear.py prints the timings."""

import json
import time

from conftest import REPO, run_invoke
from servops.diagnose import evidence
from servops.lab import hostile_logs
from servops.remote.logscan import MAX_LINE, normalise
from servops.remote.tracebacks import scan

REAL = REPO / "tests" / "fixtures" / "real"
OOM = "matched: cuda-out-of-memory (cuda-oom); action: change flag --mem-fraction-static"


def test_what_any_pattern_sees_is_bounded_whatever_the_log_holds():
    # counted, not timed: every line a pattern runs over is at most MAX_LINE characters, and the
    # evidence the knowledge base and the category read of a failure at most 200 lines of 2,000
    text = hostile_logs.mixed(3_000_000) + hostile_logs.one_huge_line(2_000_000)
    assert max(len(ln.text) for ln in normalise(text)) <= MAX_LINE
    # (a table cell continued over a megabyte of rows is joined in lines of at most MAX_LINE too)
    assert max(len(ln.text) for ln in normalise(hostile_logs.table_cell_continued(1_000_000, width=3))) <= MAX_LINE
    findings = scan(text)["findings"]
    assert findings and all(len(evidence(f).text) <= 200 * 2001 for f in findings)
    assert all(len(f["root_exception"]) <= 2000 for f in findings)


def test_ten_megabytes_of_hostile_lines_take_time_linear_in_their_size(lab, tmp_path):
    inv = lab.inventory()
    took = []
    for size in (1_000_000, 10_000_000):
        log = tmp_path / f"hostile-{size}.log"
        log.write_text(hostile_logs.mixed(size))
        start = time.perf_counter()
        res = run_invoke("diagnose", "--log", str(log), inventory=inv, timeout=600)
        took.append(time.perf_counter() - start)
        assert res.returncode == 1, res.stderr
        assert res.stdout.strip().splitlines()[-1] == OOM  # the real failure after the hostile lines
    # one run measures both (the 100 kB lines alone took 45 s each before): linear time is about
    # 10x; the bound is generous for a busy machine
    assert took[1] < 25 * took[0], took


def test_a_log_of_one_fifty_megabyte_line_is_a_failure_offline_and_on_the_host(lab, tmp_path):
    inv = lab.inventory()
    text = hostile_logs.one_huge_line(50_000_000)
    log = tmp_path / "one-line.log"
    log.write_text(text)
    res = run_invoke("diagnose", "--offline", "--log", str(log), inventory=inv)
    assert res.returncode == 1, res.stderr
    assert "root cause: RuntimeError: the engine failed: xxxx" in res.stdout
    assert "only the last 16 MiB of the log was read" in res.stdout
    # on the host: the failed release's own server.log
    release = lab.tmp / "deploy-lab1" / "releases" / "20261207T000000Z-baseline"
    release.mkdir(parents=True)
    (release / "release.json").write_text(json.dumps({"status": "failed", "variant": "baseline"}))
    (release / "server.log").write_text(text)
    res = run_invoke("diagnose", "--json", inventory=inv)
    assert res.returncode == 1, res.stderr
    [row] = [json.loads(line) for line in res.stdout.splitlines()]
    assert row["root_exception"].startswith("RuntimeError: the engine failed: xxxx") and row["verdict"] == "unexplained"
    assert row["release"] == "20261207T000000Z-baseline"


def test_a_users_traceback_inside_a_logged_request_is_data(lab, tmp_path):
    inv = lab.inventory()
    # a real vLLM request line and a real line of it serving (kserve/kserve#4470, the healthy fixture)
    real = (REAL / "healthy" / "kserve-4470-received-request-prompt.log").read_text().splitlines()
    request, served = real[0], real[3]
    log = tmp_path / "served.log"
    log.write_text(hostile_logs.logged_request_quoting_a_traceback(served, request))
    res = run_invoke("diagnose", "--log", str(log), inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "no errors found" and "drain host" not in res.stdout
    # the server's own failure after such a request is still its failure
    log.write_text(log.read_text() + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    res = run_invoke("diagnose", "--log", str(log), inventory=inv)
    assert res.returncode == 1 and res.stdout.strip().splitlines()[-1] == OOM
