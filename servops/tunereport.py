"""`invoke tune.report CAMPAIGN`: a campaign's trials as Markdown and one self-contained HTML page,
and the summary table `tune` prints at its end.

Read from results/<host>/campaigns/<name>/trials.jsonl (and the bench files it names), nothing
else: a table of trials (each changed flag against the base on its own line, patches, outcome,
the objective with its 95% interval where repeats gave one and its change against the base, the
other key metrics, the verdict), throughput and latency per level per trial, the Pareto front of
each concurrency level, every crash with its diagnosis and exception line, the drift of the base,
and the winner with its flags and exact launch-script diff against the base. Plots are PNGs
embedded as data: URIs, so the page opens anywhere.
"""

from __future__ import annotations

import base64
import difflib
import html
import io
import json
import re
from pathlib import Path

from . import startup, verdict
from .campaign import Campaign
from .campaignrecord import (diagnosis_line, fleet_dir, fleet_runs, fleet_winner, log_path, min_gain, read_log,
                             rebench_runs, repeat_text, standings, trial_runs, trial_states)
from .localfiles import write_new  # a symlink planted at a report file is replaced, never followed
from .redact import MASK, is_secret_name

METRIC_COLUMNS = (("output_tps", "output tok/s"), ("ttft_p99", "TTFT p99 ms"), ("tpot_p50", "TPOT p50 ms"),
                  ("e2e_p50", "e2e p50 ms"))


