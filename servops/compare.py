"""`invoke compare A B`: side-by-side bench results with deltas, and a PNG plot.

The plot: output throughput (from zero, with 95% intervals when runs were repeated), TTFT (log
axis), TPOT, ITL and e2e latency, p50 solid and p99 dashed, against the levels; and a Pareto
panel: output tok/s against p99 TTFT, one point per variant and level, each labelled with its
level, the frontier marked. With one run per variant every delta, and the plot, says there is
no noise estimate.
"""

from __future__ import annotations

import math
from pathlib import Path

from .bench import RESULTS_ROOT, BenchError, latest_for_variant
from .errors import NoData
from .gate import SINGLE_RUN
from .schema import NAME
from .output import console, print_table, table

# (summary key, label, higher is better, digits)
ROWS = (("output_tps", "output tok/s", True, 1), ("request_rate", "req/s", True, 2),
        ("ttft_p50", "TTFT p50 ms", False, 1), ("ttft_p99", "TTFT p99 ms", False, 1),
        ("tpot_p50", "TPOT p50 ms", False, 2), ("tpot_p99", "TPOT p99 ms", False, 2),
        ("itl_p50", "ITL p50 ms", False, 2), ("itl_p99", "ITL p99 ms", False, 2),
        ("e2e_p50", "e2e p50 ms", False, 1), ("e2e_p99", "e2e p99 ms", False, 1),
        ("goodput", "goodput", True, 3), ("error_rate", "failed share", False, 3))


class NoResults(BenchError, NoData):
    pass


def load_pair(host: str, variants: list[str]) -> dict[str, dict]:
    out = {}
    for v in variants:
        if not NAME.fullmatch(v):
            raise BenchError(f"variant {v!r}: use letters, digits, '.', '_' or '-' (it names the plot's file)")
        res = latest_for_variant(host, v)
        if res is None:
            raise NoResults(f"no saved bench for variant {v!r} on {host} under {RESULTS_ROOT}/{host}/; run invoke bench "
                            f"first")
        out[v] = res
    return out


def delta(a: float | None, b: float | None) -> str:
    if a in (None, 0) or b is None:
        return "-"
    return f"{(b - a) / a * 100:+.1f}%"


def _significant(la: dict, lb: dict, key: str) -> bool | None:
    """Welch: does the 95% interval of the difference exclude 0? None without repeats."""
    from .bench import t975

    a = (la.get("samples") or {}).get(key) or []
    b = (lb.get("samples") or {}).get(key) or []
    if len(a) < 2 and len(b) < 2:
        return None
    def mv(xs):
        m = math.fsum(xs) / len(xs)
        return m, (math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs) if len(xs) > 1 else 0.0)
    ma, va = mv(a)
    mb, vb = mv(b)
    if va + vb == 0:
        return ma != mb
    terms = (va * va / (len(a) - 1) if len(a) > 1 else 0.0) + (vb * vb / (len(b) - 1) if len(b) > 1 else 0.0)
    df = (va + vb) ** 2 / terms if terms else math.inf
    return abs(ma - mb) > t975(df) * math.sqrt(va + vb)


def _cell(lv: dict, key: str, digits: int) -> str:
    v = lv.get(key)
    if v is None:
        return "-"
    ci = (lv.get("ci95") or {}).get(key)
    return f"{v:.{digits}f}" + (f" ±{(ci[1] - ci[0]) / 2:.{digits}f}" if ci else "")


def print_compare(host: str, results: dict[str, dict]) -> None:
    names = list(results)
    base = names[0]
    title = " vs ".join(f"{n} ({results[n].get('release')})" for n in names)
    t = table(f"{host}: {title}",
              ["level", "metric", *names, *(f"Δ {n}" for n in names[1:])])
    levels = sorted({lv["concurrency"] for r in results.values() for lv in r["levels"]})
    noisy = False
    for level in levels:
        by = {n: next((lv for lv in results[n]["levels"] if lv["concurrency"] == level), {}) for n in names}
        for key, label, _higher, digits in ROWS:
            if all(by[n].get(key) is None for n in names):
                continue
            deltas = []
            for n in names[1:]:
                d = delta(by[base].get(key), by[n].get(key))
                significant = _significant(by[base], by[n], key)
                if d != "-" and significant is None:
                    d += f" ({SINGLE_RUN})"
                elif d not in ("-", "+0.0%", "-0.0%") and significant is False:
                    d += " (noise)"
                    noisy = True
                deltas.append(d)
            t.add_row(str(level), label, *(_cell(by[n], key, digits) for n in names), *deltas)
    print_table(t)
    if noisy:
        console.print("(noise): the 95% interval of the difference includes 0", markup=False, highlight=False)


