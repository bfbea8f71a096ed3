"""`invoke tune.report CAMPAIGN`: a campaign's trials as Markdown and one self-contained HTML page.

Read from results/<host>/campaigns/<name>/trials.jsonl (and the bench files it names), nothing
else: a table of trials (flags vs the base, patches, outcome, key metrics with their 95%
intervals), throughput and latency per level per trial, the Pareto front, every crash with its
diagnosis, the drift of the base, and the winner with its exact launch-script diff against the
base. Plots are PNGs embedded as data: URIs, so the page opens anywhere.
"""

from __future__ import annotations

import base64
import difflib
import html
import io
import json
import re
from pathlib import Path

from .campaign import Campaign
from .localfiles import write_new  # a symlink planted at a report file is replaced, never followed
from .redact import MASK, is_secret_name
from .tune import log_path, read_log, trial_states

METRIC_COLUMNS = (("output_tps", "output tok/s"), ("ttft_p99", "TTFT p99 ms"), ("tpot_p50", "TPOT p50 ms"),
                  ("e2e_p50", "e2e p50 ms"))


def fmt(value, digits: int = 1) -> str:
    """One formatting for every number, in Markdown, HTML and the tests that compare them."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}"
    return str(value)


def _flags_diff(base: dict, spec: dict) -> str:
    """server_args/env that differ from the base trial's, as `--flag value` / `ENV=value`."""
    out = []
    b_args, t_args = base.get("server_args") or {}, spec.get("server_args") or {}
    for k in sorted(set(b_args) | set(t_args)):
        if b_args.get(k) != t_args.get(k):
            v = t_args.get(k)
            v = MASK if is_secret_name(k) and v not in (None, False, True) else v
            out.append(f"--{k}" + ("" if v is True else " (removed)" if v in (None, False) else f" {v}"))
    try:
        b_env, t_env = json.loads(base.get("env") or "{}"), json.loads(spec.get("env") or "{}")
    except ValueError:
        b_env, t_env = {}, {}
    for k in sorted(set(b_env) | set(t_env)):
        if b_env.get(k) != t_env.get(k):
            out.append(f"{k}={MASK if is_secret_name(k) and k in t_env else t_env.get(k, '(unset)')}")
    return ", ".join(out) or "(same as base)"


def collect(host: str, camp: Campaign) -> dict:
    """The report's data: one row per trial, in campaign order, from the log only."""
    path = log_path(host, camp.name)
    entries = read_log(path)
    if not entries:
        raise FileNotFoundError(f"no trials for campaign {camp.name} on {host}: {path} is missing or empty "
                                f"(run invoke tune {camp.name} -H {host} first)")
    states = trial_states(entries)
    order = [e["trial"] for e in entries if e.get("phase") == "start" or (e.get("phase") == "done" and "trial" in e)]
    order = list(dict.fromkeys(order))
    start_of = {tid: s.last("start") or {} for tid, s in states.items()}
    base_spec = (start_of.get("base") or {}).get("spec") or {}
    rows = []
    for tid in order:
        done = states[tid].done
        start = start_of.get(tid) or {}
        if not done:
            rows.append({"trial": tid, "label": start.get("label", tid), "outcome": "interrupted", "flags": "-",
                         "patches": ", ".join((start.get("spec") or {}).get("patches") or []) or "-"})
            continue
        spec = start.get("spec") or (start_of.get(done.get("same_as")) or {}).get("spec") or {}
        row = {"trial": tid, "label": done.get("label", tid), "outcome": done.get("outcome"),
               "objective": done.get("objective"), "metrics": done.get("metrics") or {},
               "violations": done.get("violations") or [], "findings": done.get("findings") or [],
               "reason": done.get("reason"), "release": done.get("release"), "same_as": done.get("same_as"),
               "result_path": done.get("result_path"), "script": start.get("script"),
               "flags": "(base)" if tid == "base" else _flags_diff(base_spec, spec),
               "patches": ", ".join(spec.get("patches") or []) or "-", "retry_of": spec.get("retry_of")}
        lv = row["metrics"].get(str(camp.objective.level)) or {}
        for key, _title in METRIC_COLUMNS:
            row[key] = lv.get(key)
        row["objective_ci"] = (lv.get(f"{camp.objective.metric}_ci") if lv else None)
        rows.append(row)
    feasible = [r for r in rows if r["outcome"] == "ok" and r.get("objective") is not None]
    winner = None
    for r in feasible:
        if winner is None or camp.objective.better(r["objective"], winner["objective"]):
            winner = r
    drift = next((e for e in reversed(entries) if e.get("phase") == "drift"), None)
    leave = next((e for e in reversed(entries) if e.get("phase") == "leave"), None)
    return {"campaign": camp, "host": host, "rows": rows, "winner": winner, "drift": drift, "leave": leave,
            "log": path, "base": next((r for r in rows if r["trial"] == "base"), None)}