def fmt(value, digits: int = 1) -> str:
    """One formatting for every number, in Markdown, HTML and the tests that compare them."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}"
    return str(value)


def _shown(value) -> str:
    return "on" if value is True else "unset" if value is None else "off" if value is False else str(value)


def flags_diff(base: dict, spec: dict) -> list[str]:
    """Each server arg / env var that differs from the base trial's, one per line:
    `--cuda-graph-max-bs: 4 -> 32`, `NCCL_NVLS_ENABLE: unset -> 1`."""
    out = []
    # as rendered on the host where the log has it (a `{{ max_num_seqs | default(256) }}` is 256)
    b_args, t_args = (s.get("rendered_args") or s.get("server_args") or {} for s in (base, spec))
    for k in sorted(set(b_args) | set(t_args)):
        if b_args.get(k) != t_args.get(k):
            old, new = (MASK if is_secret_name(k) and v not in (None, False, True) else v
                        for v in (b_args.get(k), t_args.get(k)))
            out.append(f"--{k}: {_shown(old)} -> {_shown(new)}")
    try:
        b_env, t_env = json.loads(base.get("env") or "{}"), json.loads(spec.get("env") or "{}")
    except ValueError:
        b_env, t_env = {}, {}
    for k in sorted(set(b_env) | set(t_env)):
        if b_env.get(k) != t_env.get(k):
            old, new = (MASK if is_secret_name(k) and v is not None else v for v in (b_env.get(k), t_env.get(k)))
            out.append(f"{k}: {_shown(old)} -> {_shown(new)}")
    return out


def collect(host: str, camp: Campaign) -> dict:
    """The report's data: one row per trial, in campaign order, from the log only."""
    path = log_path(host, camp.name)
    problems: list[str] = []
    entries = read_log(path, problems)
    if not entries:
        raise FileNotFoundError(f"no trials for campaign {camp.name} on {host}: {path} is missing or empty "
                                f"(run invoke tune {camp.name} -H {host} first)")
    states = trial_states(entries)
    order = [e["trial"] for e in entries if e.get("phase") == "start" or (e.get("phase") == "done" and "trial" in e)]
    order = list(dict.fromkeys(order))
    start_of = {tid: s.last("start") or {} for tid, s in states.items()}
    base_spec = (start_of.get("base") or {}).get("spec") or {}
    done = [states[tid].done for tid in order if states[tid].done]
    gain, gain_how = min_gain(camp, done)
    rebenched = rebench_runs(entries)
    winner_entry, verdicts = standings(camp, done, gain, rebenched)
    all_runs = trial_runs(done, rebenched)
    noise = verdict.pooled_noise(all_runs) if camp.sequential else None
    base_done = states["base"].done if "base" in states else None
    base_value = (base_done or {}).get("objective")
    rows = []
    for tid in order:
        d = states[tid].done
        start = start_of.get(tid) or {}
        if not d:
            rows.append({"trial": tid, "label": start.get("label", tid), "outcome": "interrupted",
                         "flags": ["(base)"] if tid == "base" else flags_diff(base_spec, start.get("spec") or {}),
                         "patches": ", ".join((start.get("spec") or {}).get("patches") or []) or "-", "metrics": {},
                         "verdict": "interrupted", "violations": [], "findings": []})
            continue
        spec = start.get("spec") or (start_of.get(d.get("same_as")) or {}).get("spec") or {}
        # the set as deployed where the log has it: the deploy's audit stage may have added to the variant's
        asked = spec.get("patches") or []
        deployed = [str(p) for p in d["patches"]] if isinstance(d.get("patches"), list) else asked
        base_set = (base_done or {}).get("patches") if isinstance((base_done or {}).get("patches"), list) \
            else base_spec.get("patches") or []
        added = [p if p in asked else f"{p} (the audit's)" for p in deployed if p not in base_set]
        value = d.get("objective")
        row = {"trial": tid, "label": d.get("label", tid), "outcome": d.get("outcome"),
               "objective": value, "objective_ci": d.get("objective_ci"), "metrics": d.get("metrics") or {},
               "vs_base": (None if value is None or not base_value or tid == "base"
                           else (value - base_value) / abs(base_value) * 100.0),
               "violations": d.get("violations") or [], "findings": d.get("findings") or [],
               "reason": d.get("reason"), "release": d.get("release"), "same_as": d.get("same_as"),
               "result_path": d.get("result_path"), "script": start.get("script"),
               "flags": ["(base)"] if tid == "base" else flags_diff(base_spec, spec),
               "added_patches": [] if tid == "base" else added,
               "patches": ", ".join(deployed) or "-", "retry_of": spec.get("retry_of"),
               "start": d.get("start") or {}, "warm_from": d.get("warm_from")}
        if camp.sequential and tid in all_runs:  # the interval of all its runs, on the campaign's final noise
            m, lo, hi = verdict.interval(all_runs[tid], noise, camp.confidence)
            row.update(objective=m, objective_ci=[lo, hi] if noise else None, runs=len(all_runs[tid]),
                       rebenched=len(rebenched.get(tid) or []), repeat_stop=d.get("repeat_stop"))
        lv = row["metrics"].get(str(camp.objective.level)) or {}
        for key, _title in METRIC_COLUMNS:
            row[key] = lv.get(key)
        row["verdict"] = _verdict(row, verdicts, winner_entry)
        rows.append(row)
    winner = next((r for r in rows if winner_entry and r["trial"] == winner_entry["trial"]), None)
    drift = next((e for e in reversed(entries) if e.get("phase") == "drift"), None)
    leave = next((e for e in reversed(entries) if e.get("phase") == "leave"), None)
    return {"campaign": camp, "host": host, "rows": rows, "winner": winner, "drift": drift, "leave": leave,
            "log": path, "base": next((r for r in rows if r["trial"] == "base"), None), "problems": problems,
            "min_gain": gain, "min_gain_how": gain_how, "noise": noise,
            "rebench": [e for e in entries if e.get("phase") == "rebench"]}


def _verdict(row: dict, verdicts: dict[str, str], winner: dict | None) -> str:
    outcome = row["outcome"]
    if outcome == "ok":
        text = verdicts.get(row["trial"], "")
        return f"WINNER; {text}" if winner and winner["trial"] == row["trial"] else text
    if outcome == "infeasible":
        return "infeasible"
    if outcome == "duplicate":
        return f"duplicate of {row.get('same_as')}: not run again"
    if outcome == "pruned":
        return f"pruned: {row.get('reason') or ''}"[:200]
    known = next((f["entry"] for f in row["findings"] if f.get("entry")), None)
    if known:
        return f"{outcome}: {known}"
    return f"{outcome}: {diagnosis_line(row['findings'], row.get('reason') or '')}"[:160]


