import math

import pytest

from servops.bench import BenchError, parse_levels
from servops.gate import GateError, evaluate, gate_levels, parse_gate
from servops.metrics import MetricsError, histogram_quantile, parse, parse_gpu_csv, summarise
from servops.remote.loadgen import pct, summarize

TEXT = """# HELP sglang:time_to_first_token_seconds TTFT
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 10.0
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="m"} 20.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 20.0
sglang:time_to_first_token_seconds_count{model_name="m"} 20.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 2.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7.0
"""


def test_histogram_quantile_interpolates_like_prometheus():
    b = [(0.1, 10.0), (0.2, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(0.1)
    assert histogram_quantile(0.75, b) == pytest.approx(0.15)
    assert histogram_quantile(0.5, [(math.inf, 0.0)]) is None


def test_summarise_sglang_names():
    s = summarise(parse(TEXT, "h"))
    assert s["running"] == 7.0 and s["ttft"]["count"] == 20.0
    assert s["ttft"]["p50"] == pytest.approx(0.1) and s["ttft"]["p99"] == pytest.approx(0.198)


def test_malformed_metrics_is_a_clear_error():
    with pytest.raises(MetricsError, match="h: /metrics is not valid Prometheus text"):
        parse('sglang:num_running_reqs{model_name="x" 3\n{{not prometheus', "h")


def test_gpu_csv():
    assert parse_gpu_csv("0, 97, 170000, 183359\n1, 95, 169000, 183359\n")[1] == \
        {"index": 1, "util": 95.0, "mem_used_mib": 169000.0, "mem_total_mib": 183359.0}


def test_gate_grammar_and_evaluation():
    conds = parse_gate("output_tps@1024 >= 1.02*baseline and ttft_p99@1 < 500")
    assert [str(c) for c in conds] == ["output_tps@1024 >= 1.02*baseline", "ttft_p99@1 < 500"]
    assert gate_levels(conds) == [1, 1024]
    run = {"variant": "piecewise", "host": "h", "levels": [{"concurrency": 1, "ttft_p99": 100.0},
                                                          {"concurrency": 1024, "output_tps": 3100.0}]}
    base = {"levels": [{"concurrency": 1024, "output_tps": 3028.0}]}
    ok, lines = evaluate(conds, run, lambda v: base)
    assert ok and lines[0].startswith("pass: output_tps@1024 >= 1.02*baseline")
    run["levels"][1]["output_tps"] = 3050.0  # < 1.02 * 3028 = 3088.6
    ok, lines = evaluate(conds, run, lambda v: base)
    assert not ok and lines[0].startswith("FAIL")
    with pytest.raises(GateError, match="no saved bench of variant 'baseline'"):
        evaluate(conds, run, lambda v: None)


@pytest.mark.parametrize("text,msg", [
    ("outptu_tps@1024 >= 1.02*baseline", "unknown metric 'outptu_tps'"),
    ("output_tps@ >= 3", "expected METRIC@LEVEL OP VALUE"),
    ("output_tps@1024 => 3", "expected METRIC@LEVEL OP VALUE"),
    ("", "--gate is empty"),
])
def test_gate_typos_are_clear(text, msg):
    with pytest.raises(GateError, match=msg):
        parse_gate(text)


def test_levels():
    assert parse_levels("1,10,256,1024") == [1, 10, 256, 1024]
    with pytest.raises(BenchError, match="--levels"):
        parse_levels("1,x")


def test_loadgen_summary_math():
    recs = [{"ok": True, "ttft": 0.1, "itl": [0.01, 0.03], "e2e": 0.2, "output_tokens": 3, "error": None},
            {"ok": False, "ttft": None, "itl": [], "e2e": None, "output_tokens": 0, "error": "HTTP 503"}]
    s = summarize(8, recs, 2.0)
    assert (s["completed"], s["failed"], s["output_tps"], s["errors"]) == (1, 1, 1.5, {"HTTP 503": 1})
    assert s["itl_p50"] == pytest.approx(20.0) and s["ttft_p50"] == pytest.approx(100.0)
    assert pct([1, 2, 3, 4], 50) == 2.5
