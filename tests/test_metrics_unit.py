import math

import pytest

from servops.metrics import MetricsError, histogram_quantile, parse, parse_gpu_csv, summarise

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