def metric_columns(camp: Campaign) -> list[tuple[str, str]]:
    """The key metrics beside the objective's own column (its metric is not shown twice)."""
    return [(k, t) for k, t in METRIC_COLUMNS if k != camp.objective.metric]


def constraints_met(row: dict) -> str:
    if row["outcome"] == "ok":
        return "met"
    if row["outcome"] in ("infeasible", "pruned"):
        return "; ".join(row["violations"])
    return "-"


def vs_base(row: dict) -> str:
    return "(base)" if row["trial"].split("@")[0] == "base" else "-" if row.get("vs_base") is None else f"{row['vs_base']:+.1f}%"


def has_intervals(data: dict) -> bool:
    return any(r.get("objective_ci") for r in data["rows"])


def print_summary(host: str, camp: Campaign) -> None:
    """The table `tune` ends with: trial, changed flags, objective, constraints, verdict."""
    from .output import print_table, table

    data = collect(host, camp)
    runs = ["runs (why repeating stopped)"] if camp.sequential else []
    t = table(f"{host}: campaign {camp.name}: {camp.objective.sense} {camp.objective.written}, {rule_text(data)}",
              ["trial", "changed vs base", camp.objective.written, "vs base", "start", "constraints"] + runs
              + ["verdict"])
    for r in data["rows"]:
        changes = r["flags"] + [f"+ patch {p}" for p in r.get("added_patches") or []]
        t.add_row(r["trial"] + ("\n(warm start)" if r.get("warm_from") else ""), "\n".join(changes) or "(same as base)",
                  objective_cell(r), vs_base(r), start_short(r),
                  constraints_met(r), *([runs_cell(r)] if runs else []), r["verdict"])
    print_table(t)


def collect_fleet(hosts: list[str], camp: Campaign) -> dict:
    """A fleet campaign's report data: every host's rows (collect), each with its `host`; the
    verdicts and the winner the fleet's (each objective relative to its own host's base); each
    host's base row named base@host."""
    datas, done_by_host, rebenched_by_host = {}, {}, {}
    for h in hosts:
        try:
            datas[h] = collect(h, camp)
        except FileNotFoundError:
            continue
        entries = read_log(log_path(h, camp.name))
        done_by_host[h] = [s.done for s in trial_states(entries).values() if s.done]
        rebenched_by_host[h] = rebench_runs(entries)
    if not datas:
        raise FileNotFoundError(f"no trials for campaign {camp.name} on {', '.join(hosts)} (run invoke tune "
                                f"{camp.name} -H {','.join(hosts)} first)")
    best, verdicts, gain, how = fleet_winner(camp, done_by_host, rebenched_by_host)
    # a sequential campaign: every interval on the fleet's noise (pooled over all hosts' runs, each
    # relative to its own host's base), so the rows compare as the verdicts did
    noise = verdict.pooled_noise(fleet_runs(done_by_host, rebenched_by_host)) if camp.sequential else None
    rows, winner, base = [], None, None
    for h, data in datas.items():
        for r in data["rows"]:
            r = dict(r, host=h)
            if r["trial"] == "base" or r.get("retry_of") == "base":
                r["trial"] = f"{r['trial']}@{h}"
            mine = best is not None and best["host"] == h and best["trial"] == r["trial"].split("@")[0]
            if r["outcome"] == "ok":
                r["verdict"] = ("WINNER; " if mine else "") + verdicts.get((h, r["trial"].split("@")[0]), "")
            runs = trial_runs(done_by_host[h], rebenched_by_host[h]).get(r["trial"].split("@")[0])
            if noise and runs:
                m, lo, hi = verdict.interval(runs, noise, camp.confidence)
                r.update(objective=m, objective_ci=[lo, hi])
            if mine:
                winner = r
            rows.append(r)
    for r in rows:  # a duplicate of another host's trial: its settings are that trial's
        twin = next((x for x in rows if r["outcome"] == "duplicate" and x["trial"] == r.get("same_as")
                     and x["host"] != r["host"]), None)
        if twin:
            r.update(flags=twin["flags"], patches=twin["patches"], added_patches=twin.get("added_patches") or [])
    if best is not None:
        base = next((r for r in rows if r["trial"] == f"base@{best['host']}"), None)
    first = next(iter(datas.values()))
    return {"campaign": camp, "host": ", ".join(datas), "rows": rows, "winner": winner, "base": base,
            "drift": None, "leave": first["leave"], "log": fleet_dir(camp.name) / "fleet.json",
            "problems": [p for d in datas.values() for p in d["problems"]], "min_gain": gain, "min_gain_how": how,
            "noise": noise, "rebench": [dict(e, host=h) for h, d in datas.items() for e in d["rebench"]],
            "fleet": True, "drifts": {h: d["drift"] for h, d in datas.items() if d["drift"]}}


