"""`invoke metrics`: scrape the server's /metrics (SGLang's or vLLM's) on the host and summarise it.

The scrape runs on the host (the server port is usually not public); parsing is local, with
prometheus_client's own text parser. Histogram quantiles use Prometheus' histogram_quantile
rule (linear interpolation inside the bucket).

Gauges with several TP ranks. SGLang's scheduler gauges carry the labels model_name, engine_type,
tp_rank, pp_rank, moe_ep_rank (and dp_rank under data parallelism); only the stats-logging
scheduler of each DP group (attn_tp_rank 0) reports them, unless
--enable-metrics-for-all-schedulers makes EVERY rank report its own series (multiprocess mode
"mostrecent"). TP ranks run one batch together, so their series repeat the same state: summing
them counts a TP8 server's requests and KV usage eight times. Each gauge is aggregated by what
it means:
  counts (running and queued requests, used tokens, generation throughput): as sglang itself
      reports them, one value per scheduler group: the group's lowest rank (its stats-logging
      rank), summed over groups (DP ranks);
  ratios (token usage, cache hit rate): the mean over every rank's series, and the max.
`gauges[...]["per_rank"]` keeps every series, and the min/max show a rank that disagrees.

`metrics --watch`: each scrape after the first also gets a window: histogram buckets and counters
of this scrape minus the previous one (Prometheus' histogram_quantile(rate(...)) over the
interval), next to the since-start quantiles.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from . import engines
from .errors import ServopsError
from .output import OK
from .remote_exec import run_program
from .transport import HostSession

COUNT, RATIO = "count", "ratio"
# servops' engine-neutral keys and how each gauge aggregates over ranks; each engine's metric
# names for them live in its room (servops.engines: sglang:num_running_reqs, vllm:num_requests_running).
GAUGES = {"running": COUNT, "queued": COUNT, "token_usage": RATIO, "gen_throughput": COUNT,
          "cache_hit_rate": RATIO, "used_tokens": COUNT}
HISTOGRAMS = ("ttft", "itl", "e2e")
COUNTERS = ("requests", "prompt_tokens", "generation_tokens")
QUANTILES = (0.5, 0.9, 0.99)
# Labels that tell the ranks of ONE scheduler group apart (their series are replicas).
RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")


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
    if not buckets or buckets[-1][1] <= 0:
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


def _rank_key(labels: dict) -> tuple:
    def num(v):
        try:
            return int(v)
        except (TypeError, ValueError):
            return 0
    return tuple(num(labels.get(k)) for k in ("tp_rank", "pp_rank", "moe_ep_rank"))


def _rank_name(labels: dict) -> str:
    parts = [f"dp{labels['dp_rank']}"] if "dp_rank" in labels else []
    parts += [f"tp{labels['tp_rank']}"] if "tp_rank" in labels else []
    parts += [f"pp{labels['pp_rank']}"] if labels.get("pp_rank") not in (None, "0") else []
    return "/".join(parts) or "-"


def aggregate_gauge(samples: list, kind: str) -> dict | None:
    """One gauge's series -> {"value", "mean", "min", "max", "ranks", "groups", "per_rank"}
    (see the module doc for what "value" is per kind)."""
    series = [s for s in samples if not s.name.endswith("_created")]
    if not series:
        return None
    groups: dict[tuple, list] = {}
    for s in series:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k not in RANK_LABELS))
        groups.setdefault(key, []).append(s)
    values = [s.value for s in series]
    mean = sum(values) / len(values)
    if kind == COUNT:
        value = sum(min(members, key=lambda s: _rank_key(s.labels)).value for members in groups.values())
    else:
        value = mean
    per_rank = {}
    for s in sorted(series, key=lambda s: (s.labels.get("dp_rank", ""), _rank_key(s.labels))):
        per_rank[_rank_name(s.labels)] = s.value
    return {"value": value, "mean": mean, "min": min(values), "max": max(values), "ranks": len(series),
            "groups": len(groups), "per_rank": per_rank}


def _buckets(samples: list) -> tuple[list[tuple[float, float]], float, float]:
    merged: dict[float, float] = {}
    count = total = 0.0
    for s in samples:
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            merged[le] = merged.get(le, 0.0) + s.value
        elif s.name.endswith("_count"):
            count += s.value
        elif s.name.endswith("_sum"):
            total += s.value
    return sorted(merged.items()), count, total


def _quantiles(buckets: list[tuple[float, float]], count: float) -> dict:
    return {"count": count, **{f"p{int(q * 100)}": histogram_quantile(q, buckets) for q in QUANTILES}}


def _named(families: dict, kind: str, key: str) -> str | None:
    """The metric name this server reports for servops' `key`: the first engine's (sglang first)
    that is present; else the default engine's name (absent: no samples), None where no engine has one."""
    names = engines.metric_names(kind, key)
    for name in names:
        if _family(families, name) or _family(families, name + "_bucket") or _family(families, name + "_total"):
            return name
    return names[0] if names else None


