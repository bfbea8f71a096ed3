"""`invoke bench`: SGLang bench_serving's metrics and load patterns, run on the host.

One result file per run, `results/<host>/<release>/<UTC time>.jsonl`: one line per level (and
repeat) in bench_serving's JSONL format -- its keys in its order, with its meanings (its
`--output-details` per-request keys included) -- plus one key of servops' own, "servops": host,
variant, release, patches, git sha, the host's sglang version, the level's failures, warmup,
/flush_cache outcome, the server's own metrics during the level (histogram deltas, max queue,
max token usage, retractions, a 1 Hz series) and GPU telemetry (nvidia-smi at 1 Hz). Lines are
written as levels finish, so a server that dies mid-run leaves every finished level on disk.

In memory a result is {host, release, variant, ..., "levels": [one summary per level, repeats
aggregated: mean and 95% interval], "runs": [one summary per line]}; gate, compare and push
read the summaries (short names: output_tps, ttft_p99, tpot_p50, goodput, error_rate, ...).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from pathlib import Path
from typing import Any

from . import engines, localfiles, releases
from .errors import RemoteError, ServopsError
from .output import console, err_console, is_tty, json_text, print_table, table
from .provenance import git_sha
from .redact import redact_values
from .remote import jsonl
from .remote_exec import run_program
from .transport import HostSession

RESULTS_ROOT = Path(os.environ.get("SERVOPS_RESULTS") or Path(__file__).resolve().parent.parent / "results")
DEFAULT_LEVELS = (1, 10, 256, 1024)
DATASETS = ("random", "random-ids", "sharegpt", "prompts")
SLO_METRICS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}
MAX_DATASET_BYTES = 256 << 20
MAX_DATASET_ROWS = 50_000
# Bounds on what a bench may ask for (flags and campaign files alike): far above any real run
# (bench_serving defaults to 1,000 prompts; contexts are at most ~1M tokens), far below what would
# exhaust the host's memory or run for years.
MAX_CONCURRENCY = 100_000
MAX_REQUESTS = 1_000_000       # per level; warmup requests too
MAX_TOKENS = 1 << 20           # input_len / output_len
MAX_REPEAT = 100

# Summary metrics that repeats average (with a 95% interval); the gate may name any of them.
STAT_NAMES = ("mean", "p50", "std", "p90", "p95", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2e")
METRICS = (("output_tps", "request_rate", "input_tps", "total_tps", "max_output_tokens_per_s", "achieved_concurrency",
            "goodput", "request_goodput", "error_rate", "duration_s")
           + tuple(f"{lat}_{s}" for lat in LATENCIES for s in STAT_NAMES))


class BenchError(ServopsError):
    pass


# ------------------------------------------------------------------------------ options

def parse_levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in re.split(r"[,\s]+", str(spec).strip()) if x]
    except ValueError:
        raise BenchError(f"--levels {spec!r}: expected comma-separated integers like 1,10,256,1024") from None
    if not levels or any(lv < 1 for lv in levels):
        raise BenchError(f"--levels {spec!r}: each level must be 1 or more")
    if any(lv > MAX_CONCURRENCY for lv in levels):
        raise BenchError(f"--levels {spec!r}: each level must be {MAX_CONCURRENCY:,} or less")
    return levels


def check_counts(requests: int = 0, input_len: int = 1, output_len: int = 0, warmup: int | None = None,
                 repeat: int = 1) -> None:
    """Bench sizes within bounds (see MAX_REQUESTS): one line naming the flag."""
    for flag, value, low, high in (("requests", requests, 0, MAX_REQUESTS), ("input-len", input_len, 1, MAX_TOKENS),
                                   ("output-len", output_len, 0, MAX_TOKENS), ("warmup", warmup or 0, 0, MAX_REQUESTS),
                                   ("repeat", repeat, 1, MAX_REPEAT)):
        if not low <= value <= high:
            raise BenchError(f"--{flag} {value}: must be {low} to {high:,}")


def parse_warmup(spec) -> int | None:
    """--warmup: auto (None: adaptive, until the server's TTFT settles), 0 (none) or N requests."""
    text = str(spec).strip().lower()
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise BenchError(f"--warmup {spec!r}: expected auto (warm up until TTFT settles), 0 (none) or a number "
                         f"of requests") from None
    check_counts(warmup=value)
    return value


def parse_rate(spec) -> float | None:
    """--request-rate: requests per second, or inf (None): every request sent at once."""
    text = str(spec).strip().lower()
    if text in ("", "inf", "infinity"):
        return None
    try:
        rate = float(text)
    except ValueError:
        raise BenchError(f"--request-rate {spec!r}: expected requests per second (a number > 0) or inf") from None
    if not math.isfinite(rate) and rate > 0:
        return None
    if not rate > 0:
        raise BenchError(f"--request-rate {spec!r}: must be more than 0 (or inf)")
    return rate


def parse_slo(spec: str) -> dict[str, float] | None:
    """--slo ttft:500,tpot:50 (milliseconds; keys ttft, tpot, e2el) -> {"ttft": 500.0, ...}."""
    if not spec or not str(spec).strip():
        return None
    out: dict[str, float] = {}
    for part in re.split(r"[,\s]+", str(spec).strip()):
        if not part:
            continue
        name, _, value = part.partition(":")
        key = SLO_METRICS.get(name.strip().lower())
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if key is None or not (math.isfinite(ms) and ms > 0):
            raise BenchError(f"--slo {part!r}: expected KEY:MILLISECONDS with KEY ttft, tpot or e2el, e.g. ttft:500,tpot:50")
        out[key] = ms
    return out


def load_dataset(spec: str = "random", path: str = "", seed: int = 42) -> dict | None:
    """The dataset spec the load generator takes. `spec`: random, random-ids, sharegpt, prompts,
    or (as before) a file path: a JSON list of conversations is ShareGPT, anything else prompts.
    File datasets are read here and their rows shipped to the host (at most 50,000, sampled)."""
    spec = (spec or "random").strip()
    if spec in ("random", "random-ids") and not path:
        return None if spec == "random" else {"kind": spec}
    if spec in ("random", "random-ids"):
        raise BenchError(f"--dataset-path is for the sharegpt and prompts datasets, not {spec}")
    if spec not in DATASETS:
        if path:
            raise BenchError(f"--dataset {spec!r}: expected one of {', '.join(DATASETS)}")
        spec, path = "", spec
    if not path:
        raise BenchError(f"--dataset {spec}: give the file with --dataset-path")
    p = Path(path).expanduser()
    if not p.is_file():
        raise BenchError(f"--dataset-path {path!r}: no such local file "
                         f"(expected {'a ShareGPT JSON file' if spec == 'sharegpt' else 'a prompt file'})")
    if p.stat().st_size > MAX_DATASET_BYTES:
        raise BenchError(f"--dataset-path {path}: {p.stat().st_size >> 20} MiB; at most {MAX_DATASET_BYTES >> 20} MiB "
                         "(sample it down first)")
    text = p.read_text(encoding="utf-8", errors="replace")
    kind = spec or ("sharegpt" if text.lstrip().startswith("[") else "prompts")
    rows = _sharegpt_rows(text, path) if kind == "sharegpt" else _prompt_rows(text, path)
    if not rows:
        raise BenchError(f"--dataset-path {path}: no prompts found"
                         + (" (ShareGPT: a JSON list of {'conversations': [{'value': prompt}, {'value': answer}]})"
                            if kind == "sharegpt" else ""))
    if len(rows) > MAX_DATASET_ROWS:
        rows = random.Random(seed).sample(rows, MAX_DATASET_ROWS)
    return {"kind": kind, "rows": rows, "path": str(p)}


def _sharegpt_rows(text: str, path: str) -> list:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BenchError(f"--dataset-path {path}: not JSON ({exc})") from None
    except RecursionError:
        raise BenchError(f"--dataset-path {path}: not a ShareGPT file (JSON nested too deeply)") from None
    if not isinstance(data, list):
        raise BenchError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations")
    rows = []
    for item in data:
        conv = isinstance(item, dict) and (item.get("conversations") or item.get("conversation"))
        if isinstance(conv, list) and len(conv) >= 2 and all(isinstance(c, dict) for c in conv[:2]):
            rows.append([str(conv[0].get("value", "")), str(conv[1].get("value", ""))])
    return rows


def _prompt_rows(text: str, path: str) -> list:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(line)
            except (ValueError, RecursionError):
                raise BenchError(f"--dataset-path {path}: a line starting with '{{' is not JSON: {line[:60]}") from None
            line = str(obj.get("prompt") or obj.get("text") or "")
        if line:
            rows.append([line, None])
    return rows


# ------------------------------------------------------------------------------ running

def run_bench(hs: HostSession, levels: list[int], requests: int = 0, input_len: int = 128, output_len: int = 128,
              dataset: dict | None = None, *, request_rate: float | None = None, burstiness: float = 1.0,
              warmup: int | None = None, flush_cache: bool = True, seed: int = 42, range_ratio: float = 1.0,
              tokenizer: str | None = None, slo: dict | None = None, repeat: int = 1,
              keep_text: bool = False) -> dict:
    """Run the load generator on the host against the current server; save and return the result.

    levels: the concurrency of each level (with a request rate: its concurrency cap).
    output_len 0: 128, or for sharegpt each conversation's answer length.
    warmup: None adaptive (each level warmed until its TTFT settles), 0 none, N requests.
    keep_text: keep each request's whole generated text (else its first 1,000 characters)."""
    if not levels or any(not 1 <= int(lv) <= MAX_CONCURRENCY for lv in levels):
        raise BenchError(f"levels {levels}: each level must be 1 to {MAX_CONCURRENCY:,}")
    check_counts(requests, input_len, output_len, warmup, repeat)
    if burstiness <= 0:
        raise BenchError(f"--burstiness {burstiness}: must be more than 0")
    if not 0.0 <= range_ratio <= 1.0:
        raise BenchError(f"--range-ratio {range_ratio}: must be between 0 and 1")
    state = releases.ctl(hs, "status")
    release = state["release"] or {}
    if not state["server"]:
        raise BenchError(f"{hs.host.name}: no server running (invoke status); deploy first")
    kind = (dataset or {}).get("kind", "random")
    out_len = output_len or (0 if kind == "sharegpt" else 128)
    args = {"port": int(state["server"].get("port") or hs.host.require("server_port")), "levels": [int(x) for x in levels],
            "requests": int(requests), "input_len": int(input_len), "output_len": int(out_len),
            "dataset": dataset or {"kind": "random"}, "request_rate": request_rate, "burstiness": float(burstiness),
            "warmup": None if warmup is None else int(warmup), "flush_cache": bool(flush_cache), "seed": int(seed), "range_ratio": float(range_ratio),
            "tokenizer": tokenizer or None, "slo": slo or None, "repeat": int(repeat), "keep_text": bool(keep_text)}
    engine = engines.get(release.get("engine"))
    if engine.name != engines.DEFAULT:  # an sglang bench sends what it always sent
        request = engine.request
        args.update(engine=engine.name, engine_dists=list(engine.dists))
        if request.get("model") == "served":
            args["model_from_server"] = True  # vLLM serves only the model /v1/models names
        if not request.get("flush"):
            args["flush_cache"] = False  # no cache flush outside vLLM's dev mode
        if request.get("empty_is_token"):
            args["empty_is_token"] = True  # a chunk of empty text is a token, as the engine's own bench counts
    config = {k: v for k, v in args.items() if k != "dataset"}
    config["request_rate"] = "inf" if request_rate is None else request_rate
    config["dataset"] = {"kind": kind, **({"path": dataset["path"], "rows": len(dataset["rows"])} if dataset and "rows" in dataset else {})}
    meta = {"host": hs.host.name, "release": state["current"], "variant": release.get("variant"),
            "patches": release.get("patches") or [], "servops_git": git_sha(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": config}
    path = new_result_path(hs.host.name, state["current"])
    result = dict(meta, levels=[], runs=[], path=str(path), complete=False, stopped=None, warnings=[])
    progress = _progress(hs.host.name, len(levels) * repeat)
    lines = 0

    def on_progress(p: dict) -> None:
        nonlocal lines
        if p.get("progress") != "level":
            progress(p)
            return
        hs.redactor.learn(p["record"].get("server_info"))  # its api_key, repeated in launch_command
        line = redact_values(p["record"], hs.redactor)
        line["server_info"] = _mask_secret_keys(line.get("server_info"))
        line["servops"] = dict(redact_values(meta, hs.redactor), **line["servops"])
        _add_server_quantiles(line["servops"].get("server_metrics"))
        lines += 1
        run = run_summary(line)
        result["runs"].append(run)
        progress.level_done(run)
        if not result.get("save_error"):
            # a full or read-only local disk is the operator's problem to fix, not the host's: the
            # bench goes on, its numbers are printed, and the save failure is named at the end
            try:
                localfiles.append_text(path, json_text(line) + "\n")
            except OSError as exc:
                result["save_error"] = f"cannot write {path}: {exc.strerror or exc}"

    try:
        res = run_program(hs, "loadgen", args, timeout=24 * 3600, on_progress=on_progress)
        result["stopped"] = res.get("stopped")
    except RemoteError as exc:
        if not lines:
            raise
        result["stopped"] = hs.redactor(str(exc))
    finally:
        progress.close()
    if not lines:
        raise BenchError(f"{hs.host.name}: the load generator finished without a result")
    finish(result, expected_levels=levels, repeat=repeat)
    if result.get("save_error"):
        print_result(result)  # the measured numbers, before saying they could not be kept
        raise BenchError(f"{hs.host.name}: {result['save_error']}; the numbers above were measured but not saved")
    return result


def finish(result: dict, expected_levels: list[int] | None = None, repeat: int = 1) -> dict:
    """Aggregate the runs into level summaries; completeness and warnings."""
    runs = result["runs"]
    result["levels"] = aggregate(runs)
    if runs:
        result["sglang_version"] = runs[0].get("sglang_version")
    want = expected_levels or [lv["concurrency"] for lv in result["levels"]]
    result["complete"] = (len(runs) == len(want) * repeat and all(r["failed"] == 0 for r in runs))
    warnings = result.setdefault("warnings", [])
    for r in runs:
        flush = r.get("flush_cache") or {}
        if flush.get("requested") and not flush.get("ok"):
            warnings.append(f"level {r['concurrency']}: the server refused /flush_cache "
                            f"({flush.get('status') or 'no answer'}: {(flush.get('message') or '').strip()[:120]}); "
                            "the prefix cache was not flushed")
        warm = r.get("warmup") or {}
        if warm.get("error"):
            warnings.append(f"level {r['concurrency']}: warmup failed ({warm['error'][:500]}); level not run")
        elif warm.get("converged") is False:
            warnings.append(f"level {r['concurrency']}: the warm-up did not settle ({warm.get('why')}; mean TTFT per "
                            f"wave {warm_ttfts(warm)} ms): its first requests may still pay for compilation")
    units = {r.get("input_len_unit") for r in runs}
    if "words" in units:
        warnings.append("--input-len counted in words (no --tokenizer); the server's own prompt token counts "
                        "are in each line's servops.per_request.server_prompt_tokens")
    if result.get("stopped"):
        warnings.append(f"stopped early: {result['stopped']}")
    return result


def new_result_path(host: str, release: str | None) -> Path:
    # `release` is what the host says is current: a directory name here only when it is a release name
    d = RESULTS_ROOT / host / (release if releases.RELEASE_NAME_RE.fullmatch(release or "") else "unknown")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path, n = d / f"{stamp}.jsonl", 1
    try:
        localfiles.private_dir(d)
        while os.path.lexists(path.with_suffix(".json")) or not localfiles.create_new(path):
            n += 1
            path = d / f"{stamp}-{n}.jsonl"
    except OSError as exc:
        raise BenchError(f"cannot create a result file in {d}: {exc.strerror or exc}; nothing was run") from None
    return path


def _mask_secret_keys(obj: Any) -> Any:
    """sglang's /server_info carries its server args (api_key, ...): mask secret-looking keys."""
    from .redact import MASK, is_secret_name

    if isinstance(obj, dict):
        return {k: (MASK if v not in (None, "") and is_secret_name(str(k)) and not isinstance(v, (dict, list))
                    else _mask_secret_keys(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mask_secret_keys(v) for v in obj]
    return obj


def _add_server_quantiles(sm: dict | None) -> None:
    """p50/p90/p99 of the server's histograms over the level (Prometheus' histogram_quantile)."""
    if not sm:
        return
    from .metrics import histogram_quantile

    for h in (sm.get("histograms") or {}).values():
        buckets = [(math.inf if le == "+Inf" else float(le), float(c)) for le, c in h.get("buckets", [])]
        for q in (0.5, 0.9, 0.99):
            v = histogram_quantile(q, buckets)
            h[f"p{int(q * 100)}_ms"] = None if v is None else v * 1000.0


# ------------------------------------------------------------------------------ summaries

def run_summary(line: dict) -> dict:
    """servops' short-named summary of one bench_serving-format line."""
    s = line.get("servops") or {}
    requests = s.get("requests", len(line.get("errors") or []) or line["completed"])
    failed = s.get("failed", requests - line["completed"])
    out = {"concurrency": s.get("level", line.get("max_concurrency")), "repeat": s.get("repeat", 0),
           "requests": requests, "completed": line["completed"], "failed": failed,
           "duration_s": line["duration"], "request_rate": line["request_throughput"],
           "output_tps": line["output_throughput"], "input_tps": line["input_throughput"],
           "total_tps": line["total_throughput"], "output_tokens": line["total_output_tokens"],
           "max_output_tokens_per_s": line["max_output_tokens_per_s"],
           "max_concurrent_requests": line["max_concurrent_requests"], "achieved_concurrency": line["concurrency"],
           "configured_rate": line["request_rate"], "achieved_request_rate": s.get("achieved_request_rate"),
           "error_rate": failed / requests if requests else 0.0, "errors": s.get("errors") or {},
           "goodput": line.get("slo_attainment"), "request_goodput": line.get("request_goodput"),
           "slo_attainment_by_metric": line.get("slo_attainment_by_metric"), "slo": line.get("goodput_slos_ms"),
           "warmup": s["warmup"] if isinstance(s.get("warmup"), dict) else {},
           "flush_cache": s.get("flush_cache") or {},
           "input_len_unit": s.get("input_len_unit"), "sglang_version": s.get("sglang_version"),
           "stopped": s.get("stopped")}
    names = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2e_latency"}
    for short, long in names.items():
        for stat, prefix in zip(STAT_NAMES, ("mean", "median", "std", "p90", "p95", "p99")):
            out[f"{short}_{stat}"] = line.get(f"{prefix}_{long}_ms")
    sm = s.get("server_metrics") or {}
    hist = sm.get("histograms") or {}
    out["server"] = {k: sm.get(k) for k in ("max_running", "max_queue", "max_token_usage", "max_gen_throughput",
                                            "retractions", "max_retracted", "requests", "generation_tokens", "error")
                     if sm.get(k) is not None}
    for h in ("ttft", "itl", "e2e"):
        if h in hist:
            out["server"][f"{h}_p50_ms"] = hist[h].get("p50_ms")
            out["server"][f"{h}_p99_ms"] = hist[h].get("p99_ms")
    gpu = s.get("gpu") or {}
    out["gpu"] = gpu.get("summary") or ({"error": gpu["error"]} if gpu.get("error") else None)
    return out


# two-sided 95% Student t quantiles by degrees of freedom
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: float) -> float:
    if df < 1:
        return math.inf
    for k in sorted(_T975):
        if df <= k:
            return _T975[k]
    return 1.960


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean's 95% interval (Student t); one value: a zero-width interval."""
    n = len(values)
    m = math.fsum(values) / n
    if n < 2:
        return m, m, m
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half


def aggregate(runs: list[dict]) -> list[dict]:
    """One summary per level: metric means over repeats, `ci95` intervals and `samples`."""
    by_level: dict[int, list[dict]] = {}
    for r in runs:
        by_level.setdefault(r["concurrency"], []).append(r)
    out = []
    for level, rs in by_level.items():
        agg = dict(rs[-1])
        agg.pop("repeat", None)
        agg["repeats"] = len(rs)
        for k in ("requests", "completed", "failed", "output_tokens"):
            agg[k] = sum(r.get(k) or 0 for r in rs)
        agg["error_rate"] = agg["failed"] / agg["requests"] if agg["requests"] else 0.0
        errors: dict[str, int] = {}
        for r in rs:
            for msg, n in (r.get("errors") or {}).items():
                errors[msg] = errors.get(msg, 0) + n
        agg["errors"] = errors
        agg["ci95"], agg["samples"] = {}, {}
        for k in METRICS:
            if k == "error_rate":
                vals = [r["error_rate"] for r in rs]
            else:
                vals = [r[k] for r in rs if r.get(k) is not None]
            if not vals:
                continue
            m, lo, hi = mean_ci([float(v) for v in vals])
            if k != "error_rate":
                agg[k] = m
            agg["samples"][k] = vals
            if len(vals) > 1:
                agg["ci95"][k] = [lo, hi]
        for k in ("max_concurrent_requests",):
            agg[k] = max(r.get(k) or 0 for r in rs)
        srv = {}
        for r in rs:
            for k, v in (r.get("server") or {}).items():
                if isinstance(v, (int, float)) and k.startswith("max_"):
                    srv[k] = max(srv.get(k, v), v)
                elif isinstance(v, (int, float)) and k in ("retractions", "requests", "generation_tokens"):
                    srv[k] = srv.get(k, 0) + v
                else:
                    srv[k] = v
        agg["server"] = srv
        agg["flush_refused"] = sum(1 for r in rs if (r.get("flush_cache") or {}).get("requested")
                                   and not (r.get("flush_cache") or {}).get("ok"))
        out.append(agg)
    return out


# ------------------------------------------------------------------------------ saved results

def _read_regular(path: Path, first_line: bool = False) -> str | None:
    """A results file's text (or its first line); None when it cannot be read. A FIFO, a
    directory or a symlink there is one line naming it: reading a FIFO would hang."""
    try:
        if not first_line:
            data = jsonl.read_regular(str(path))
            return None if data is None else data.decode("utf-8", "replace")
        with os.fdopen(jsonl.open_regular(str(path), os.O_RDONLY), "r", encoding="utf-8", errors="replace") as fh:
            return fh.readline()
    except jsonl.FileProblem as exc:
        raise BenchError(str(exc)) from None
    except OSError:
        return None


def load_result(path: Path) -> dict | None:
    """A saved result: a .jsonl file (bench_serving lines with a servops block) or an old .json."""
    text = _read_regular(path)
    if text is None:
        return None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        data.setdefault("runs", [])
        data["path"] = str(path)
        return data if isinstance(data, dict) and "levels" in data else None
    runs, meta = [], None
    for raw in text.splitlines():
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):
            continue  # a line cut by a crash
        if not isinstance(line, dict):
            continue
        s = line.get("servops") or {}
        if meta is None:
            meta = {k: s.get(k) for k in ("host", "release", "variant", "patches", "servops_git", "created", "config")}
        runs.append(run_summary(line))
    if meta is None:
        return None
    stopped = next((r["stopped"] for r in reversed(runs) if r.get("stopped")), None)
    result = dict(meta, runs=runs, path=str(path), stopped=stopped, warnings=[])
    cfg = meta.get("config") or {}
    finish(result, cfg.get("levels"), int(cfg.get("repeat") or 1))
    return result


def _variant_of(path: Path) -> str | None:
    """The variant a saved result belongs to, from its first line (no full parse)."""
    first = _read_regular(path, first_line=path.suffix == ".jsonl")
    try:
        data = json.loads(first or "")
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    servops = data.get("servops") if path.suffix == ".jsonl" else data
    return servops.get("variant") if isinstance(servops, dict) else None


def latest_for_variant(host: str, variant: str) -> dict | None:
    """The newest saved result of `variant` on `host` (complete runs preferred)."""
    found = []
    for path in list((RESULTS_ROOT / host).glob("*/*.jsonl")) + list((RESULTS_ROOT / host).glob("*/*.json")):
        if _variant_of(path) != variant:
            continue
        data = load_result(path)
        if data and data.get("variant") == variant and data.get("levels"):
            found.append((bool(data.get("complete")), data.get("created") or "", path.name, data))
    if not found:
        return None
    return sorted(found, key=lambda t: (t[0], t[1], t[2]))[-1][3]


def saved_variants(host: str) -> set[str]:
    out = set()
    for path in list((RESULTS_ROOT / host).glob("*/*.jsonl")) + list((RESULTS_ROOT / host).glob("*/*.json")):
        v = _variant_of(path)
        if v:
            out.add(v)
    return out


# ------------------------------------------------------------------------------ output

class _progress:
    """Bars on a terminal; one line per finished level on stderr either way."""

    def __init__(self, host: str, total_runs: int):
        self.host = host
        self.total_runs = total_runs
        self.finished = 0
        self._bar = None
        self._tasks: dict[tuple, int] = {}
        if is_tty():
            from .output import make_console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=make_console(stderr=True), transient=True)
            self._bar.start()

    def __call__(self, p: dict) -> None:
        if not self._bar or "level" not in p:
            return
        key = (p["level"], p.get("repeat", 0))
        if key not in self._tasks:
            rep = f" (run {key[1] + 1})" if key[1] else ""
            self._tasks[key] = self._bar.add_task(f"{self.host}: level {key[0]}{rep}", total=p["total"])
        self._bar.update(self._tasks[key], completed=p["progress"])

    def level_done(self, run: dict) -> None:
        self.finished += 1
        warm = warmup_text(run["warmup"])
        msg = (f"{self.host}: level {run['concurrency']} [{self.finished}/{self.total_runs}]: "
               f"{run['completed']}/{run['requests']} ok in {run['duration_s']:.1f}s, "
               f"{run['output_tps']:.1f} output tok/s" + (f" ({warm})" if warm else ""))
        if self._bar:
            self._bar.console.print(msg, markup=False, highlight=False)
        else:
            err_console.print(msg, markup=False, highlight=False)

    def close(self) -> None:
        if self._bar:
            self._bar.stop()


def warm_ttfts(warm: dict) -> str:
    """Each warm-up wave's mean TTFT: '419 -> 15 -> 14'."""
    return " -> ".join(f"{w.get('ttft_mean_ms') or 0:.0f}" for w in warm.get("waves") or [] if isinstance(w, dict))


def warmup_text(warm: dict) -> str:
    """What a level's warm-up did, in a few words ('' when there was none)."""
    if not warm.get("requests"):
        return ""
    if warm.get("mode") == "fixed":
        return f"warm-up {warm['requests']} request{'s' if warm['requests'] > 1 else ''}"
    state = "settled" if warm.get("converged") else "did NOT settle"
    return f"warm-up {len(warm.get('waves') or [])} waves, {warm['requests']} requests, TTFT {warm_ttfts(warm)} ms: {state}"


def _f(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def _with_ci(level: dict, key: str, digits: int = 1) -> str:
    v = level.get(key)
    ci = (level.get("ci95") or {}).get(key)
    if v is None:
        return "-"
    if ci:
        return f"{v:.{digits}f} ±{(ci[1] - ci[0]) / 2:.{digits}f}"
    return f"{v:.{digits}f}"


def level_label(level: dict) -> str:
    rate = level.get("configured_rate")
    if rate in (None, "inf") or (isinstance(rate, float) and math.isinf(rate)):
        return str(level["concurrency"])
    return f"{level['concurrency']} @{rate:g}/s"


def print_result(result: dict) -> None:
    levels = result.get("levels") or []
    has_slo = any(lv.get("goodput") is not None for lv in levels)
    reps = max((lv.get("repeats", 1) for lv in levels), default=1)
    cols = ["level", "ok/failed", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
            "ITL p50 ms", "ITL p99 ms", "e2e p50 ms", "concurrency", "max queue"]
    if has_slo:
        cols.append("goodput")
    title = f"{result['host']}: {result.get('variant')} ({result.get('release')})"
    if reps > 1:
        title += f", mean of {reps} runs ±95% interval"
    t = table(title, cols)
    for lv in levels:
        row = [level_label(lv), f"{lv['completed']}/{lv['failed']}", _with_ci(lv, "request_rate", 2),
               _with_ci(lv, "output_tps"), _with_ci(lv, "ttft_p50"), _with_ci(lv, "ttft_p99"), _with_ci(lv, "tpot_p50", 2),
               _with_ci(lv, "itl_p50", 2), _with_ci(lv, "itl_p99", 2), _with_ci(lv, "e2e_p50"),
               _f(lv.get("achieved_concurrency")), _f((lv.get("server") or {}).get("max_queue"), 0)]
        if has_slo:
            row.append("-" if lv.get("goodput") is None else f"{lv['goodput'] * 100:.1f}%")
        t.add_row(*row)
    print_table(t)
    for lv in levels:
        for msg, n in sorted((lv.get("errors") or {}).items(), key=lambda kv: -kv[1])[:3]:
            console.print(f"level {lv['concurrency']}: {n} failed: {msg[:200]}", markup=False, highlight=False)
    for w in result.get("warnings") or []:
        console.print(f"note: {w}", markup=False, highlight=False)
    if not result.get("save_error"):
        console.print(f"saved {result['path']}", markup=False, highlight=False)