def print_fleet_summary(hosts: list[str], camp: Campaign) -> None:
    """The table a fleet campaign ends with: as one host's, with the host that ran each trial."""
    from .output import print_table, table

    data = collect_fleet(hosts, camp)
    runs = ["runs (why repeating stopped)"] if camp.sequential else []
    t = table(f"fleet {', '.join(hosts)}: campaign {camp.name}: {camp.objective.sense} {camp.objective.written} "
              f"(vs base: its own host's base), {rule_text(data)}",
              ["host", "trial", "changed vs base", camp.objective.written, "vs base", "constraints"] + runs
              + ["verdict"])
    for r in data["rows"]:
        changes = r["flags"] + [f"+ patch {p}" for p in r.get("added_patches") or []]
        t.add_row(r["host"], r["trial"], "\n".join(changes) or "(same as base)", objective_cell(r), vs_base(r),
                  constraints_met(r), *([runs_cell(r)] if runs else []), r["verdict"])
    print_table(t)


def _series(row: dict, key: str) -> tuple[list[int], list[float]]:
    pts = sorted((int(lv), m.get(key)) for lv, m in (row.get("metrics") or {}).items() if m.get(key) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def pareto_by_level(data: dict) -> dict[int, list[tuple[float, float, str]]]:
    """Per concurrency level: the trials no other trial beats at that level on both TTFT p99
    (lower) and output tok/s (higher), as (ttft_p99, output_tps, trial). Levels are never mixed:
    a level-1 point and a level-16 point measure different loads."""
    from .compare import pareto_front

    out = {}
    rows = [r for r in data["rows"] if r.get("metrics")]
    for lv in sorted({int(lv) for r in rows for lv in r["metrics"]}):
        pts = [(m["ttft_p99"], m["output_tps"], r["trial"]) for r in rows
               for m in [r["metrics"].get(str(lv)) or {}] if m.get("ttft_p99") is not None and m.get("output_tps") is not None]
        front = set(pareto_front([(p[0], p[1]) for p in pts]))
        out[lv] = sorted((p for p in pts if (p[0], p[1]) in front), key=lambda p: p[0])
    return out


def plots(data: dict) -> dict[str, bytes]:
    """PNG bytes: throughput and latency per level per trial, and the Pareto front per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .compare import level_axis, log_axis, place_labels, room_above

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
        if levels:
            level_axis(ax, levels)
        if log:
            log_axis(ax.yaxis)
        else:
            room_above(ax)
        ax.set_title(title)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
    if rows:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    out["levels"] = _png(fig, plt)
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^v<>ph*"
    trials = [r["trial"] for r in rows]
    for i, (lv, _front) in enumerate(pareto_by_level(data).items()):
        for r in rows:
            m = r["metrics"].get(str(lv)) or {}
            if m.get("output_tps") is not None and m.get("ttft_p99") is not None:
                ax.scatter([m["ttft_p99"]], [m["output_tps"]], s=30, marker=markers[i % len(markers)],
                           color=colors[trials.index(r["trial"]) % len(colors)])
    labels = []
    for i, (lv, front) in enumerate(pareto_by_level(data).items()):
        if front:
            ax.plot([f[0] for f in front], [f[1] for f in front], color="black", lw=1, ls="--", alpha=0.6,
                    marker=markers[i % len(markers)], markersize=11, markerfacecolor="none",
                    label=f"Pareto front, level {lv}")
            labels += [((f[0], f[1]), f"{f[2]}@{lv}", colors[trials.index(f[2]) % len(colors)]) for f in front]
    for t in trials:  # one legend entry per trial, in its colour
        ax.scatter([], [], color=colors[trials.index(t) % len(colors)], label=t)
    log_axis(ax.xaxis)
    ax.margins(x=0.15)
    room_above(ax)
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs TTFT p99: the Pareto front of each level (marker: level)")
    ax.grid(True, alpha=0.3)
    legend = ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0)) if trials else None
    fig.tight_layout()
    place_labels(ax, labels, [legend])
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


def objective_cell(row: dict) -> str:
    ci = row.get("objective_ci")
    n = row.get("runs") or 0
    return (fmt(row.get("objective")) + (f" ± {fmt((ci[1] - ci[0]) / 2)}" if ci else "")
            + (f" ({n} runs)" if n > 1 else ""))


def runs_cell(row: dict) -> str:
    """A sequential campaign's runs of a trial and why repeating stopped (the re-bench's runs apart)."""
    if not row.get("runs"):
        return "-"
    extra = f" + {row['rebenched']} re-bench" if row.get("rebenched") else ""
    return f"{row['runs'] - (row.get('rebenched') or 0)}{extra}: {row.get('repeat_stop') or '-'}"


def repeat_lines(data: dict) -> list[str]:
    """A sequential campaign: each feasible trial's runs, interval and why repeating stopped; then
    each re-bench run and why the re-bench ended."""
    if not data["campaign"].sequential:
        return []
    out = [f"{r['trial']}: {objective_cell(r)}; {runs_cell(r)}" for r in data["rows"] if r.get("runs")]
    for e in data.get("rebench") or []:
        if e.get("trial"):
            out.append(f"re-bench round {e.get('round')}: {e['trial']}{'@' + e['host'] if e.get('host') else ''}: "
                       + (fmt(e["runs"][0]) if e.get("runs") else f"{e.get('outcome')}: {e.get('reason') or ''}"))
        elif e.get("outcome") == "finished":
            out.append(f"re-bench ended: {e.get('reason')}")
    return out


def rule_text(data: dict) -> str:
    """How the campaign told a gain from noise: its intervals' noise, or min_gain."""
    camp = data["campaign"]
    if camp.sequential:
        noise = data.get("noise")
        return (f"{camp.confidence * 100:g}% intervals, noise {noise.how}; {repeat_text(camp)}" if noise else
                f"{camp.confidence * 100:g}% intervals, no noise measured")
    return f"min_gain {data['min_gain'] * 100:.1f}% ({data['min_gain_how']})"