def summarise(families: dict) -> dict:
    out: dict = {"gauges": {}, "raw": {"histograms": {}, "counters": {}}}
    ranks = 0
    for key, kind in GAUGES.items():
        name = _named(families, "gauges", key)
        agg = aggregate_gauge(_family(families, name) if name else [], kind)
        out["gauges"][key] = agg
        out[key] = agg["value"] if agg else None
        if kind == RATIO:
            out[f"{key}_max"] = agg["max"] if agg else None
        ranks = max(ranks, agg["ranks"] if agg else 0)
    out["ranks"] = ranks
    for key in HISTOGRAMS:
        name = _named(families, "histograms", key)
        buckets, count, total = _buckets(_family(families, name) if name else [])
        out[key] = _quantiles(buckets, count)
        out["raw"]["histograms"][key] = {"buckets": [["+Inf" if math.isinf(b) else b, c] for b, c in buckets],
                                         "count": count, "sum": total}
    for key in COUNTERS:
        name = _named(families, "counters", key)
        samples = [s for s in (_family(families, name) + _family(families, name + "_total") if name else [])
                   if s.name.endswith("_total")]
        out["raw"]["counters"][key] = sum(s.value for s in samples) if samples else None
    return out


def window(prev: dict, cur: dict, seconds: float) -> dict:
    """What happened between two scrapes: quantiles of the histogram buckets' increase, and
    counter rates (a counter that went down was reset: its increase is its new value)."""
    out: dict = {"seconds": round(seconds, 3)}
    for key in HISTOGRAMS:
        a = prev["raw"]["histograms"].get(key) or {"buckets": [], "count": 0.0}
        b = cur["raw"]["histograms"].get(key) or {"buckets": [], "count": 0.0}
        before = {float(le): c for le, c in a["buckets"]}
        after = [(float(le), c) for le, c in b["buckets"]]
        reset = b["count"] < a["count"] or any(c < before.get(le, 0.0) for le, c in after)
        delta = [(le, c - (0.0 if reset else before.get(le, 0.0))) for le, c in after]
        count = b["count"] - (0.0 if reset else a["count"])
        out[key] = _quantiles(delta, count)
    for key in COUNTERS:
        a, b = prev["raw"]["counters"].get(key), cur["raw"]["counters"].get(key)
        if b is None or seconds <= 0:
            out[f"{key}_per_s"] = None
            continue
        increase = b if (a is None or b < a) else b - a
        out[f"{key}_per_s"] = increase / seconds
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


_previous: dict[str, tuple[float, dict]] = {}
_previous_lock = threading.Lock()


