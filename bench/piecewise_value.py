"""What piecewise CUDA graphs buy (issue #46.2): the table a performance engineer decides on,
from servops' own results of a tune campaign over the variants baseline / decode CUDA graphs /
piecewise (tc_piecewise) / the breakable prefill backend (campaigns/piecewise-8b-*.yml).

For each campaign (one per prompt length) and each trial that served: every bench run of its
release (results/<host>/<release>/*.jsonl: the first bench, the campaign's repeats and
re-benches) gives one sample per level of TTFT p50, output tok/s and TPOT p50; each is shown as
the mean of its runs with its 95% Student-t interval, and TTFT's change against the campaign's
base with the interval of that difference (Welch). The start-up of each variant: every start the
campaign logged (the deploy, and each restart with `repeat_by: restart`), its time to healthy
and its phases (weights, JIT, compile, capture, other: what the engine's log showed), as mean
and interval over those starts. Printed as Markdown.

    .venv/bin/python bench/piecewise_value.py -H h100 piecewise-8b-short piecewise-8b-long
    .venv/bin/python bench/piecewise_value.py -H lab1 --results /tmp/results labpw   # any results tree

The weights are random (servops/lab/modelgen.py): the kernels' speed is that of the real shape,
but the model's output is noise and every request runs to max_tokens; MoE routing is as uniform
as random router weights make it. Say so wherever a figure is shown (the output does).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from servops import bench, startup  # noqa: E402
from servops.campaignrecord import read_log  # noqa: E402
from servops.releases import RELEASE_NAME_RE  # noqa: E402

METRICS = (("ttft_p50", "TTFT p50 ms", 1), ("output_tps", "output tok/s", 0), ("tpot_p50", "TPOT p50 ms", 2))
PHASES = ("start_s", "weights_s", "jit_s", "compile_s", "capture_s", "other_s")


def interval(samples: list[float]) -> tuple[float, float | None]:
    """(mean, half-width of its 95% interval; None from one sample)."""
    mean = statistics.fmean(samples)
    if len(samples) < 2:
        return mean, None
    return mean, bench.t975(len(samples) - 1) * statistics.stdev(samples) / math.sqrt(len(samples))


def shown(samples: list[float], digits: int, one: str = "1 run") -> str:
    if not samples:
        return "-"
    mean, half = interval(samples)
    return f"{mean:,.{digits}f}" + (f" ± {half:,.{digits}f}" if half is not None else f" ({one})")


def welch(a: list[float], b: list[float]) -> str:
    """b's change against a, in percent of a's mean, with the 95% interval of the difference."""
    if not a or not b:
        return "-"
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return f"{(mb - ma) / ma * 100:+.1f}% (no interval: 1 run)"
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = (va + vb) ** 2 / ((va ** 2 / (len(a) - 1) if va else 0) + (vb ** 2 / (len(b) - 1) if vb else 0) or 1e-12)
    half = bench.t975(df) * math.sqrt(va + vb)
    lo, hi = (mb - ma - half) / ma * 100, (mb - ma + half) / ma * 100
    verdict = "" if lo > 0 or hi < 0 else " (noise)"
    return f"{(mb - ma) / ma * 100:+.1f}% [{lo:+.1f}, {hi:+.1f}]{verdict}"


def trials(entries: list[dict]) -> list[dict]:
    """The campaign's trials that served, in their order: {trial, label, release, starts}."""
    out: dict[str, dict] = {}
    for e in entries:
        tid = e.get("trial")
        if not tid or e.get("phase") not in ("deployed", "done"):
            continue
        t = out.setdefault(tid, {"trial": tid, "label": e.get("label") or tid, "release": None, "starts": []})
        if e.get("phase") == "deployed" and e.get("outcome") == "healthy":
            t["release"] = e.get("release") or t["release"]
            start = startup.clean(e.get("start"))
            if start:
                t["starts"].append(start)
        if e.get("phase") == "done" and e.get("release"):
            t["release"] = e["release"]
    for e in entries:  # repeats on a fresh start (repeat_by: restart) log their starts too
        if e.get("trial") in out and e.get("phase") in ("restarted", "repeat") and startup.clean(e.get("start")):
            out[e["trial"]]["starts"].append(startup.clean(e["start"]))
    return [t for t in out.values() if t["release"]]


def samples(results: Path, host: str, release: str) -> dict[int, dict[str, list[float]]]:
    """level -> metric -> one value per bench run of the release."""
    out: dict[int, dict[str, list[float]]] = {}
    for path in sorted((results / host / release).glob("*.jsonl")):
        result = bench.load_result(path)
        for run in (result or {}).get("runs") or []:
            level = out.setdefault(int(run["concurrency"]), {})
            for key, _name, _d in METRICS:
                if isinstance(run.get(key), (int, float)):
                    level.setdefault(key, []).append(float(run[key]))
    return out


