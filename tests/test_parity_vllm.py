"""bench/parity_vllm_bench.py's report, from runs built here (no server; the real vLLM's own
histograms around vllm bench's measured requests are read in test_vllm_real.py). What the
server reference must do: take out the server running faster in one tool's runs than in the
other's, and leave a tool that measures wrong as far off as it is."""

from __future__ import annotations

import random
import statistics

import pytest

from conftest import bench_script


@pytest.fixture(scope="module")
def parity():
    return bench_script("parity_vllm_bench")


def run_at(speed: float, level: int, requests: int, client_ttft_ms: float = 2.0, throughput_skew: float = 1.0,
           servops: bool = True) -> dict:
    """One run against a server `speed` times slower than nominal (ITL 20 ms, TTFT 30 ms): every
    request 32 tokens; the client reads `client_ttft_ms` above the server's TTFT; a tool with
    throughput_skew != 1 computes its throughput over a wrong interval."""
    itl, ttft = 20.0 * speed, 30.0 * speed
    ttfts = [(ttft + client_ttft_ms) / 1000] * requests
    e2e = ttft + 31 * itl
    run = {"ttfts": ttfts, "start_times": [i * 0.01 for i in range(requests)], "mean_ttft_ms": statistics.mean(ttfts) * 1000,
           "median_ttft_ms": statistics.median(ttfts) * 1000, "mean_tpot_ms": itl, "median_itl_ms": itl,
           "output_throughput": level * 32 / (e2e / 1000) * throughput_skew, "request_throughput": level / (e2e / 1000),
           "input_per_request": 32.0, "server": {"ttft": ttft, "itl": itl, "e2e": e2e}}
    run["mean_e2e_latency_ms" if servops else "mean_e2el_ms"] = e2e + client_ttft_ms
    return run


def runs_of(speeds_ours, speeds_theirs, **ours) -> dict:
    return {"servops": {"4": [run_at(s, 4, 100, **ours) for s in speeds_ours]},
            "vllm": {"4": [run_at(s, 4, 100, servops=False) for s in speeds_theirs]}}


def test_the_server_running_faster_in_one_tools_runs_is_taken_out(parity, capsys):
    # the same client; the server 20% slower whenever vllm bench ran
    runs = runs_of([1.0, 1.02, 0.98], [1.2, 1.22, 1.18])
    worst = parity.report(runs)
    out = capsys.readouterr().out
    assert "max deviation as measured at concurrency 4: " in out
    raw = float(out.split("max deviation as measured at concurrency 4: ")[1].split("%")[0])
    # (a client's own fixed share of TTFT is rescaled with the server's: 2 ms read as 1.8-2.2)
    assert raw > 15 and worst < 2.0, out
    assert out.strip().splitlines()[-1] == f"max deviation at concurrency 4: {worst:.1f}%"


def test_a_tool_that_measures_wrong_stays_off(parity, capsys):
    # the server equally fast for both; servops' throughput over an interval 10% too short
    worst = parity.report(runs_of([1.0, 1.1, 0.9], [1.0, 1.1, 0.9], throughput_skew=1.1))
    assert worst == pytest.approx(10.0, abs=0.2), capsys.readouterr().out
    # or a client that adds 6 ms to every TTFT against vllm bench's 2: 4 ms of a ~32 ms TTFT
    worst = parity.report(runs_of([1.0, 1.3, 0.8], [1.0, 1.25, 0.85], client_ttft_ms=6.0))
    assert worst > 10, capsys.readouterr().out


def test_the_judged_p99_pools_every_rounds_steady_requests(parity, capsys):
    # each run's 2 slow requests (3x the server's TTFT) out of 100: a run's own p99 sits between
    # them and the rest, the pool's is theirs; rescaled, the pools of both tools agree
    runs = runs_of([1.0, 1.5, 0.7], [1.2, 0.9, 1.1])
    for tool in ("servops", "vllm"):
        for run in runs[tool]["4"]:
            run["ttfts"] = [t * (3.0 if i % 50 == 49 else 1.0) for i, t in enumerate(run["ttfts"])]
    parity.report(runs)
    out = capsys.readouterr().out
    assert judged_line(out, "TTFT p99 ms") < 1.0, out


def judged_line(out: str, label: str) -> float:
    """The deviation (%) of a figure in the table at the server's common speed (the second of
    its two rows: as measured, and at the common speed)."""
    lines = [l for l in out.splitlines() if l.split()[1:4] == label.split()]
    assert len(lines) == 2, out
    return float(lines[1].split()[6].rstrip("%"))


