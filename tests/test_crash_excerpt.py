"""The crash excerpt a failed deploy prints (LogWatch.excerpt in servops/remote/deploy_ctl.py),
on real logs: it ends at the end of the traceback -- the last frames and the exception -- and
starts at the failure line a server logs above its Traceback header; bounded, the middle cut.

LogWatch is the host program's own class, compiled from deploy_ctl.py's source (the program runs
on the host's python after _common.py; its module body would run a ctl operation)."""

from __future__ import annotations

import ast
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
SIGNATURES = [r"torch\._dynamo\.exc\.Unsupported", "Piecewise CUDA Graph failed"]


@pytest.fixture(scope="module")
def LogWatch():
    tree = ast.parse((REPO / "servops" / "remote" / "deploy_ctl.py").read_text())
    wanted = {"LogWatch", "_Overran", "_overran"}
    body = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    assert {n.name for n in body} == wanted
    ns = {"re": re, "os": os, "signal": signal, "threading": threading, "time": time}
    exec(compile(ast.Module(body=body, type_ignores=[]), "deploy_ctl.py", "exec"), ns)
    return ns["LogWatch"]


def watched(LogWatch, path: Path):
    log = LogWatch(str(path), SIGNATURES)
    hit = log.poll()
    log.settle()
    return log, hit


def test_the_excerpt_ends_at_the_exception_and_its_last_frame(LogWatch):
    """The double's real dynamo crash (torch 2.x): the signature is the Unsupported line, and the
    traceback goes on after it (dynamo's "from user code" frames): today's excerpt stopped at
    `subprocess.py ... in __init__`, one line short of `threading.Lock()`."""
    log, hit = watched(LogWatch, FIXTURES / "double_piecewise_crash.log")
    assert hit and "torch._dynamo.exc.Unsupported" in log.lines[hit[1]]
    ex = log.excerpt(hit[1])
    assert ex[0] == "Traceback (most recent call last):"
    assert "torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped" in ex
    assert ex[-1].startswith("Set TORCHDYNAMO_VERBOSE=1")
    assert ex[-4].strip() == "self._waitpid_lock = threading.Lock()", ex[-6:]
    assert 'File "/root/.pyenv/versions/3.11.7/lib/python3.11/subprocess.py", line 828, in __init__' in ex[-5]


def test_a_long_traceback_keeps_its_opening_exception_and_end(LogWatch):
    log, hit = watched(LogWatch, FIXTURES / "double_piecewise_crash.log")
    ex = log.excerpt(hit[1], limit=24)
    assert len(ex) <= 24
    assert ex[0] == "Traceback (most recent call last):"
    assert "torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped" in ex
    assert any(re.fullmatch(r"    \.\.\. \(\d+ lines\) \.\.\.", line) for line in ex)
    assert "self._waitpid_lock = threading.Lock()" in [line.strip() for line in ex[-5:]]


def test_the_failure_line_above_the_traceback_header_opens_it(LogWatch):
    """sglang logs `Piecewise CUDA Graph failed with error: ...` and its hint, then the
    scheduler's traceback: the excerpt starts at that line and goes on through the traceback."""
    path = FIXTURES / "real" / "sglang-pr23351-piecewise-tensor-match-ci.log"
    log, hit = watched(LogWatch, path)
    assert hit[0] == "Piecewise CUDA Graph failed"
    ex = log.excerpt(hit[1])
    assert "Piecewise CUDA Graph failed with error: Tensor match failed" in ex[0]
    assert ex[1] == "- Root cause: Size mismatch for shape#0('num_tokens'): expected 6 but got 8"
    assert any("Scheduler hit an exception: Traceback (most recent call last):" in line for line in ex)
    assert ex == log.lines[hit[1]:len(path.read_text().splitlines())]  # the whole failure, to the log's end


def test_a_signature_inside_a_traceback_gets_the_failure_line_logged_above_it(LogWatch):
    """The hit is a frame or exception line below the header: the failure line a few lines above
    the header (another rank's, here) still opens the excerpt, with the hint between."""
    path = FIXTURES / "real" / "sglang-pr27811-piecewise-failed-hint-first.log"
    log = LogWatch(str(path), [r"init_tp_model_worker"])
    hit = log.poll()
    log.settle()
    ex = log.excerpt(hit[1])
    assert ex[0].endswith("Piecewise CUDA Graph failed with error: 'TcPiecewiseForwardContext' object has no "
                          "attribute 'num_tokens'"), ex[0]
    assert "Scheduler hit an exception: Traceback (most recent call last):" in ex[4]


def test_without_a_hit_the_last_traceback_else_the_tail(LogWatch):
    log, _hit = watched(LogWatch, FIXTURES / "real" / "sglang-5389-ninja-capture-chained.log")
    ex = log.excerpt()
    assert ex[0] == "Traceback (most recent call last):" and ex == log.lines[10:14]
    log, _hit = watched(LogWatch, FIXTURES / "real" / "corplink-rs-73-rust-panic-no-traceback.log")
    assert log.excerpt() == log.lines[-25:]


def test_a_server_flooding_long_lines_holds_bounded_memory_in_the_gate(LogWatch, tmp_path):
    """Lines of 8 MB each were kept whole (20,000 of them); now each kept line is cut, and the
    kept characters stay under their bound (here scaled down by a subclass: the same code), while
    the crash line that ends the flood is still found and shown."""

    class SmallWatch(LogWatch):
        KEEP_LINE_CHARS = 4096
        KEEP_CHARS = 64 << 10
        READ_CHUNK = 256 << 10

    log_path = tmp_path / "server.log"
    with open(log_path, "w") as fh:
        for n in range(120):
            fh.write(f"[2026-12-07 10:00:{n % 60:02d}] line {n} " + "x" * 30000 + "\n")
        fh.write("Traceback (most recent call last):\n  File \"m.py\", line 1, in f\n"
                 "torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped\n")
    watch, hits = SmallWatch(str(log_path), SIGNATURES), []
    for _ in range(200):
        hit = watch.poll()
        hits += [hit] if hit else []
        assert all(len(line) <= SmallWatch.KEEP_LINE_CHARS for line in watch.lines)
        assert watch.kept_chars == sum(len(line) for line in watch.lines) <= SmallWatch.KEEP_CHARS
    watch.settle()
    assert len(hits) == 1 and "torch._dynamo.exc.Unsupported" in watch.lines[hits[0][1]]
    assert watch.excerpt(hits[0][1])[-1].startswith("torch._dynamo.exc.Unsupported")
    first_kept = int(watch.lines[0].split(" line ")[1].split()[0])
    assert 100 < first_kept < 120  # the oldest went: 64 KiB holds the last few cut lines