def _md(value) -> str:
    """Text for a Markdown line or table cell: no raw HTML (a server's error text could carry
    `<img onerror=...>` into a viewer that renders it), no line break, no cell break."""
    text = " ".join(str(value).split())
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text).replace("|", "\\|")  # `<= 300` stays readable


def _code(value) -> str:
    """Text for a `code span`: no backtick can end it, no line break."""
    return " ".join(str(value).replace("`", "'").split())


def head(camp: Campaign, fleet: bool = False) -> list[str]:
    return (["host"] * fleet + ["trial", "flags vs base", "patches", "outcome", camp.objective.written, "vs base"]
            + [t for _k, t in metric_columns(camp)] + ["start-up", "verdict"])


def cells(r: dict, camp: Campaign) -> list[tuple[str, list[str]]]:
    """A trials-table row as (data key, lines): flags one per line, every other cell one line."""
    trial = [r["trial"]] + ([f"warm start: {r['warm_from']}"] if r.get("warm_from") else [])
    return ([("host", [r["host"]])] if "host" in r else []) + ([("trial", trial), ("flags", r["flags"] or ["(same as base)"]), ("patches", [r["patches"]]),
             ("outcome", [_outcome(r)]), ("objective", [objective_cell(r)]), ("vs_base", [vs_base(r)])]
            + [(k, [fmt(r.get(k))]) for k, _t in metric_columns(camp)] + [("start", [start_cell(r)])]
            + [("verdict", [r["verdict"]])])