def metric_table(results: Path, host: str, labeled: list[tuple[str, str]]) -> list[str]:
    """The Markdown table of TTFT / output tok/s / TPOT per (label, release) and level, the first the base."""
    data = [(label, samples(results, host, release)) for label, release in labeled]
    out = ["| variant | concurrency | " + " | ".join(n for _k, n, _d in METRICS) + " | TTFT vs base | runs |",
           "| --- | ---: | " + " | ".join("---:" for _ in METRICS) + " | ---: | ---: |"]
    base = data[0][1] if data else {}
    for i, (label, levels) in enumerate(data):
        for level in sorted(levels):
            m = levels[level]
            vs = "(base)" if i == 0 else welch((base.get(level) or {}).get("ttft_p50") or [], m.get("ttft_p50") or [])
            out.append(f"| {label} | {level} | " + " | ".join(shown(m.get(k) or [], d) for k, _n, d in METRICS)
                       + f" | {vs} | {max(len(v) for v in m.values()) if m else 0} |")
    return out


def bench_config(results: Path, host: str, releases: list[str]) -> dict:
    """The first bench's config of these releases (prompt and output lengths), {} if none ran."""
    first = next((bench.load_result(p) for r in releases for p in sorted((results / host / r).glob("*.jsonl"))), None)
    return (first or {}).get("config") or {}


def bench_words(cfg: dict) -> str:
    """What was benched, and what random weights mean for it (said wherever a figure is shown)."""
    return ((f"prompts {cfg.get('input_len', '?')} tokens, outputs {cfg.get('output_len', '?')} tokens" if cfg
             else "no bench of these releases finished")
            + ". Random weights: the kernels run at the real shape's speed, the text is noise and every request "
              "runs to max_tokens.")


def releases_table(results: Path, host: str, releases: list[str]) -> list[str]:
    """Releases benched outside a campaign (bench/gpu_piecewise_8b.sh longpw), the first the base."""
    missing = [r for r in releases if not any((results / host / r).glob("*.jsonl"))]
    if missing:
        raise SystemExit(f"error: no bench results of {', '.join(missing)} in {results / host}")
    return ([f"### {', '.join(releases)} on {host}", "", bench_words(bench_config(results, host, releases)), ""]
            + metric_table(results, host, [(r, r) for r in releases]))


def campaign_table(results: Path, host: str, name: str) -> list[str]:
    log = results / host / "campaigns" / name / "trials.jsonl"
    entries = read_log(log)
    if not entries:
        raise SystemExit(f"error: no trials in {log}")
    facts = next((e.get("facts") for e in entries if e.get("phase") == "campaign"), None) or {}
    ran = trials(entries)
    out = [f"### {name} on {host}", "",
           f"{', '.join(f'{k} {v}' for k, v in sorted(facts.items())) or 'facts not recorded'}; "
           + bench_words(bench_config(results, host, [t["release"] for t in ran])), ""]
    out += metric_table(results, host, [(t["label"], t["release"]) for t in ran])
    out += ["", "| variant | starts | " + " | ".join(startup.NAMES.get(p, "to healthy") for p in PHASES) + " |",
            "| --- | ---: | " + " | ".join("---:" for _ in PHASES) + " |"]
    for t in ran:
        cells = []
        for p in PHASES:
            # JIT: the log's, else what the JIT caches' new files showed (sglang 0.5.17 logs no build)
            got = [startup.jit_of(s) if p == "jit_s" else s.get(p) for s in t["starts"]]
            values = [v for v in got if v is not None]
            by_files = p == "jit_s" and any(s.get("jit_s") is None for s in t["starts"]) and values
            cells.append(shown(values, 1, "1 start") + (" (by the cache files)" if by_files else "")
                         + ("" if len(values) == len(t["starts"]) or not values else
                            f" ({len(t['starts']) - len(values)} not in the log)")
                         if values else "not in the log")
        out.append(f"| {t['label']} | {len(t['starts'])} | " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("campaigns", nargs="*", help="campaign names (one per prompt length)")
    ap.add_argument("-H", "--host", required=True)
    ap.add_argument("--results", type=Path, default=bench.RESULTS_ROOT)
    ap.add_argument("--releases", default="", help="comma-separated releases benched outside a campaign, the "
                                                   "first the base: their bench table (no start-up)")
    a = ap.parse_args(argv)
    releases = [r.strip() for r in a.releases.split(",") if r.strip()]
    bad = [r for r in releases if not RELEASE_NAME_RE.fullmatch(r)]
    if bad:  # the folder under results/<host>/ bench writes for a release: never a path
        ap.error(f"--releases {bad[0]!r}: not a release name (<UTC time>-<variant>, as `invoke releases` lists them)")
    if not (a.campaigns or releases):
        ap.error("name a campaign or --releases")
    lines = ["## What piecewise CUDA graphs buy", "",
             "Means of every bench run of each variant's release with their 95% intervals; TTFT vs base: the "
             "difference of the means and its 95% interval (Welch), `(noise)` where it holds zero. Start-up: each "
             "start the campaign logged, time to healthy and the phases the engine's log showed.", ""]
    for name in a.campaigns:
        lines += campaign_table(a.results, a.host, name) + [""]
    if releases:
        lines += releases_table(a.results, a.host, releases) + [""]
    print("\n".join(lines).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
