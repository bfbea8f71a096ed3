"""Gate grammar, evaluation (failed requests, goodput, noise-aware comparisons) and validate()."""

import json

import pytest

from servops import bench
from servops.bench import BenchError, aggregate, parse_levels, parse_rate, parse_slo
from servops.gate import GateError, bench_options, evaluate, gate_levels, parse_gate, validate
from servops.push import validate_url


def level(concurrency, **kw):
    base = {"concurrency": concurrency, "requests": 20, "completed": 20, "failed": 0, "errors": {}}
    base.update(kw)
    return base


def test_gate_grammar_and_evaluation():
    conds = parse_gate("output_tps@1024 >= 1.02*baseline and ttft_p99@1 < 500")
    assert [str(c) for c in conds] == ["output_tps@1024 >= 1.02*baseline", "ttft_p99@1 < 500"]
    assert gate_levels(conds) == [1, 1024]
    run = {"variant": "piecewise", "host": "h", "levels": [level(1, ttft_p99=100.0), level(1024, output_tps=3100.0)]}
    base = {"levels": [level(1024, output_tps=3028.0)]}
    ok, lines = evaluate(conds, run, lambda v: base)
    assert ok and lines[0].startswith("pass: output_tps@1024 >= 1.02*baseline")
    assert any(line.startswith("pass: error_rate@1024 <= 0") for line in lines)  # implicit term
    run["levels"][1]["output_tps"] = 3050.0  # < 1.02 * 3028 = 3088.6
    ok, lines = evaluate(conds, run, lambda v: base)
    assert not ok and lines[0].startswith("FAIL")
    with pytest.raises(GateError, match="no saved bench of variant 'baseline'"):
        evaluate(conds, run, lambda v: None)


def test_bench_serving_names_latency_and_goodput_terms():
    conds = parse_gate("p99_ttft_ms@256 <= 500, goodput@256 >= 0.95, slo(ttft:500,tpot:50), median_tpot_ms@256 < 40")
    assert [c.metric for c in conds] == ["ttft_p99", "goodput", "tpot_p50"]
    assert bench_options(conds) == {"slo": {"ttft": 500.0, "tpot": 50.0}}
    run = {"levels": [level(256, ttft_p99=420.0, goodput=0.97, tpot_p50=30.0)]}
    ok, lines = evaluate(conds, run, lambda v: None)
    assert ok, lines
    run["levels"][0]["goodput"] = 0.5
    ok, lines = evaluate(conds, run, lambda v: None)
    assert not ok and "FAIL: goodput@256 >= 0.95" in "\n".join(lines)


def test_failed_requests_fail_the_gate_unless_allowed():
    # issue 9.11: 17 of 20 requests failed and the gate still passed
    run = {"stopped": "level 8: 17 of 20 requests failed", "levels": [
        level(8, completed=3, failed=17, output_tps=500.0, errors={"ClientConnectorError: refused": 17})]}
    ok, lines = evaluate(parse_gate("output_tps@8 >= 100"), run, lambda v: None)
    assert not ok
    assert "FAIL: error_rate@8 <= 0 (17 of 20 requests failed = 0.85; e.g. ClientConnectorError: refused)" in lines
    ok, _ = evaluate(parse_gate("output_tps@8 >= 100, error_rate <= 0.9"), run, lambda v: None)
    assert ok
    ok, _ = evaluate(parse_gate("output_tps@8 >= 100, error_rate@8 <= 0.5"), run, lambda v: None)
    assert not ok
    # a level the bench never reached is a failure, not a crash
    ok, lines = evaluate(parse_gate("output_tps@16 >= 1"), run, lambda v: None)
    assert not ok and "no result at level 16: level 8: 17 of 20 requests failed" in lines[0]


def _repeated(values):
    runs = [{"concurrency": 64, "repeat": i, "requests": 10, "completed": 10, "failed": 0, "errors": {},
             "output_tps": v, "error_rate": 0.0} for i, v in enumerate(values)]
    return {"levels": aggregate(runs)}


def test_relative_gate_is_noise_aware():
    base = _repeated([1000.0, 1010.0, 990.0])
    # 3% better on average, but the runs scatter by more than that: not proven
    noisy = _repeated([1100.0, 960.0, 1030.0])
    ok, lines = evaluate(parse_gate("output_tps@64 >= 1.01*base"), noisy, lambda v: base)
    assert not ok and "the interval does not clear it" in lines[0], lines
    steady = _repeated([1040.0, 1042.0, 1038.0])
    ok, lines = evaluate(parse_gate("output_tps@64 >= 1.01*base"), steady, lambda v: base)
    assert ok and "difference +" in lines[0], lines
    lv = steady["levels"][0]
    assert lv["repeats"] == 3 and lv["ci95"]["output_tps"][0] < 1040 < lv["ci95"]["output_tps"][1]