def start_short(r: dict) -> str:
    """The console's start column: time to healthy (the report has the engine's phases too)."""
    return f"{r['start']['start_s']:.1f}s" if "start_s" in (r.get("start") or {}) else "-"


def start_cell(r: dict) -> str:
    """The trial's start-up: time to healthy and the engine's own phases (`start to healthy 35.2s (capture 12.1s)`)."""
    return startup.text(r["start"]) if r.get("start") else "-"


def crash_lines(f: dict) -> list[tuple[str, str]]:
    """One finding of a crash as (label, text): the known issue, the exception line, the root
    cause where it differs, the last frames and the patch to try."""
    out = [("known issue", f"{f['entry']} ({f.get('category')}): {f.get('title')}" if f.get("entry")
            else "none matched" if not f.get("error") else f"not diagnosed: {f['error']}")]
    exception = f.get("final_exception") or f.get("root_exception")
    if exception:
        out.append(("exception", exception))
    if f.get("root_exception") and f.get("root_exception") != exception:
        out.append(("root cause", f["root_exception"]))
    out += [("frame", fr) for fr in f.get("last_frames") or []]
    if (f.get("suggest") or {}).get("patch"):
        out.append(("next step", f"patch {f['suggest']['patch']}"))
    return out


def _footnote(data: dict) -> str:
    camp = data["campaign"]
    text = f"Metrics at level {camp.objective.level}; vs base: the objective's change against the base trial."
    if data["campaign"].sequential and data.get("noise"):
        text += (f" ± is the {data['campaign'].confidence * 100:g}% interval of the trial's runs, on the campaign's "
                 f"noise ({data['noise'].how}).")
    elif has_intervals(data):
        text += " ± is the 95% interval of repeated runs."
    return text


def _constraints(camp: Campaign) -> list[str]:
    """As the campaign file wrote them (`failed == 0`, not the error_rate terms it becomes)."""
    return [str(c) for c in camp.data["objective"].get("constraints") or []]


