"""Whose are the slow first tokens at concurrency 1: the server's, or the client's?

bench/parity_vllm_bench.py's p99 TTFT at concurrency 1 is the fifth or sixth slowest of a few
hundred requests, and it moved 2-21% between the two tools from one run to the next while every
mean agreed within 2.5%. This script takes the same lab (the real vLLM serving llama-h1024 as
the parity-vllm variant, deployed by servops on a real sshd host, the same CPU placement) and
sends requests one at a time from a plain client, reading the server's /metrics after each one:
at concurrency 1 the difference of the server's TTFT and ITL histogram sums between two reads
is that one request's TTFT and mean ITL as the server recorded them (exact sums, not buckets).
So each slow first token can be put on one side:

- the server's (its own TTFT is slow too): and then whether the engine's step time (the
  server's ITL) was slow in the same request, i.e. the whole engine ran slow for a while;
- the client's side (the server's TTFT normal, the client's slow): the HTTP path, the client,
  the API server's work before it stamps the request's arrival.

Prints the requests above 1.4x the median TTFT with both sides, the share of each, and the share
of 10-s windows in which the engine's median step time ran 20% above its median ("slow
windows"): a load generator that runs in one of those and another that does not see different
tails whatever they measure.

    python bench/parity_vllm_tail.py [--requests N] [--save FILE]
    python bench/parity_vllm_tail.py --report FILE
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import random
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("parity_vllm_bench", HERE / "parity_vllm_bench.py")
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)
loadgen = parity.loadgen  # (servops.remote.loadgen, as the parity script imports it)

SLOW = 1.4  # a request is slow above this multiple of the median TTFT (client's or server's own)
WINDOW_S = 10.0
SLOW_WINDOW = 1.2  # a window is slow where the engine's median step time is this far above its median


def server_snapshot(port: int) -> dict:
    """The server's /metrics, parsed as servops' load generator parses it (its hist_delta reads
    vLLM's histograms under the names it gives sglang's)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return loadgen.parse_prom(text)


