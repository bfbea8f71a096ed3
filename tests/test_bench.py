"""metrics / bench / compare / gate / push against the SGLang double, over real sshd."""

import base64
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from servops.bench import load_result
from servops.lab.sshd import free_port
from conftest import playbooks_with, run_invoke, wait_for




@pytest.fixture
def bench_lab(lab, tmp_path):
    # a secret whose value the double streams (" tok3"): results and output must mask it (issue 9.14)
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port(), "bench_api_token": "tok3"}})
    books = playbooks_with(tmp_path)
    env = {"SERVOPS_PLAYBOOKS": str(books), "SERVOPS_RESULTS": str(tmp_path / "results")}
    yield inv, books, env, tmp_path / "results"
    run_invoke("stop", "--grace", "2", inventory=inv)


def variant(books: Path, name: str, text: str) -> None:
    (books / f"{name}.yml").write_text(text)


def saved(results: Path, pattern: str) -> dict:
    [path] = list(results.glob(pattern))
    return load_result(path)


def test_bench_numbers_match_the_configured_double(bench_lab):
    inv, books, env, results = bench_lab
    variant(books, "paced", "extends: baseline\nenv: {SGLANG_DOUBLE_TOKEN_DELAY: '0.02', SGLANG_DOUBLE_TTFT: '0.05'}\n")
    assert run_invoke("deploy", "--variant", "paced", inventory=inv, env=env).returncode == 0
    res = run_invoke("bench", "--levels", "1,4", "--requests", "8", "--output-len", "10", "--slo", "ttft:500,tpot:10",
                     inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TPOT p50 ms" in res.stdout and "goodput" in res.stdout and "counted in words" in res.stdout
    assert "lab1: level 4 [2/2]: 8/8 ok" in res.stderr
    data = saved(results, "lab1/*-paced/*.jsonl")
    assert data["variant"] == "paced" and data["complete"] and data["servops_git"]
    text = Path(data["path"]).read_text()
    assert "tok3" not in text and " tok2***" not in text and " ***" in text and "tok3" not in res.stdout + res.stderr
    for level in data["levels"]:
        assert level["completed"] == 8 and level["output_tokens"] == 80 and level["failed"] == 0
        assert 17.0 <= level["itl_p50"] <= 30.0, level      # 20 ms per token
        assert 45.0 <= level["ttft_p50"] <= 85.0, level     # 50 ms to first token
        assert 200.0 <= level["e2e_p50"] <= 330.0, level    # e2e ~= ttft + 9 * itl
        # TPOT is e2e less TTFT over the 9 later tokens: a first token read late (the client descheduled
        # on a loaded machine: seen, 15 ms) moves time from TPOT to TTFT, so its interval is what those allow
        assert (200.0 - 85.0) / 9 <= level["tpot_p50"] <= (330.0 - 45.0) / 9, level
        assert level["goodput"] == 0.0 and level["slo_attainment_by_metric"] == {"ttft": 1.0, "tpot": 0.0}  # TPOT ~20 > 10
        assert level["server"]["requests"] == 8             # the server's own count for the level
    # the default warm-up: waves at each level's concurrency until their TTFT settled
    for level in data["levels"]:
        warm = level["warmup"]
        assert warm["mode"] == "adaptive" and warm["converged"] is True and len(warm["waves"]) >= 2, warm
    assert "warm-up 2 waves, 16 requests" in res.stderr or "warm-up 3 waves, 24 requests" in res.stderr, res.stderr
    # /metrics reflects the same traffic (+ the warm-up requests of each level)
    res = run_invoke("metrics", "--json", inventory=inv, env=env)
    assert res.returncode == 0, res.stderr
    [m] = json.loads(res.stdout)
    assert m["ttft"]["count"] == 16 + sum(lv["warmup"]["requests"] for lv in data["levels"])
    assert 0.025 <= m["ttft"]["p50"] <= 0.1
    assert 0.01 <= m["itl"]["p50"] <= 0.025 and m["running"] == 0
    res = run_invoke("metrics", inventory=inv, env=env)
    assert res.returncode == 0 and "TTFT p50/p90/p99 ms" in res.stdout


def test_bench_input_is_checked_before_any_connection(tmp_path):
    env = {"SERVOPS_RESULTS": str(tmp_path)}
    for args, msg in ((["--requests=-5"], "--requests -5: must be 0 or more"),
                      (["--levels", "0"], "--levels '0': each level must be 1 or more"),
                      (["--levels=-1"], "--levels '-1': each level must be 1 or more"),
                      (["--push", "not a url"], "--push 'not a url': expected a Pushgateway URL"),
                      (["--slo", "ttft=5"], "--slo 'ttft=5'"),
                      (["--request-rate", "0"], "--request-rate '0': must be more than 0"),
                      (["--repeat", "0"], "--repeat 0: must be 1 or more"),
                      (["--dataset", "sharegpt"], "give the file with --dataset-path")):
        res = run_invoke("bench", "-H", "nosuchhost-but-never-reached", *args, env=env)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert msg in res.stderr and len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)