def markdown(data: dict) -> str:
    camp = data["campaign"]
    lines = [f"# Tuning campaign `{camp.name}` on {data['host']}", ""]
    if camp.data.get("description"):
        lines += [_md(camp.data["description"]), ""]
    lines += [f"- objective: {camp.objective.sense} `{camp.objective.written}`",
              "- constraints: " + (", ".join(f"`{_code(c)}`" for c in _constraints(camp)) or "none"),
              (f"- verdicts: {_md(rule_text(data))}; a trial was benched again while unsure, up to "
               f"{camp.max_repeats} runs" if camp.sequential else
               f"- min_gain: {data['min_gain'] * 100:.1f}% ({_md(data['min_gain_how'])}): a smaller difference is a tie"),
              f"- trials: {len(data['rows'])} (log: `{data['log']}`)"]
    lines += [f"- log: {_md(p)}" for p in data["problems"]]
    w = data["winner"]
    lines += [f"- **winner: {_md(w['trial'])}** ({_md(w['label'])}): {camp.objective.written} = {objective_cell(w)}"
              if w else "- no trial met every constraint", ""]
    columns = head(camp, bool(data.get("fleet")))
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in data["rows"]:
        lines.append("| " + " | ".join("<br>".join(_md(x) for x in text) for _k, text in cells(r, camp)) + " |")
    lines += ["", _footnote(data), ""]
    repeats = repeat_lines(data)
    if repeats:
        lines += ["## Repeats and the end re-bench", ""] + [f"- {_md(x)}" for x in repeats] + [""]
    lines += ["## Pareto front per level", ""]
    for lv, front in pareto_by_level(data).items():
        lines.append(f"- level {lv}: " + (", ".join(f"{_md(t)} ({fmt(tps)} tok/s, TTFT p99 {fmt(ttft)} ms)"
                                                   for ttft, tps, t in front) or "no point"))
    lines.append("")
    crashes = [r for r in data["rows"] if r.get("findings") or r["outcome"] in ("crashed", "failed", "timeout")]
    if crashes:
        lines += ["## Crashes and their diagnosis", ""]
        for r in crashes:
            lines.append(f"- **{_md(r['trial'])}** ({_md(r.get('release') or 'no release')}): "
                         f"{_md(r.get('reason') or r['outcome'])}")
            for f in r.get("findings") or []:
                lines += [f"  - {label}: `{_code(text)}`" for label, text in crash_lines(f)]
        lines.append("")
    if data["drift"]:
        d = data["drift"]
        lines += ["## Drift of the base", "",
                  f"Re-benched at the end: {camp.objective.written} {fmt(d.get('before'))} -> {fmt(d.get('after'))}"
                  + (f" ({d['drift_pct']:+.1f}%)" if d.get("drift_pct") is not None else ""), ""]
    if w:
        lines += [f"## The winner, {_md(w['trial'])}, against the base", ""]
        lines += [f"- `{_code(flag)}`" for flag in w["flags"] if flag != "(base)"] or ["- the base itself"]
        lines.append("")
    diff = script_diff(data)
    if diff:
        lines += ["Its launch script against the base's:", "", "```diff", diff.rstrip("\n"), "```", ""]
    lines += ["![throughput and latency per level](levels.png)", "", "![Pareto front per level](pareto.png)", ""]
    return "\n".join(lines)