def one_request(port: int, model: str, rng: random.Random, vocab: int) -> tuple[float, list[float]]:
    """Send one streamed completion (prompt and output 16-48 tokens, as the parity runs); return
    its send time and the arrival time of each token's chunk (perf_counter seconds)."""
    body = json.dumps({"model": model, "prompt": [rng.randrange(10, vocab) for _ in range(rng.randint(16, 48))],
                       "max_tokens": rng.randint(16, 48), "stream": True, "ignore_eos": True, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    arrivals, pending = [], b""
    while chunk := resp.read1(65536):
        now = time.perf_counter()
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            if event.startswith(b"data: {"):
                arrivals.append(now)
    conn.close()
    if len(arrivals) < 2:
        raise SystemExit(f"the server answered with {len(arrivals)} token chunks: {pending[:300]!r}")
    return sent, arrivals


def measure(requests: int) -> list[dict]:
    lab = parity.VllmLab()
    try:
        print(lab.invoke("deploy", "--variant", "parity-vllm").strip().splitlines()[-1], flush=True)
        print("CPU placement:", parity.place_cpus(lab.server_root / "releases", [lab.sshd.proc.pid, os.getpid()]))
        vocab = json.loads((lab.model / "config.json").read_text())["vocab_size"]
        rng = random.Random(1206)
        for _ in range(8):  # (warm-up, as both tools do)
            one_request(lab.port, str(lab.model), rng, vocab)
        rows, before = [], server_snapshot(lab.port)
        for i in range(requests):
            sent, arrivals = one_request(lab.port, str(lab.model), rng, vocab)
            after = server_snapshot(lab.port)
            ttft, itl = (loadgen.hist_delta(before, after, loadgen.HISTS[h]) for h in ("ttft", "itl"))
            if ttft is None or ttft["count"] != 1:
                raise SystemExit(f"request {i}: the server's TTFT histogram counted "
                                 f"{ttft and ttft['count']} requests, not 1")
            rows.append({"i": i, "t": sent, "ttft_ms": (arrivals[0] - sent) * 1000,
                         "itl_ms": (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1000,
                         "server_ttft_ms": ttft["sum"] * 1000,
                         "server_itl_ms": itl["sum"] / max(1, itl["count"]) * 1000})
            before = after
            if (i + 1) % 50 == 0:
                print(f"  {i + 1}/{requests} requests", flush=True)
        return rows
    finally:
        lab.close()


def attribute(rows: list[dict]) -> dict:
    """Which side each slow first token is on, and how the engine's step time moved (see the
    module's docstring)."""
    med = {k: statistics.median(r[k] for r in rows) for k in ("ttft_ms", "server_ttft_ms", "server_itl_ms")}
    slow = [r for r in rows if r["ttft_ms"] > SLOW * med["ttft_ms"]]
    server_side = [r for r in slow if r["server_ttft_ms"] > SLOW * med["server_ttft_ms"]]
    start = rows[0]["t"]
    windows: dict[int, list[float]] = {}
    for r in rows:
        windows.setdefault(int((r["t"] - start) // WINDOW_S), []).append(r["server_itl_ms"])
    slow_windows = [w for w, itls in windows.items() if statistics.median(itls) > SLOW_WINDOW * med["server_itl_ms"]]
    gaps = sorted(r["ttft_ms"] - r["server_ttft_ms"] for r in rows)
    return {"requests": len(rows), "median": med, "slow": slow, "server_side": server_side,
            "engine_slow": [r for r in server_side if r["server_itl_ms"] > SLOW_WINDOW * med["server_itl_ms"]],
            "windows": len(windows), "slow_windows": sorted(slow_windows),
            "gap_median_ms": statistics.median(gaps), "gap_p99_ms": loadgen.pct(gaps, 99)}


def report(rows: list[dict]) -> None:
    a = attribute(rows)
    med = a["median"]
    print(f"{a['requests']} requests at concurrency 1: median TTFT {med['ttft_ms']:.1f} ms here, "
          f"{med['server_ttft_ms']:.1f} ms the server's own; median step time (server ITL) {med['server_itl_ms']:.1f} ms")
    print(f"client above the server: median {a['gap_median_ms']:.2f} ms, p99 {a['gap_p99_ms']:.2f} ms")
    print(f"{'request':>7} {'s':>6} {'TTFT':>7} {'server':>7} {'ITL':>6} {'server ITL':>10}  side")
    server_side = {id(r) for r in a["server_side"]}
    for r in a["slow"]:
        print(f"{r['i']:>7} {r['t'] - rows[0]['t']:>6.1f} {r['ttft_ms']:>7.1f} {r['server_ttft_ms']:>7.1f} "
              f"{r['itl_ms']:>6.1f} {r['server_itl_ms']:>10.1f}  {'server' if id(r) in server_side else 'client side'}")
    n = len(a["slow"])
    print(f"slow first tokens (over {SLOW}x the median): {n} of {a['requests']} ({100 * n / a['requests']:.1f}%); "
          f"the server's own {len(a['server_side'])}, of which {len(a['engine_slow'])} with the engine's step time "
          f"{SLOW_WINDOW}x its median or more; on the client side {n - len(a['server_side'])}")
    print(f"slow {WINDOW_S:g}-s windows (the engine's median step time over {SLOW_WINDOW}x its median): "
          f"{len(a['slow_windows'])} of {a['windows']}"
          + (f" (at {', '.join(f'{w * WINDOW_S:g} s' for w in a['slow_windows'])})" if a["slow_windows"] else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--save", metavar="FILE", help="keep every request's figures here (JSON)")
    ap.add_argument("--report", metavar="FILE", help="print the report of a run saved with --save; runs nothing")
    opts = ap.parse_args()
    if opts.report:
        try:
            rows = json.loads(Path(opts.report).read_text())
            attribute(rows)
        except (OSError, ValueError, KeyError, TypeError, statistics.StatisticsError) as exc:
            ap.error(f"--report {opts.report}: not a run saved with --save ({type(exc).__name__}: {exc})")
    else:
        if opts.requests < 10:
            ap.error("--requests must be 10 or more")
        rows = measure(opts.requests)
        if opts.save:
            Path(opts.save).write_text(json.dumps(rows))
    report(rows)


if __name__ == "__main__":
    main()
