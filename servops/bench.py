"""`invoke bench`: levels of concurrent streaming requests, results saved per host/release."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from . import releases
from .errors import ServopsError
from .provenance import git_sha
from .output import console, is_tty, print_table, table
from .remote_exec import run_program
from .transport import HostSession

RESULTS_ROOT = Path(os.environ.get("SERVOPS_RESULTS") or Path(__file__).resolve().parent.parent / "results")
DEFAULT_LEVELS = (1, 10, 256, 1024)


class BenchError(ServopsError):
    pass


def parse_levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in re.split(r"[,\s]+", spec.strip()) if x]
    except ValueError:
        raise BenchError(f"--levels {spec!r}: expected comma-separated integers like 1,10,256,1024") from None
    if not levels or any(l < 1 for l in levels):
        raise BenchError(f"--levels {spec!r}: each level must be 1 or more")
    return levels


def load_dataset(spec: str) -> str | None:
    if spec in ("", "random"):
        return None
    path = Path(spec)
    if not path.is_file():
        raise BenchError(f"--dataset {spec!r}: expected 'random' or a readable file of prompts (text or JSONL)")
    return path.read_text()


def run_bench(hs: HostSession, levels: list[int], requests: int = 0, input_len: int = 128, output_len: int = 128,
              dataset: str | None = None) -> dict:
    """Run the load generator on the host against the current server; save and return the result."""
    state = releases.ctl(hs, "status")
    release = state["release"] or {}
    if not state["server"]:
        raise BenchError(f"{hs.host.name}: no server running (invoke status); deploy first")
    args = {"port": int(state["server"].get("port") or hs.host.require("server_port")), "levels": levels,
            "requests": requests, "input_len": input_len, "output_len": output_len, "dataset": dataset}
    progress = _progress(hs.host.name)
    try:
        res = run_program(hs, "loadgen", args, timeout=24 * 3600, on_progress=progress)
    finally:
        progress.close()
    result = {
        "host": hs.host.name, "release": state["current"], "variant": release.get("variant"),
        "patches": release.get("patches") or [], "servops_git": git_sha(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: v for k, v in args.items() if k != "dataset"} | {"dataset": "random" if dataset is None else "file"},
        "levels": res["levels"],
    }
    result["complete"] = (len(res["levels"]) == len(levels) and all(l["failed"] == 0 for l in res["levels"]))
    result["path"] = str(save(result))
    return result


class _progress:
    def __init__(self, host: str):
        self.host = host
        self._bar = None
        self._tasks: dict[int, int] = {}
        if is_tty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._bar.start()

    def __call__(self, p: dict) -> None:
        if not self._bar:
            return
        level = p["level"]
        if level not in self._tasks:
            self._tasks[level] = self._bar.add_task(f"{self.host}: concurrency {level}", total=p["total"])
        self._bar.update(self._tasks[level], completed=p["progress"])

    def close(self) -> None:
        if self._bar:
            self._bar.stop()


def save(result: dict) -> Path:
    d = RESULTS_ROOT / result["host"] / (result["release"] or "unknown")
    d.mkdir(parents=True, exist_ok=True)
    path = d / (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + ".json")
    n = 1
    while path.exists():
        n += 1
        path = d / (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{n}.json")
    path.write_text(json.dumps(result, indent=1))
    return path


def latest_for_variant(host: str, variant: str) -> dict | None:
    """The newest saved result of `variant` on `host` (complete runs preferred)."""
    found = []
    for path in (RESULTS_ROOT / host).glob("*/*.json"):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if data.get("variant") == variant:
            found.append((data.get("complete", False), data.get("created", ""), path.name, data))
    if not found:
        return None
    return sorted(found, key=lambda t: (t[0], t[1], t[2]))[-1][3]


def _f(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def print_result(result: dict) -> None:
    t = table(f"{result['host']}: {result['variant']} ({result['release']})",
              ["concurrency", "done/failed", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
               "ITL p50 ms", "ITL p99 ms", "e2e p50 ms"])
    for l in result["levels"]:
        t.add_row(str(l["concurrency"]), f"{l['completed']}/{l['failed']}", _f(l["request_rate"], 2), _f(l["output_tps"]),
                  _f(l["ttft_p50"]), _f(l["ttft_p99"]), _f(l["itl_p50"], 2), _f(l["itl_p99"], 2), _f(l["e2e_p50"]))
    print_table(t)
    console.print(f"saved {result['path']}", markup=False)