def test_a_first_wave_drawn_slow_in_one_tools_runs_does_not_move_the_judged_p99(parity, capsys):
    # the server equally fast for both, but vllm bench's first waves (4 of 100 requests) landed
    # in slow prefills, up to 5x the server's TTFT, a draw per run: the server's mean TTFT counts
    # them, the judged p99 (after the first wave) does not; its reference is the server's ITL,
    # which leaves those runs' later TTFTs unspread
    runs = runs_of([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    for run, slow_ms in zip(runs["vllm"]["4"], (120.0, 0.0, 60.0)):
        run["ttfts"] = [t + (slow_ms / 1000 if i < 4 else 0.0) for i, t in enumerate(run["ttfts"])]
        run["mean_ttft_ms"] = statistics.mean(run["ttfts"]) * 1000
        run["server"]["ttft"] = (96 * 30.0 + 4 * (30.0 + slow_ms)) / 100
    parity.report(runs)
    out = capsys.readouterr().out
    assert "( 4: TTFTs after the first wave rescaled by the server's ITL;" in out
    assert judged_line(out, "TTFT p99 ms") < 0.1, out
    # the mean over every request is rescaled by the server's TTFT over those same requests
    assert judged_line(out, "TTFT mean ms") < 2.0, out


def test_where_the_prefill_speed_moves_alone_the_judged_p99_follows_the_servers_ttft(parity, capsys):
    # the prefill (TTFT) 30% slower in one of servops' runs while the decode step (ITL) holds:
    # that run's later TTFTs follow the server's TTFT, and rescaled by it both pools agree
    runs = runs_of([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    for tool in ("servops", "vllm"):
        for run in runs[tool]["4"]:
            if run is runs["servops"]["4"][1]:
                run["server"]["ttft"] *= 1.3
            run["ttfts"] = [(run["server"]["ttft"] + 2.0) / 1000 * (3.0 if i % 50 == 49 else 1.0)
                            for i in range(len(run["ttfts"]))]
            run["mean_ttft_ms"] = statistics.mean(run["ttfts"]) * 1000
    parity.report(runs)
    out = capsys.readouterr().out
    assert "( 4: TTFTs after the first wave rescaled by the server's TTFT;" in out
    assert judged_line(out, "TTFT p99 ms") < 1.0, out


def test_a_run_without_its_server_reference_is_judged_as_measured(parity, capsys):
    runs = runs_of([1.0, 1.0, 1.0], [1.2, 1.2, 1.2])
    del runs["vllm"]["4"][1]["server"]
    worst = parity.report(runs)
    out = capsys.readouterr().out
    assert "(some runs have no server reference: judged as measured)" in out
    assert worst > 15 and out.strip().splitlines()[-1] == f"max deviation at concurrency 4: {worst:.1f}%"


def test_compact_takes_the_server_reference_only_over_exactly_the_measured_requests(parity, capsys):
    def line(count: float) -> dict:
        hists = {"ttft": {"count": count, "sum": 0.03 * count}, "itl": {"count": 31 * count, "sum": 0.62 * count},
                 "e2e": {"count": count, "sum": 0.65 * count}}
        return {"ttfts": [0.031] * 8, "start_times": list(range(8)), "total_input_tokens": 256, "completed": 8,
                "mean_ttft_ms": 31.0, "server_histograms": hists}

    run = parity.compact("vllm", line(8), 8)
    assert run["server"] == pytest.approx({"ttft": 30.0, "itl": 20.0, "e2e": 650.0})
    assert run["input_per_request"] == 32.0
    # warm-up requests in the window: no reference, and said
    assert "server" not in parity.compact("vllm", line(12), 8)
    assert "did not count the 8 measured requests" in capsys.readouterr().out


def test_the_resampled_interval_tells_a_real_p99_difference_from_noise(parity):
    rng = random.Random(7)

    def runs(scale: float) -> list[list[float]]:
        # 10 runs of 100 requests: a lognormal TTFT around 40 ms, each run's own speed +-10%
        out = []
        for _ in range(10):
            speed = rng.uniform(0.9, 1.1)
            out.append([0.040 * speed * scale * rng.lognormvariate(0, 0.25) for _ in range(100)])
        return out

    low, high = parity.resampled_interval(runs(1.0), runs(1.0))
    assert low < 0 < high
    low, high = parity.resampled_interval(runs(1.3), runs(1.0))
    assert 0 < low < 30 < high


def test_a_file_saved_mid_round_reports_the_levels_both_tools_ran(parity):
    runs = runs_of([1.0, 1.1], [1.0, 1.1])
    runs["servops"]["16"], runs["vllm"]["16"] = [run_at(1.0, 16, 100)], []
    kept, left_out = parity.measured_levels(runs)
    assert list(kept["servops"]) == list(kept["vllm"]) == ["4"] and left_out == ["16"]
    assert kept["servops"]["4"] is runs["servops"]["4"]


def test_tail_attribution_puts_each_slow_first_token_on_its_side():
    tail = bench_script("parity_vllm_tail")
    rows = []
    for i in range(200):  # one request every 0.8 s: TTFT 34 ms (server 32.5), step time 24 ms
        t = i * 0.8
        episode = 40 <= t < 60  # the engine runs 1.8x slower for 20 s
        speed = 1.8 if episode else 1.0
        row = {"i": i, "t": 1000.0 + t, "ttft_ms": 34.0 * speed, "server_ttft_ms": 32.5 * speed,
               "itl_ms": 24.0 * speed, "server_itl_ms": 24.0 * speed}
        if i in (10, 110):  # the client's side: the server's own TTFT normal
            row["ttft_ms"] = 60.0
        if i == 150:  # the server's alone, its step time normal
            row.update(ttft_ms=70.0, server_ttft_ms=68.5)
        rows.append(row)
    a = tail.attribute(rows)
    assert a["median"]["server_ttft_ms"] == 32.5
    assert sorted(r["i"] for r in a["slow"]) == sorted([10, 110, 150, *range(50, 75)])
    assert sorted(r["i"] for r in a["server_side"]) == list(range(50, 75)) + [150]
    assert sorted(r["i"] for r in a["engine_slow"]) == list(range(50, 75))
    assert a["slow_windows"] == [4, 5]  # 40-50 s and 50-60 s
    assert a["gap_median_ms"] == 1.5
