import math

import pytest

from servops.metrics import MetricsError, histogram_quantile, parse, parse_gpu_csv, summarise, window

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


def ranked(name: str, values: list[float], dp: list[int] | None = None) -> str:
    lines = [f"# TYPE {name} gauge"]
    for r, v in enumerate(values):
        extra = f',dp_rank="{dp[r]}"' if dp else ""
        lines.append(f'{name}{{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="{r}"{extra}}} {v}')
    return "\n".join(lines) + "\n"


def test_eight_tp_ranks_report_the_true_values_not_eight_times_them():
    # --enable-metrics-for-all-schedulers on TP8: every rank repeats its scheduler's state
    text = (ranked("sglang:num_running_reqs", [12] * 8) + ranked("sglang:num_queue_reqs", [3] * 8)
            + ranked("sglang:token_usage", [0.42 + 0.01 * r for r in range(8)])
            + ranked("sglang:cache_hit_rate", [0.25] * 8) + ranked("sglang:gen_throughput", [3100.0] * 8)
            + ranked("sglang:num_used_tokens", [52000] * 8))
    s = summarise(parse(text, "h"))
    assert (s["running"], s["queued"], s["gen_throughput"], s["used_tokens"]) == (12, 3, 3100.0, 52000)
    assert s["token_usage"] == pytest.approx(0.455) and s["token_usage_max"] == pytest.approx(0.49)
    assert s["cache_hit_rate"] == pytest.approx(0.25) and s["ranks"] == 8
    g = s["gauges"]["token_usage"]
    assert g["groups"] == 1 and g["min"] == pytest.approx(0.42) and list(g["per_rank"])[:2] == ["tp0", "tp1"]


def test_dp_groups_add_up_and_each_group_counts_once():
    # DP attention, dp 2 x attn-tp 4: two schedulers groups, rank 0 of each is its stats-logging rank
    dp = [0, 0, 0, 0, 1, 1, 1, 1]
    text = (ranked("sglang:num_running_reqs", [10, 10, 10, 10, 6, 6, 6, 6], dp)
            + ranked("sglang:token_usage", [0.5, 0.5, 0.5, 0.5, 0.3, 0.3, 0.3, 0.3], dp))
    s = summarise(parse(text, "h"))
    assert s["running"] == 16 and s["gauges"]["running"]["groups"] == 2
    assert s["token_usage"] == pytest.approx(0.4) and s["token_usage_max"] == pytest.approx(0.5)
    assert list(s["gauges"]["running"]["per_rank"])[4] == "dp1/tp4"


def test_rank_zero_only_is_the_value_itself():
    s = summarise(parse(ranked("sglang:num_running_reqs", [5]) + ranked("sglang:token_usage", [0.3]), "h"))
    assert s["running"] == 5 and s["token_usage"] == pytest.approx(0.3) and s["ranks"] == 1


HIST = """# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} {a}
sglang:time_to_first_token_seconds_bucket{{le="1.0",model_name="m"}} {b}
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {b}
sglang:time_to_first_token_seconds_count{{model_name="m"}} {b}
sglang:time_to_first_token_seconds_sum{{model_name="m"}} 1.0
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{{model_name="m"}} {b}
"""


def test_window_is_histogram_quantile_of_the_bucket_increase():
    first = summarise(parse(HIST.format(a=100, b=100), "h"))     # 100 fast requests so far
    second = summarise(parse(HIST.format(a=100, b=200), "h"))    # then 100 slow ones
    w = window(first, second, 10.0)
    assert second["ttft"]["p50"] == pytest.approx(0.1)           # since start: half are fast
    assert w["ttft"]["count"] == 100 and w["ttft"]["p50"] == pytest.approx(0.55)  # the window: all slow
    assert w["requests_per_s"] == pytest.approx(10.0)
    idle = window(second, second, 5.0)
    assert idle["ttft"]["p50"] is None and idle["requests_per_s"] == 0.0
    restarted = summarise(parse(HIST.format(a=3, b=4), "h"))     # counters went down: a restart
    w = window(second, restarted, 5.0)
    assert w["ttft"]["count"] == 4 and w["requests_per_s"] == pytest.approx(0.8)
    import json
    json.loads(json.dumps(second))  # JSON-safe (+Inf buckets as text)


def test_a_missing_ratio_prints_a_dash_not_a_dangling_percent():
    from servops.metrics import _pct_cell

    assert _pct_cell({"token_usage": None}, "token_usage") == "-"
    assert _pct_cell({"token_usage": 0.415}, "token_usage") == "41.5%"


def test_the_watch_table_keeps_p99_visible_at_120_columns():
    """Issue 20.5: at a terminal's 120 columns the windowed table kept p99 cut off ('…'); the
    watch layout (the window's p50/p99 in unbroken columns) shows every p99 whole."""
    from rich.console import Console

    from servops.metrics import metrics_table

    gauges = (ranked("sglang:num_running_reqs", [12] * 8) + ranked("sglang:num_queue_reqs", [3] * 8)
              + ranked("sglang:token_usage", [0.42 + 0.01 * r for r in range(8)])
              + ranked("sglang:cache_hit_rate", [0.25] * 8) + ranked("sglang:gen_throughput", [3100.0] * 8))
    first = summarise(parse(HIST.format(a=100, b=100) + gauges, "h"))
    row = dict(summarise(parse(HIST.format(a=1100, b=3100) + gauges, "h")), host="gpu-node-17", gpus=[])
    row["window"] = window(first, row, 2.0)
    p99 = f"{row['window']['ttft']['p99'] * 1000:.1f}"
    con = Console(width=120, record=True, color_system=None)
    con.print(metrics_table([row], 120))
    out = con.export_text()
    assert "…" not in out and max(len(l) for l in out.splitlines()) <= 120, out
    assert "TTFT p50/p99 ms" in out and p99 in out and "last 2s" in out and "gpu-node-17" in out, out
    wide = Console(width=250, record=True, color_system=None)
    wide.print(metrics_table([row], 250))  # room for everything: since start and the window, p90 too
    out = wide.export_text()
    assert "TTFT p50/p90/p99 ms" in out and "TTFT last 2s" in out, out