def _series(row: dict, key: str) -> tuple[list[int], list[float]]:
    pts = sorted((int(lv), m.get(key)) for lv, m in (row.get("metrics") or {}).items() if m.get(key) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def plots(data: dict) -> dict[str, bytes]:
    """PNG bytes: throughput and latency per level per trial, and the Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .compare import pareto_front

    rows = [r for r in data["rows"] if r.get("metrics")]
    levels = sorted({int(lv) for r in rows for lv in r["metrics"]})
    out = {}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for r in rows:
        style = {"lw": 2.6} if data["winner"] and r["trial"] == data["winner"]["trial"] else {"lw": 1.2}
        for ax, key in zip(axes, ("output_tps", "ttft_p99", "tpot_p50")):
            xs, ys = _series(r, key)
            if xs:
                ax.plot(xs, ys, marker="o", label=r["trial"], **style)
    for ax, title, unit, log in zip(axes, ("output throughput", "TTFT p99", "TPOT p50"),
                                    ("tokens/s", "ms", "ms"), (False, True, False)):
        ax.set_xscale("log")
        ax.set_xticks(levels)
        ax.set_xticklabels([str(lv) for lv in levels])
        ax.minorticks_off()
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out["levels"] = _png(fig, plt)
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    points = []
    for r in rows:
        mine = [(m["ttft_p99"], m["output_tps"], lv) for lv, m in r["metrics"].items()
                if m.get("output_tps") is not None and m.get("ttft_p99") is not None]
        if mine:
            ax.scatter([p[0] for p in mine], [p[1] for p in mine], s=30, label=r["trial"])
            points += [(p[0], p[1], r["trial"], p[2]) for p in mine]
    front = pareto_front([(p[0], p[1]) for p in points])
    if front:
        ax.plot([f[0] for f in front], [f[1] for f in front], color="black", lw=1, ls="--", label="Pareto front")
        on_front = {(f[0], f[1]) for f in front}
        for ttft, tps, trial, lv in points:  # label the front only: the rest is in the legend
            if (ttft, tps) in on_front:
                ax.annotate(f"{trial}@{lv}", (ttft, tps), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if points:
        ax.legend(fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput vs TTFT p99 (every trial and level)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out["pareto"] = _png(fig, plt)
    return out


def _png(fig, plt) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def script_diff(data: dict) -> str:
    winner, base = data["winner"], data["base"]
    if not winner or not base or not winner.get("script") or not base.get("script"):
        return ""
    return "".join(difflib.unified_diff(base["script"].splitlines(True), winner["script"].splitlines(True),
                                        "base/launch.sh", f"{winner['trial']}/launch.sh"))


def _objective_text(row: dict, camp: Campaign) -> str:
    ci = row.get("objective_ci")
    text = fmt(row.get("objective"))
    return text + (f" ± {fmt(ci)}" if ci else "")


def _md(value) -> str:
    """Text for a Markdown line or table cell: no raw HTML (a server's error text could carry
    `<img onerror=...>` into a viewer that renders it), no line break, no cell break."""
    text = " ".join(str(value).split())
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text).replace("|", "\\|")  # `<= 300` stays readable


def _code(value) -> str:
    """Text for a `code span`: no backtick can end it, no line break."""
    return " ".join(str(value).replace("`", "'").split())


def markdown(data: dict) -> str:
    camp = data["campaign"]
    lines = [f"# Tuning campaign `{camp.name}` on {data['host']}", ""]
    if camp.data.get("description"):
        lines += [_md(camp.data["description"]), ""]
    lines += [f"- objective: {camp.objective.sense} `{camp.objective.written}`",
              "- constraints: " + (", ".join(f"`{c}`" for c in camp.constraints if not c.implicit) or "none"),
              f"- trials: {len(data['rows'])} (log: `{data['log']}`)"]
    w = data["winner"]
    lines += [f"- **winner: {_md(w['trial'])}** ({_md(w['label'])}): {camp.objective.written} = {_objective_text(w, camp)}"
              if w else "- no trial met every constraint", ""]
    head = ["trial", "flags vs base", "patches", "outcome", camp.objective.written] + [t for _k, t in METRIC_COLUMNS]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        cells = [r["trial"], r["flags"], r["patches"], _outcome(r), _objective_text(r, camp)] + \
                [fmt(r.get(k)) for k, _t in METRIC_COLUMNS]
        lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
    lines += ["", f"Metrics at level {camp.objective.level}; ± is the 95% interval of repeated runs.", ""]
    crashes = [r for r in data["rows"] if r.get("findings") or r["outcome"] in ("crashed", "failed", "timeout")]
    if crashes:
        lines += ["## Crashes and their diagnosis", ""]
        for r in crashes:
            lines.append(f"- **{_md(r['trial'])}** ({_md(r.get('release') or 'no release')}): "
                         f"{_md(r.get('reason') or r['outcome'])}")
            for f in r.get("findings") or []:
                known = (f"known issue `{_code(f['entry'])}` ({_md(f['category'])}): {_md(f['title'])}"
                         if f.get("entry") else "no known issue matched")
                lines.append(f"  - {known}; root: `{_code(f.get('root_exception') or '-')}`"
                             + (f"; next step: patch `{_code(f['suggest']['patch'])}`"
                                if (f.get("suggest") or {}).get("patch") else ""))
        lines.append("")
    if data["drift"]:
        d = data["drift"]
        lines += ["## Drift of the base", "",
                  f"Re-benched at the end: {camp.objective.written} {fmt(d.get('before'))} -> {fmt(d.get('after'))}"
                  + (f" ({d['drift_pct']:+.1f}%)" if d.get("drift_pct") is not None else ""), ""]
    diff = script_diff(data)
    if diff:
        lines += ["## The winner's launch script against the base", "", "```diff", diff.rstrip("\n"), "```", ""]
    lines += ["![throughput and latency per level](levels.png)", "", "![Pareto front](pareto.png)", ""]
    return "\n".join(lines)


def _outcome(r: dict) -> str:
    if r["outcome"] == "ok":
        return "feasible"
    if r["outcome"] == "infeasible":
        return "violates " + "; ".join(v.replace("FAIL: ", "") for v in r["violations"])
    if r["outcome"] == "duplicate":
        return f"duplicate of {r.get('same_as')}"
    return r["outcome"] or "-"


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}
th{background:#f2f2f2}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.winner{background:#e8f6e8}tr.bad{background:#fbeaea}pre{background:#f7f7f7;padding:1em;overflow:auto}
img{max-width:100%}"""


def html_page(data: dict, pngs: dict[str, bytes]) -> str:
    camp = data["campaign"]
    e = html.escape
    w = data["winner"]
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(camp.name)} on {e(data['host'])}</title>"
           f"<style>{CSS}</style></head><body>",
           f"<h1>Tuning campaign <code>{e(camp.name)}</code> on {e(data['host'])}</h1>"]
    if camp.data.get("description"):
        out.append(f"<p>{e(str(camp.data['description']))}</p>")
    out.append(f"<p>Objective: {e(camp.objective.sense)} <code>{e(camp.objective.written)}</code>; constraints: "
               + (", ".join(f"<code>{e(str(c))}</code>" for c in camp.constraints if not c.implicit) or "none") + "</p>")
    out.append(f"<p id='winner' data-trial='{e(w['trial'])}'><b>Winner: {e(w['trial'])}</b> ({e(w['label'])}): "
               f"{e(camp.objective.written)} = {e(_objective_text(w, camp))}</p>" if w
               else "<p id='winner'>No trial met every constraint.</p>")
    head = ["trial", "flags vs base", "patches", "outcome", camp.objective.written] + [t for _k, t in METRIC_COLUMNS]
    out.append("<table id='trials'><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
    for r in data["rows"]:
        cls = "winner" if w and r["trial"] == w["trial"] else ("bad" if r["outcome"] not in ("ok",) else "")
        cells = [f"<td>{e(r['trial'])}<br><small>{e(r['label'])}</small></td>", f"<td>{e(r['flags'])}</td>",
                 f"<td>{e(r['patches'])}</td>", f"<td>{e(_outcome(r))}</td>",
                 f"<td class='num' data-key='objective'>{e(_objective_text(r, camp))}</td>"]
        cells += [f"<td class='num' data-key='{k}'>{e(fmt(r.get(k)))}</td>" for k, _t in METRIC_COLUMNS]
        out.append(f"<tr class='{cls}' data-trial='{e(r['trial'])}'>" + "".join(cells) + "</tr>")
    out.append(f"</table><p><small>Metrics at level {camp.objective.level}; ± is the 95% interval of repeated runs."
               "</small></p>")
    for name, title in (("levels", "Throughput and latency per level"), ("pareto", "Pareto front")):
        out.append(f"<h2>{title}</h2><img alt='{e(title)}' src='data:image/png;base64,"
                   f"{base64.b64encode(pngs[name]).decode()}'>")
    crashes = [r for r in data["rows"] if r.get("findings") or r["outcome"] in ("crashed", "failed", "timeout")]
    if crashes:
        out.append("<h2>Crashes and their diagnosis</h2><ul>")
        for r in crashes:
            items = "".join(
                f"<li>{'known issue <code>' + e(f['entry']) + '</code> (' + e(f['category']) + '): ' + e(f['title']) if f.get('entry') else 'no known issue matched'}"
                f"; root: <code>{e(f.get('root_exception') or '-')}</code>"
                + (f"; next step: patch <code>{e(f['suggest']['patch'])}</code>" if (f.get('suggest') or {}).get('patch') else "")
                + "</li>" for f in r.get("findings") or [])
            out.append(f"<li><b>{e(r['trial'])}</b> ({e(r.get('release') or 'no release')}): "
                       f"{e(r.get('reason') or r['outcome'])}<ul>{items}</ul></li>")
        out.append("</ul>")
    if data["drift"]:
        d = data["drift"]
        out.append(f"<h2>Drift of the base</h2><p id='drift'>{e(camp.objective.written)} {e(fmt(d.get('before')))} → "
                   f"{e(fmt(d.get('after')))}" + (f" ({d['drift_pct']:+.1f}%)" if d.get("drift_pct") is not None else "")
                   + "</p>")
    diff = script_diff(data)
    if diff:
        out.append(f"<h2>The winner's launch script against the base</h2><pre id='winner-diff'>{e(diff)}</pre>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(host: str, camp: Campaign) -> tuple[Path, Path]:
    data = collect(host, camp)
    pngs = plots(data)
    d = data["log"].parent
    for name, png in pngs.items():
        write_new(d / f"{name}.png", png)
    md = d / "report.md"
    write_new(md, markdown(data).encode())
    page = d / "report.html"
    write_new(page, html_page(data, pngs).encode())
    return md, page
