"""`invoke metrics`: scrape SGLang's /metrics on the host and summarise it.

The scrape runs on the host (the server port is usually not public); parsing is local, with
prometheus_client's own text parser. Histogram quantiles use Prometheus' histogram_quantile
rule (linear interpolation inside the bucket).
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from .errors import ServopsError
from .remote_exec import run_program
from .transport import HostSession

GAUGES = {
    "running": "sglang:num_running_reqs", "queued": "sglang:num_queue_reqs", "token_usage": "sglang:token_usage",
    "gen_throughput": "sglang:gen_throughput", "cache_hit_rate": "sglang:cache_hit_rate",
}
HISTOGRAMS = {
    "ttft": "sglang:time_to_first_token_seconds", "itl": "sglang:inter_token_latency_seconds",
    "e2e": "sglang:e2e_request_latency_seconds",
}
QUANTILES = (0.5, 0.9, 0.99)


class MetricsError(ServopsError):
    pass


def parse(text: str, where: str) -> dict[str, list]:
    """Family name -> samples. Raises MetricsError on text that is not Prometheus exposition."""
    families: dict[str, list] = {}
    try:
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, []).extend(fam.samples)
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError(f"{where}: /metrics is not valid Prometheus text: {exc}") from None
    if text.strip() and not families:
        raise MetricsError(f"{where}: /metrics returned no metrics")
    return families


def _family(families: dict, name: str) -> list:
    # The parser strips _total/_bucket suffixes into the family name; SGLang's names contain ':'
    return families.get(name) or families.get(name.replace(":", "_")) or []


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """buckets: (upper bound, cumulative count) sorted by bound, +Inf last."""
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def summarise(families: dict) -> dict:
    out: dict = {}
    for key, name in GAUGES.items():
        samples = [s for s in _family(families, name) if not s.name.endswith(("_created",))]
        out[key] = sum(s.value for s in samples) if samples else None
    for key, name in HISTOGRAMS.items():
        samples = _family(families, name)
        merged: dict[float, float] = {}
        for s in samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                merged[le] = merged.get(le, 0.0) + s.value
        buckets = sorted(merged.items())
        count = sum(s.value for s in samples if s.name.endswith("_count"))
        out[key] = {"count": count, **{f"p{int(q * 100)}": histogram_quantile(q, buckets) for q in QUANTILES}}
    return out


def parse_gpu_csv(text: str) -> list[dict]:
    """nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits"""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            gpus.append({"index": int(parts[0]), "util": float(parts[1]), "mem_used_mib": float(parts[2]),
                         "mem_total_mib": float(parts[3])})
        except ValueError:
            continue
    return gpus


def scrape(hs: HostSession) -> dict:
    port = int(hs.host.require("server_port"))
    res = run_program(hs, "scrape", {"port": port})
    where = f"{hs.host.name}:{port}"
    if res.get("fetch_error"):
        raise MetricsError(f"{where}: cannot fetch /metrics: {res['fetch_error']}")
    data = summarise(parse(res["text"], where))
    data["gpus"] = parse_gpu_csv(res.get("gpu_csv") or "")
    data["host"] = hs.host.name
    return data


def _fmt(v, scale=1.0, digits=1):
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_metrics(rows: list[dict]) -> None:
    from .output import console, print_table, table

    t = table("server metrics", ["host", "running", "queued", "token usage", "gen tok/s", "cache hit",
                                 "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "e2e p50/p99 s"])
    for r in rows:
        q = lambda h, s=1000.0: "/".join(_fmt(r[h][p], s) for p in ("p50", "p90", "p99"))
        t.add_row(r["host"], _fmt(r["running"], 1, 0), _fmt(r["queued"], 1, 0), _fmt(r["token_usage"], 100, 1) + "%",
                  _fmt(r["gen_throughput"]), _fmt(r["cache_hit_rate"], 100, 1) + "%", q("ttft"), q("itl"),
                  f"{_fmt(r['e2e']['p50'], 1, 2)}/{_fmt(r['e2e']['p99'], 1, 2)}")
    print_table(t)
    gpu_rows = [(r["host"], g) for r in rows for g in r["gpus"]]
    if gpu_rows:
        g = table("GPUs", ["host", "gpu", "util %", "memory used / total (MiB)"])
        for host, gpu in gpu_rows:
            g.add_row(host, str(gpu["index"]), f"{gpu['util']:.0f}", f"{gpu['mem_used_mib']:.0f} / {gpu['mem_total_mib']:.0f}")
        print_table(g)