@pytest.mark.parametrize("text,msg", [
    ("outptu_tps@1024 >= 1.02*baseline", "unknown metric 'outptu_tps'"),
    ("output_tps@ >= 3", "expected METRIC@LEVEL OP VALUE"),
    ("output_tps@1024 => 3", "expected METRIC@LEVEL OP VALUE"),
    ("", "--gate is empty"),
    ("   ", "--gate is empty"),
    ("output_tps@0 >= 1", "level 0: levels are concurrencies, 1 or more"),
    ("output_tps@-1 >= 1", "level -1"),
    ("output_tps >= 1", "give the level"),
    ("goodput@8 >= 0.9", "goodput needs the SLO"),
    ("error_rate <= 2", "error_rate <= FRACTION"),
    ("error_rate <= 0.1", "no term names a level"),
    ("output_tps@8 >= 1, slo(ttft:x)", "slo(ttft:x)"),
])
def test_gate_typos_are_clear(text, msg):
    with pytest.raises(GateError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse_gate(text)


def test_validate_before_touching_a_host(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS_ROOT", tmp_path)
    with pytest.raises(GateError, match="no variant 'nosuchvariant'"):
        validate(parse_gate("output_tps@1024 >= nosuchvariant"), "lab1", ["baseline", "piecewise"])
    with pytest.raises(GateError, match="no saved bench of variant 'baseline' on lab1"):
        validate(parse_gate("output_tps@1024 >= baseline"), "lab1", ["baseline"])
    with pytest.raises(GateError, match="--gate is empty"):
        validate([], "lab1", ["baseline"])
    d = tmp_path / "lab1" / "20250101T000000Z-baseline"
    d.mkdir(parents=True)
    (d / "old.json").write_text(json.dumps({"host": "lab1", "variant": "baseline", "complete": True,
                                            "levels": [{"concurrency": 8, "output_tps": 10.0}]}))
    validate(parse_gate("output_tps@8 >= baseline"), "lab1", ["baseline"])
    with pytest.raises(GateError, match="has no level 1024"):
        validate(parse_gate("output_tps@1024 >= baseline"), "lab1", ["baseline"])


def test_bench_options_parse():
    assert parse_levels("1,10,256,1024") == [1, 10, 256, 1024]
    for bad in ("1,x", "0", "-1", "4,0", ""):
        with pytest.raises(BenchError, match="--levels"):
            parse_levels(bad)
    assert parse_rate("inf") is None and parse_rate("8") == 8.0
    with pytest.raises(BenchError, match="--request-rate"):
        parse_rate("0")
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo("e2e:900") == {"e2el": 900.0}
    with pytest.raises(BenchError, match="--slo 'itl:5'"):
        parse_slo("itl:5")


@pytest.mark.parametrize("url", ["not a url", "ftp://x:9091", "http://", "pushgateway:9091", "http://h:port"])
def test_push_url_is_checked_up_front(url):
    from servops.errors import ServopsError

    with pytest.raises(ServopsError, match="--push"):
        validate_url(url)


def test_push_url_ok():
    assert validate_url("http://127.0.0.1:9091/") == "http://127.0.0.1:9091"


def test_gate_lines_print_plain_numbers_with_units():
    from servops.gate import num

    assert num(40123.4, "output_tps") == "40,123 tok/s" and "e+" not in num(1.5e6, "output_tps")
    assert num(512.34, "ttft_p99") == "512.3 ms" and num(0.95, "goodput") == "0.95"
    assert num(12.5, "request_rate") == "12.5 req/s"


def test_a_single_run_comparison_says_it_has_no_noise_estimate():
    """Issue 20.2: one run per side gives no interval; the gate line says so (with --repeat it
    gives the difference's interval instead, above)."""
    run = {"levels": [level(8, output_tps=1050.0)]}
    base = {"levels": [level(8, output_tps=1000.0)]}
    ok, lines = evaluate(parse_gate("output_tps@8 >= 1.02*base"), run, lambda v: base)
    assert ok and lines[0].endswith("; single run: no noise estimate)"), lines
    ok, lines = evaluate(parse_gate("output_tps@64 >= 1.01*base"), _repeated([1040.0, 1042.0, 1038.0]),
                         lambda v: _repeated([1000.0, 1010.0, 990.0]))
    assert "single run" not in lines[0] and "±" in lines[0]


def test_violations_read_as_what_failed():
    """Issue 20.4: a violated constraint as its measurement against its bound."""
    from servops.gate import verdicts, violation

    run = {"levels": [level(256, ttft_p99=742.2, output_tps=900.0, failed=3, completed=17)]}
    vs = verdicts(parse_gate("p99_ttft_ms@256 <= 300, output_tps@256 >= 1.02*base, error_rate <= 0.05"), run,
                  lambda v: {"levels": [level(256, output_tps=1000.0)]})
    assert [violation(v) for v in vs if not v.ok] == [
        "p99_ttft_ms@256 = 742.2 > 300", "output_tps@256 = 900.0 < 1.02*base = 1,020", "failed@256 = 15.0% > 5%"]
    vs = verdicts(parse_gate("output_tps@256 >= 1"), run, lambda v: None)
    assert [violation(v) for v in vs if not v.ok] == ["failed@256 = 3 of 20 requests > 0"]