def test_compare_and_metric_gate(bench_lab):
    inv, books, env, results = bench_lab
    variant(books, "fast", "extends: baseline\nenv: {SGLANG_DOUBLE_TOKEN_DELAY: '0.002'}\n")
    variant(books, "slow", "extends: baseline\nenv: {SGLANG_DOUBLE_TOKEN_DELAY: '0.02'}\n")
    for name in ("fast", "slow"):
        assert run_invoke("deploy", "--variant", name, inventory=inv, env=env).returncode == 0
        res = run_invoke("bench", "--levels", "1,8", "--requests", "8", "--output-len", "8", inventory=inv, env=env)
        assert res.returncode == 0, res.stderr
    res = run_invoke("compare", "fast", "slow", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 0, res.stderr
    assert "Δ slow" in res.stdout and "output tok/s" in res.stdout
    # one run each: every delta says it has no noise estimate (issue 20.2)
    deltas = [l for l in res.stdout.splitlines() if "%" in l]
    assert deltas and all("(single run: no noise estimate)" in l for l in deltas), res.stdout
    png = results / "lab1" / "compare-fast-vs-slow.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    from test_compare_plot import check_figure

    fig = check_figure({v: saved(results, f"lab1/*-{v}/*.jsonl") for v in ("fast", "slow")})
    assert "single run: no noise estimate" in fig._suptitle.get_text()
    # the slow variant cannot reach 1.02x the fast one: gate fails -> automatic rollback to 'slow'
    deployed = current_release(inv)
    res = run_invoke("deploy", "--variant", "slow", "--gate", "output_tps@8 >= 1.02*fast", inventory=inv, env=env)
    assert res.returncode != 0
    assert "gate FAIL: output_tps@8 >= 1.02*fast" in res.stdout and "single run: no noise estimate" in res.stdout
    assert f"rolled back to {deployed}" in res.stderr and current_release(inv) == deployed
    # and a gate it meets keeps the release
    res = run_invoke("deploy", "--variant", "fast", "--force", "--gate", "output_tps@8 >= 1.02*slow", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gate pass" in res.stdout and current_release(inv).endswith("-fast")
    bad = run_invoke("deploy", "--variant", "fast", "--force", "--gate", "outptu_tps@8 >= 1", inventory=inv, env=env)
    assert bad.returncode == 2 and "unknown metric 'outptu_tps'" in bad.stderr


def test_a_noisy_server_repeated_gets_intervals_and_noise_marks(bench_lab):
    """Issue 20.2 with --repeat: two variants of one setting on a server whose runs scatter by
    +-25% (RUN_JITTER): compare shows each value's 95% interval, calls a difference the
    intervals cannot tell apart "(noise)", and the single-run note is gone."""
    inv, books, env, results = bench_lab
    noisy = "extends: baseline\nenv: {SGLANG_DOUBLE_TOKEN_DELAY: '0.004', SGLANG_DOUBLE_RUN_JITTER: '0.25'}\n"
    for name in ("noisy-a", "noisy-b"):
        variant(books, name, noisy)
        assert run_invoke("deploy", "--variant", name, inventory=inv, env=env).returncode == 0
        res = run_invoke("bench", "--levels", "4", "--requests", "8", "--output-len", "16", "--repeat", "4",
                         "--warmup", "0", inventory=inv, env=env)
        assert res.returncode == 0, res.stderr
        assert "mean of 4 runs ±95% interval" in res.stdout
    a = saved(results, "lab1/*-noisy-a/*.jsonl")["levels"][0]
    lo, hi = a["ci95"]["output_tps"]
    assert len(a["samples"]["output_tps"]) == 4 and hi - lo > 0.02 * a["output_tps"]  # the runs really scatter
    res = run_invoke("compare", "noisy-a", "noisy-b", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 0, res.stderr
    tps = next(l for l in res.stdout.splitlines() if "output tok/s" in l)
    assert tps.count("±") == 2, tps
    assert "(noise)" in res.stdout and "single run" not in res.stdout, res.stdout
    assert "(noise): the 95% interval of the difference includes 0" in res.stdout


def current_release(inv: Path) -> str:
    import os
    import yaml
    root = yaml.safe_load(inv.read_text())["all"]["children"]["lab"]["hosts"]["lab1"]["deploy_root"]
    return os.readlink(Path(root) / "current").split("/")[-1]


def test_malformed_metrics_is_a_clear_error(bench_lab):
    inv, books, env, _ = bench_lab
    variant(books, "broken", "extends: baseline\nenv: {SGLANG_DOUBLE_BROKEN_METRICS: '1'}\n")
    assert run_invoke("deploy", "--variant", "broken", inventory=inv, env=env).returncode == 0
    res = run_invoke("metrics", inventory=inv, env=env)
    assert res.returncode == 2 and "/metrics is not valid Prometheus text" in res.stderr


def test_server_down_mid_bench_keeps_partial_results(bench_lab):
    inv, books, env, results = bench_lab
    variant(books, "dies", "extends: baseline\nenv: {SGLANG_DOUBLE_EXIT_AFTER_REQUESTS: '20', SGLANG_DOUBLE_TOKEN_DELAY: '0.005'}\n")
    assert run_invoke("deploy", "--variant", "dies", inventory=inv, env=env).returncode == 0
    # one warm-up request per level: the server dies in the second level (its 20th request)
    res = run_invoke("bench", "--levels", "4,8", "--requests", "16", "--output-len", "4", "--warmup", "1",
                     inventory=inv, env=env)
    assert res.returncode != 0
    assert "incomplete" in res.stdout + res.stderr and "partial results in" in res.stdout + res.stderr
    data = saved(results, "lab1/*-dies/*.jsonl")
    assert not data["complete"]
    assert data["levels"][0]["completed"] == 16  # the first level finished before the crash
    assert data["levels"][1]["failed"] > 0 and data["levels"][1]["completed"] < 16
    assert data["levels"][1]["errors"] and "requests failed (" in data["stopped"]
    assert data["stopped"].endswith("the bench stopped there")
    [path] = list(results.glob("lab1/*-dies/*.jsonl"))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 2 and len(lines[1]["errors"]) == 16 and lines[1]["servops"]["failed"] > 0


def test_push_to_a_real_pushgateway(bench_lab, tmp_path):
    binary = shutil.which("prometheus-pushgateway") or "/usr/bin/prometheus-pushgateway"
    if not Path(binary).exists():
        pytest.fail("prometheus-pushgateway is not installed: run the README's install command")
    inv, books, env, results = bench_lab
    port = free_port()
    # the gateway demands basic auth: servops must send the URL's user:password as credentials
    password = "gw-Secret-42"
    config = tmp_path / "web.yml"
    config.write_text("basic_auth_users:\n  ops: " + bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode() + "\n")
    gw = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}", f"--web.config.file={config}"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    auth = {"Authorization": "Basic " + base64.b64encode(f"ops:{password}".encode()).decode()}

    def scrape() -> str:
        return urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=auth),
                                      timeout=5).read().decode()
    try:
        url = f"http://ops:{password}@127.0.0.1:{port}"
        def up() -> bool:
            try:
                return bool(scrape() or True)
            except OSError:
                return False

        wait_for(up, what="the pushgateway answering")
        with pytest.raises(urllib.error.HTTPError):  # the gateway really refuses a push without credentials
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        res = run_invoke("deploy", "--variant", "baseline", "--push", url, inventory=inv, env=env)
        assert res.returncode == 0 and password not in res.stdout + res.stderr, res.stderr
        res = run_invoke("bench", "--levels", "2", "--requests", "4", "--output-len", "4", "--push", url,
                         inventory=inv, env=env)
        assert res.returncode == 0 and password not in res.stdout + res.stderr, res.stderr
        text = scrape()
        assert 'servops_bench_output_tps{concurrency="2"' in text and 'instance="lab1"' in text
        assert "servops_deploy_timestamp_seconds{" in text and 'outcome="healthy"' in text
    finally:
        gw.terminate()
        gw.wait(5)