def _outcome(r: dict) -> str:
    if r["outcome"] == "ok":
        return "feasible"
    if r["outcome"] == "infeasible":
        return "violates " + "; ".join(r["violations"])
    if r["outcome"] == "duplicate":
        return f"duplicate of {r.get('same_as')}"
    if r["outcome"] == "pruned":
        return "pruned: violates " + "; ".join(r["violations"])
    return r["outcome"] or "-"


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}
th{background:#f2f2f2}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.winner{background:#e8f6e8}tr.bad{background:#fbeaea}pre{background:#f7f7f7;padding:1em;overflow:auto}
div.flag{font-family:monospace;white-space:nowrap}img{max-width:100%}"""
_NUMERIC = {"objective", "vs_base"} | {k for k, _t in METRIC_COLUMNS}


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
               + (", ".join(f"<code class='constraint'>{e(c)}</code>" for c in _constraints(camp)) or "none")
               + (f"; verdicts: <span id='rule'>{e(rule_text(data))}</span>.</p>" if camp.sequential else
                  f"; min_gain <span id='min-gain'>{data['min_gain'] * 100:.1f}%</span> ({e(data['min_gain_how'])}): "
                  "a smaller difference is a tie.</p>"))
    out += [f"<p class='log-problem'>{e(p)}</p>" for p in data["problems"]]
    out.append(f"<p id='winner' data-trial='{e(w['trial'])}'><b>Winner: {e(w['trial'])}</b> ({e(w['label'])}): "
               f"{e(camp.objective.written)} = {e(objective_cell(w))}</p>" if w
               else "<p id='winner'>No trial met every constraint.</p>")
    out.append("<table id='trials'><tr>" + "".join(f"<th>{e(h)}</th>" for h in head(camp, bool(data.get("fleet"))))
               + "</tr>")
    for r in data["rows"]:
        cls = "winner" if w and r["trial"] == w["trial"] else ("bad" if r["outcome"] not in ("ok",) else "")
        tds = []
        for key, text in cells(r, camp):
            body = ("".join(f"<div class='flag'>{e(x)}</div>" for x in text) if key == "flags" else e(text[0])
                    + (f"<br><small>{e(r['label'])}</small>" if key == "trial" else "")
                    + "".join(f"<br><small class='warm'>{e(x)}</small>" for x in text[1:] if key == "trial"))
            tds.append(f"<td{' class=num' if key in _NUMERIC else ''} data-key='{key}'>{body}</td>")
        host = f" data-host='{e(r['host'])}'" if "host" in r else ""
        out.append(f"<tr class='{cls}' data-trial='{e(r['trial'])}'{host}>" + "".join(tds) + "</tr>")
    out.append(f"</table><p id='footnote'><small>{e(_footnote(data))}</small></p>")
    if repeat_lines(data):
        out.append("<h2>Repeats and the end re-bench</h2><ul id='repeats'>"
                   + "".join(f"<li>{e(x)}</li>" for x in repeat_lines(data)) + "</ul>")
    out.append("<h2>Pareto front per level</h2><ul id='pareto'>")
    for lv, front in pareto_by_level(data).items():
        out.append(f"<li data-level='{lv}'>level {lv}: " + (", ".join(
            f"<span class='front' data-trial='{e(t)}'>{e(t)}</span> ({e(fmt(tps))} tok/s, TTFT p99 {e(fmt(ttft))} ms)"
            for ttft, tps, t in front) or "no point") + "</li>")
    out.append("</ul>")
    for name, title in (("levels", "Throughput and latency per level"), ("pareto", "Throughput against TTFT p99")):
        out.append(f"<h2>{title}</h2><img alt='{e(title)}' src='data:image/png;base64,"
                   f"{base64.b64encode(pngs[name]).decode()}'>")
    crashes = [r for r in data["rows"] if r.get("findings") or r["outcome"] in ("crashed", "failed", "timeout")]
    if crashes:
        out.append("<h2>Crashes and their diagnosis</h2><ul id='crashes'>")
        for r in crashes:
            items = "".join("<li><ul>" + "".join(f"<li class='{e(label.replace(' ', '-'))}'>{e(label)}: <code>{e(text)}"
                                                 "</code></li>" for label, text in crash_lines(f)) + "</ul></li>"
                            for f in r.get("findings") or [])
            out.append(f"<li data-trial='{e(r['trial'])}'><b>{e(r['trial'])}</b> ({e(r.get('release') or 'no release')}): "
                       f"{e(r.get('reason') or r['outcome'])}<ul>{items}</ul></li>")
        out.append("</ul>")
    if data["drift"]:
        d = data["drift"]
        out.append(f"<h2>Drift of the base</h2><p id='drift'>{e(camp.objective.written)} {e(fmt(d.get('before')))} → "
                   f"{e(fmt(d.get('after')))}" + (f" ({d['drift_pct']:+.1f}%)" if d.get("drift_pct") is not None else "")
                   + "</p>")
    if w:
        out.append(f"<h2>The winner, {e(w['trial'])}, against the base</h2><ul id='winner-flags'>"
                   + ("".join(f"<li><code>{e(f)}</code></li>" for f in w["flags"] if f != "(base)")
                      or "<li>the base itself</li>") + "</ul>")
    diff = script_diff(data)
    if diff:
        out.append(f"<p>Its launch script against the base's:</p><pre id='winner-diff'>{e(diff)}</pre>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(host: str, camp: Campaign, fleet: list[str] | None = None) -> tuple[Path, Path]:
    """One host's report beside its trials.jsonl; `fleet` (its hosts): the fleet campaign's,
    in results/_fleet/<name>/, with the host of each trial."""
    from .output import err_console

    data = collect_fleet(fleet, camp) if fleet else collect(host, camp)
    for line in data["problems"]:
        err_console.print(f"warning: {line}", markup=False, highlight=False)
    pngs = plots(data)
    d = data["log"].parent
    for name, png in pngs.items():
        write_new(d / f"{name}.png", png)
    md = d / "report.md"
    write_new(md, markdown(data).encode())
    page = d / "report.html"
    write_new(page, html_page(data, pngs).encode())
    return md, page