def _series(res: dict, key: str):
    pts = [(lv["concurrency"], lv.get(key)) for lv in res["levels"] if lv.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (p99 TTFT, tok/s) no other point beats on both (lower TTFT, higher tok/s)."""
    front = [p for p in points if not any((q[0] <= p[0] and q[1] >= p[1]) and q != p for q in points)]
    return sorted(set(front))


def single_runs(results: dict[str, dict]) -> bool:
    """No level of any result was repeated: its deltas carry no noise estimate."""
    return all((lv.get("repeats") or 1) < 2 for r in results.values() for lv in r["levels"])


def figure(host: str, results: dict[str, dict]):
    """The compare figure (matplotlib, Agg): five metric panels against the level, and the Pareto
    panel with every point labelled with its level, no label over another or over the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9.2))
    (ax_tps, ax_ttft, ax_tpot), (ax_itl, ax_e2e, ax_par) = axes
    levels = sorted({lv["concurrency"] for r in results.values() for lv in r["levels"]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    pareto_pts = []
    for i, (name, res) in enumerate(results.items()):
        color = colors[i % len(colors)]
        label = f"{name} ({res.get('release') or '?'})"
        x, y = _series(res, "output_tps")
        err = None
        if any((lv.get("ci95") or {}).get("output_tps") for lv in res["levels"]):
            lo, hi = [], []
            for lv in res["levels"]:
                if lv.get("output_tps") is None:
                    continue
                ci = (lv.get("ci95") or {}).get("output_tps") or [lv["output_tps"]] * 2
                lo.append(lv["output_tps"] - ci[0])
                hi.append(ci[1] - lv["output_tps"])
            err = [lo, hi]
        ax_tps.errorbar(x, y, yerr=err, marker="o", color=color, label=label, capsize=3)
        for ax, base in ((ax_ttft, "ttft"), (ax_tpot, "tpot"), (ax_itl, "itl"), (ax_e2e, "e2e")):
            for stat, style in (("p50", "-"), ("p99", "--")):
                x, y = _series(res, f"{base}_{stat}")
                if base == "ttft":
                    y = [max(v, 1e-3) for v in y]
                ax.plot(x, y, style, marker="o" if stat == "p50" else "s", color=color,
                        label=f"{label} {stat}", markersize=5)
        first = True
        for lv in res["levels"]:
            if lv.get("output_tps") is not None and lv.get("ttft_p99") is not None:
                pt = (max(lv["ttft_p99"], 1e-3), lv["output_tps"])
                pareto_pts.append((pt, str(lv["concurrency"]), color))
                ax_par.scatter([pt[0]], [pt[1]], color=color, s=46, zorder=3, label=label if first else None)
                first = False
    front = pareto_front([p for p, _t, _c in pareto_pts])
    if len(front) > 1:
        ax_par.plot([p[0] for p in front], [p[1] for p in front], ":", color="black", linewidth=1.2,
                    label="Pareto frontier", zorder=2)
    elif front:
        ax_par.scatter([front[0][0]], [front[0][1]], facecolors="none", edgecolors="black", s=140,
                       label="Pareto best", zorder=2)
    titles = {ax_tps: ("output throughput", "tokens/s"), ax_ttft: ("time to first token (log)", "ms"),
              ax_tpot: ("time per output token", "ms"), ax_itl: ("inter-token latency", "ms"),
              ax_e2e: ("end-to-end latency", "ms")}
    for ax, (title, ylabel) in titles.items():
        level_axis(ax, levels)
        ax.set_xlabel("concurrent requests (level)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax is ax_ttft:
            log_axis(ax.yaxis)
        else:
            room_above(ax)
    ax_tps.legend(fontsize=8, loc="upper left")
    log_axis(ax_par.xaxis)
    room_above(ax_par)
    ax_par.margins(x=0.15)
    ax_par.set_xlabel("TTFT p99 (ms, log)")
    ax_par.set_ylabel("output tokens/s")
    ax_par.set_title("Pareto: throughput vs TTFT p99 (labels: level)")
    ax_par.grid(True, alpha=0.3)
    legend = ax_par.legend(fontsize=8, loc="lower right")
    title = f"{host}: {' vs '.join(results)}   (p50 solid, p99 dashed)"
    if single_runs(results):
        title += f"\n{SINGLE_RUN} (bench --repeat N measures 95% intervals)"
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    place_labels(ax_par, pareto_pts, [legend])
    return fig


def level_axis(ax, levels: list[int]) -> None:
    """A log x axis with a tick at each level and room beyond the first and last (no point cut)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(levels))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(levels)
    ax.set_xticklabels([str(lv) for lv in levels])
    ax.set_xlim(levels[0] / 1.6, levels[-1] * 1.6)


def log_axis(axis) -> None:
    """A log axis labelled as plain numbers at steps its data's span leaves room for: 1-2-5 over up
    to two decades, 1-3 up to three and a half, each decade past that (matplotlib labels every minor
    tick of a short log range, 2x10^1, 3x10^1, ..., and 1-2-5 labels over four decades of TTFT, a
    0.1 ms first token beside a loaded level's seconds, run into each other). Call it after plotting."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax = axis.axes
    (ax.set_yscale if axis is ax.yaxis else ax.set_xscale)("log")  # a log locator on a linear axis stacks its labels
    low, high = axis.get_data_interval()
    decades = math.log10(high / low) if 0 < low < high and math.isfinite(high / low) else 0.0
    subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0, 3.0) if decades <= 3.5 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def room_above(ax) -> None:
    """A linear axis from 0 with room above the highest point (error bars included): none sits
    on the frame."""
    top = ax.dataLim.y1
    ax.set_ylim(0, (top if math.isfinite(top) and top > 0 else 1.0) * 1.15)


# label offsets tried, in points: beside the point first, then further out, in sixteen directions
_OFFSETS = [(round(r * math.cos(a * math.pi / 8)), round(r * math.sin(a * math.pi / 8)) - 4)
            for r in (7, 14, 22, 32, 44, 58, 75) for a in (1, -1, 7, 9, 4, 12, 0, 8, 2, 6, 10, 14, 3, 5, 11, 13)]


def place_labels(ax, points: list, obstacles: list) -> list:
    """Annotate each (point, text, color) in `ax` where its box overlaps no other label, no
    point and no obstacle (the legend) and stays inside the axes: the first free offset of
    _OFFSETS, a leader line when it is not beside the point. Returns the annotations."""
    from matplotlib.text import Text

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()

    def label_box(ann):
        """The text's own box, not its leader line's (positions first: they are laid out at draw)."""
        ann.update_positions(renderer)
        return Text.get_window_extent(ann, renderer)

    frame = ax.get_window_extent(renderer)
    taken = [o.get_window_extent(renderer) for o in obstacles if o is not None]
    for (x, y), _t, _c in points:  # each point's marker
        px, py = ax.transData.transform((x, y))
        taken.append(_box(px - 5, py - 5, px + 5, py + 5))
    placed = []
    for (x, y), text, color in points:
        best = None
        for n, (dx, dy) in enumerate(_OFFSETS):
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=8, color=color,
                              ha="left" if dx >= 0 else "right",
                              arrowprops=dict(arrowstyle="-", color=color, lw=0.6) if n >= 16 else None)
            box = label_box(ann)
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            if inside and not any(box.overlaps(t) for t in taken):
                best = ann
                break
            ann.remove()
        if best is None:  # nowhere free: the nearest spot, still labelled
            best = ax.annotate(text, (x, y), textcoords="offset points", xytext=_OFFSETS[0], fontsize=8, color=color)
        taken.append(label_box(best))
        placed.append(best)
    return placed


def _box(x0: float, y0: float, x1: float, y1: float):
    from matplotlib.transforms import Bbox

    return Bbox([[x0, y0], [x1, y1]])


def plot(host: str, results: dict[str, dict], out: Path) -> Path:
    import io

    import matplotlib.pyplot as plt

    from .localfiles import private_dir, write_new

    fig = figure(host, results)
    private_dir(out.parent)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_new(out, buf.getvalue())  # by rename: a symlink planted at the name is replaced, not followed
    return out