def scrape(hs: HostSession) -> dict:
    """Scrape and summarise one host; from the second scrape of a host in this process on
    (`metrics --watch`), `window` holds what changed since the previous one."""
    port = int(hs.host.require("server_port"))
    res = run_program(hs, "scrape", {"port": port})
    at = time.monotonic()
    where = f"{hs.host.name}:{port}"
    if res.get("fetch_error"):
        raise MetricsError(f"{where}: cannot fetch /metrics: {res['fetch_error']}")
    data = summarise(parse(res["text"], where))
    data["gpus"] = parse_gpu_csv(res.get("gpu_csv") or "")
    data["host"] = hs.host.name
    if res.get("cut_at"):
        data["cut"] = (f"/metrics is over {int(res['cut_at']) >> 20} MiB: only its first "
                       f"{int(res['cut_at']) >> 20} MiB were read (whole lines)")
    key = f"{hs.host.name}:{port}"
    with _previous_lock:
        prev = _previous.get(key)
        _previous[key] = (at, data)
    data["window"] = window(prev[1], data, at - prev[0]) if prev else None
    return data


def scrape_host(hs: HostSession) -> tuple[str, str, dict]:
    """One host's scrape as a recap entry: ok, saying so when /metrics was cut."""
    data = scrape(hs)
    return OK, data.get("cut") or "", data


def _fmt(v, scale=1.0, digits=1):
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _pct_cell(row: dict, key: str) -> str:
    """'41.5%', or '41.5% (max 49.0%)' when the ranks disagree."""
    agg = (row.get("gauges") or {}).get(key)
    if row.get(key) is None:
        return "-"
    text = _fmt(row.get(key), 100, 1) + "%"
    if agg and agg["ranks"] > 1 and agg["max"] - agg["min"] > 1e-9:
        text += f" (max {agg['max'] * 100:.1f}%)"
    return text


def metrics_table(rows: list[dict], width: int | None = None):
    """The server metrics table: since-start quantiles (p50/p90/p99) and, from the second scrape
    on, the window since the previous one. Narrower than its full form needs (`width`, a
    terminal's columns), it keeps what a watch needs: the window's p50/p99 (the since-start ones
    where there is no window yet) in fewer, unbroken columns -- p99 is never cut off."""
    from rich.measure import Measurement

    from .output import make_console

    full = _table(rows, compact=False)
    if width is None:
        return full
    probe = make_console(width=10_000)
    if Measurement.get(probe, probe.options, full).maximum <= width:
        return full
    return _table(rows, compact=True)


def _table(rows: list[dict], compact: bool):
    from .output import table

    windowed = any(r.get("window") for r in rows)
    seconds = max((r["window"]["seconds"] for r in rows if r.get("window")), default=0.0)
    last = f"last {seconds:.0f}s" if seconds >= 1 else f"last {seconds:.1f}s"
    q = lambda h, s=1000.0, stats=("p50", "p90", "p99"): "/".join(_fmt(h[p], s) for p in stats)  # noqa: E731
    e2e = lambda h: f"{_fmt(h['p50'], 1, 2)}/{_fmt(h['p99'], 1, 2)}"  # noqa: E731
    if compact:
        ranks = max((r.get("ranks") or 0 for r in rows), default=0)
        t = table(f"server metrics ({last if windowed else 'since start'}"
                  + (f"; gauges over {ranks} ranks" if ranks > 1 else "") + ")",
                  ["host", "run/queue", "token usage", "gen tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms",
                   "e2e p50/p99 s"] + (["req/s"] if windowed else []))
        for col in t.columns:
            col.no_wrap = True
        for r in rows:
            w = r.get("window") or r
            t.add_row(r["host"], f"{_fmt(r['running'], 1, 0)}/{_fmt(r['queued'], 1, 0)}",
                      _pct_cell(r, "token_usage"), _fmt(r["gen_throughput"]), q(w["ttft"], stats=("p50", "p99")),
                      q(w["itl"], stats=("p50", "p99")), e2e(w["e2e"]),
                      *([_fmt(w["requests_per_s"], 1, 2) if r.get("window") else "-"] if windowed else []))
        return t
    cols = ["host", "ranks", "running", "queued", "token usage", "gen tok/s", "cache hit", "TTFT p50/p90/p99 ms"]
    cols += [f"TTFT {last}"] if windowed else []
    cols += ["ITL p50/p90/p99 ms"] + ([f"ITL {last}"] if windowed else [])
    cols += ["e2e p50/p99 s"] + ([f"e2e {last}", "req/s"] if windowed else [])
    t = table("server metrics", cols)
    for r in rows:
        w = r.get("window")
        cells = [r["host"], str(r.get("ranks") or "-"), _fmt(r["running"], 1, 0), _fmt(r["queued"], 1, 0),
                 _pct_cell(r, "token_usage"), _fmt(r["gen_throughput"]), _pct_cell(r, "cache_hit_rate"), q(r["ttft"])]
        if windowed:
            cells.append(q(w["ttft"]) if w else "-")
        cells.append(q(r["itl"]))
        if windowed:
            cells.append(q(w["itl"]) if w else "-")
        cells.append(e2e(r["e2e"]))
        if windowed:
            cells += [e2e(w["e2e"]) if w else "-", _fmt(w["requests_per_s"], 1, 2) if w else "-"]
        t.add_row(*cells)
    return t


