"""metrics / bench / compare / gate / push against the SGLang double, over real sshd."""

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from servops.lab.sshd import free_port
from conftest import playbooks_with, run_invoke




@pytest.fixture
def bench_lab(lab, tmp_path):
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    books = playbooks_with(tmp_path)
    env = {"SERVOPS_PLAYBOOKS": str(books), "SERVOPS_RESULTS": str(tmp_path / "results")}
    yield inv, books, env, tmp_path / "results"
    run_invoke("stop", "--grace", "2", inventory=inv)


def variant(books: Path, name: str, text: str) -> None:
    (books / f"{name}.yml").write_text(text)


def test_bench_numbers_match_the_configured_double(bench_lab):
    inv, books, env, results = bench_lab
    variant(books, "paced", "extends: baseline\nenv: {SGLANG_DOUBLE_TOKEN_DELAY: '0.02', SGLANG_DOUBLE_TTFT: '0.05'}\n")
    assert run_invoke("deploy", "--variant", "paced", inventory=inv, env=env).returncode == 0
    res = run_invoke("bench", "--levels", "1,4", "--requests", "8", "--output-len", "10", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    [saved] = list(results.glob("lab1/*-paced/*.json"))
    data = json.loads(saved.read_text())
    assert data["variant"] == "paced" and data["complete"] and data["servops_git"]
    for level in data["levels"]:
        assert level["completed"] == 8 and level["output_tokens"] == 80
        assert 17.0 <= level["itl_p50"] <= 30.0, level      # 20 ms per token
        assert 45.0 <= level["ttft_p50"] <= 80.0, level     # 50 ms to first token
        # e2e ~= ttft + 9 * itl
        assert 200.0 <= level["e2e_p50"] <= 320.0, level
    # /metrics reflects the same traffic
    res = run_invoke("metrics", "--json", inventory=inv, env=env)
    assert res.returncode == 0, res.stderr
    [m] = json.loads(res.stdout)
    assert m["ttft"]["count"] == 16 and 0.025 <= m["ttft"]["p50"] <= 0.1
    assert 0.01 <= m["itl"]["p50"] <= 0.025 and m["running"] == 0
    res = run_invoke("metrics", inventory=inv, env=env)
    assert res.returncode == 0 and "TTFT p50/p90/p99 ms" in res.stdout


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
    png = results / "lab1" / "compare-fast-vs-slow.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    # the slow variant cannot reach 1.02x the fast one: gate fails -> automatic rollback to 'slow'
    deployed = current_release(inv)
    res = run_invoke("deploy", "--variant", "slow", "--gate", "output_tps@8 >= 1.02*fast", inventory=inv, env=env)
    assert res.returncode != 0
    assert "gate FAIL: output_tps@8 >= 1.02*fast" in res.stdout
    assert f"rolled back to {deployed}" in res.stderr and current_release(inv) == deployed
    # and a gate it meets keeps the release
    res = run_invoke("deploy", "--variant", "fast", "--gate", "output_tps@8 >= 1.02*slow", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gate pass" in res.stdout and current_release(inv).endswith("-fast")
    bad = run_invoke("deploy", "--variant", "fast", "--gate", "outptu_tps@8 >= 1", inventory=inv, env=env)
    assert bad.returncode == 2 and "unknown metric 'outptu_tps'" in bad.stderr


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
    res = run_invoke("bench", "--levels", "4,8", "--requests", "16", "--output-len", "4", inventory=inv, env=env)
    assert res.returncode != 0
    assert "incomplete" in res.stdout + res.stderr and "partial results in" in res.stdout + res.stderr
    [saved] = list(results.glob("lab1/*-dies/*.json"))
    data = json.loads(saved.read_text())
    assert not data["complete"]
    assert data["levels"][0]["completed"] == 16  # the first level finished before the crash
    assert data["levels"][1]["failed"] > 0


def test_push_to_a_real_pushgateway(bench_lab, tmp_path):
    binary = shutil.which("prometheus-pushgateway") or "/usr/bin/prometheus-pushgateway"
    if not Path(binary).exists():
        pytest.fail("prometheus-pushgateway is not installed: run the README's install command")
    inv, books, env, results = bench_lab
    port = free_port()
    gw = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/metrics", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        assert run_invoke("deploy", "--variant", "baseline", "--push", url, inventory=inv, env=env).returncode == 0
        res = run_invoke("bench", "--levels", "2", "--requests", "4", "--output-len", "4", "--push", url,
                         inventory=inv, env=env)
        assert res.returncode == 0, res.stderr
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        assert 'servops_bench_output_tps{concurrency="2"' in text and 'instance="lab1"' in text
        assert "servops_deploy_timestamp_seconds{" in text and 'outcome="healthy"' in text
    finally:
        gw.terminate()
        gw.wait(5)
