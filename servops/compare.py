"""`invoke compare A B`: side-by-side bench results with deltas, and a PNG plot."""

from __future__ import annotations

from pathlib import Path

from .bench import RESULTS_ROOT, BenchError, latest_for_variant
from .output import console, print_table, table

ROWS = (("output_tps", "output tok/s", True), ("request_rate", "req/s", True), ("ttft_p50", "TTFT p50 ms", False),
        ("ttft_p99", "TTFT p99 ms", False), ("itl_p50", "ITL p50 ms", False), ("e2e_p50", "e2e p50 ms", False))


def load_pair(host: str, variants: list[str]) -> dict[str, dict]:
    out = {}
    for v in variants:
        res = latest_for_variant(host, v)
        if res is None:
            raise BenchError(f"no saved bench for variant {v!r} on {host} under {RESULTS_ROOT}/{host}/; run invoke bench first")
        out[v] = res
    return out


def delta(a: float | None, b: float | None) -> str:
    if a in (None, 0) or b is None:
        return "-"
    return f"{(b - a) / a * 100:+.1f}%"


def print_compare(host: str, results: dict[str, dict]) -> None:
    names = list(results)
    base = names[0]
    t = table(f"{host}: {' vs '.join(names)}", ["concurrency", "metric", *names, *(f"Δ {n}" for n in names[1:])])
    levels = sorted({l["concurrency"] for r in results.values() for l in r["levels"]})
    for level in levels:
        by = {n: next((l for l in results[n]["levels"] if l["concurrency"] == level), {}) for n in names}
        for key, label, _higher_better in ROWS:
            vals = [by[n].get(key) for n in names]
            t.add_row(str(level), label, *("-" if v is None else f"{v:.2f}" for v in vals),
                      *(delta(by[base].get(key), by[n].get(key)) for n in names[1:]))
    print_table(t)


def plot(host: str, results: dict[str, dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, res in results.items():
        levels = [l["concurrency"] for l in res["levels"]]
        ax1.plot(levels, [l["output_tps"] for l in res["levels"]], marker="o", label=name)
        ax2.plot(levels, [l["ttft_p50"] or 0 for l in res["levels"]], marker="o", label=name)
    for ax, title, ylabel in ((ax1, "output throughput", "tokens/s"), (ax2, "TTFT p50", "ms")):
        ax.set_xscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{host}: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