def extra_tables(rows: list[dict]) -> list:
    """The per-rank spread (where the ranks of a server disagree) and the GPUs."""
    from .output import table

    out = []
    spread = [(r["host"], key, agg) for r in rows for key, agg in (r.get("gauges") or {}).items()
              if agg and agg["ranks"] > 1 and agg["max"] - agg["min"] > 1e-9]
    if spread:
        names = []
        for _h, _k, agg in spread:
            names.extend(n for n in agg["per_rank"] if n not in names)
        s = table("per-rank spread (the ranks of one server disagree)", ["host", "gauge", "min", "max", *names])
        for host, key, agg in spread:
            scale, digits = (100.0, 1) if GAUGES[key] == RATIO else (1.0, 1)
            s.add_row(host, key, _fmt(agg["min"], scale, digits), _fmt(agg["max"], scale, digits),
                      *[_fmt(agg["per_rank"].get(n), scale, digits) for n in names])
        out.append(s)
    gpu_rows = [(r["host"], g) for r in rows for g in r["gpus"]]
    if gpu_rows:
        g = table("GPUs", ["host", "gpu", "util %", "memory used / total (MiB)"])
        for host, gpu in gpu_rows:
            g.add_row(host, str(gpu["index"]), f"{gpu['util']:.0f}", f"{gpu['mem_used_mib']:.0f} / {gpu['mem_total_mib']:.0f}")
        out.append(g)
    return out


def print_metrics(rows: list[dict]) -> None:
    from .output import print_table

    for t in [metrics_table(rows)] + extra_tables(rows):
        print_table(t)


def watch(scrape_all: Callable[[], tuple[list[dict], object]], every: float = 0.0, as_json: bool = False):
    """`invoke metrics`: one scrape, or (`every` seconds, --watch) one after another until Ctrl-C
    or a failed scrape; returns the last scrape's recap. Watched on a terminal, the tables are
    redrawn in place (rich Live), fitted to its width; piped (or --json) each scrape is printed
    after the last."""
    from .output import console, json_text

    live = None
    if every and not as_json and console.is_terminal:
        from rich.live import Live

        real = getattr(console, "_console", None) or console  # the rich Console behind the lazy wrapper
        live = Live(console=real, auto_refresh=False)
        live.start()
    try:
        while True:
            rows, recap = scrape_all()
            if as_json:
                print(json_text(rows, indent=1))
            elif live:
                from rich.console import Group

                if rows:  # a scrape cut short (Ctrl-C) leaves the last frame up
                    live.update(Group(metrics_table(rows, console.size.width), *extra_tables(rows)), refresh=True)
            else:
                print_metrics(rows)
            if not every or recap.failed or pause(every):
                return recap
    finally:
        if live:
            live.stop()


def pause(seconds: float) -> bool:
    """Sleep; True when Ctrl-C ended the watch."""
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        return True
    return False
