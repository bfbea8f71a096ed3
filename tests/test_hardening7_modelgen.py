"""Hardening round 7, the real-size model generator (python -m servops.lab.modelgen, as the GPU
kit runs it): asked for what cannot be written, it says so in one line and exits 2, before torch
is imported and before a byte is written. Before: 10^9 layers built a list of their tensors
until memory ran out, an OUT that is a file gave a traceback, a checkpoint larger than the disk
was written until the disk was full (a multi-GB .tmp left behind)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def modelgen(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "servops.lab.modelgen", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    return res, time.monotonic() - started


@pytest.mark.parametrize("args, why", [
    (["--layers", "1000000000"], "--layers must be 1 to 1024"),
    (["--layers", "-3"], "--layers must be 1 to 1024"),
    # Qwen3-30B-A3B's MoE at 1000 layers: over a terabyte, more than this machine's disk
    (["--shape", "qwen3-30b-a3b", "--layers", "1000"], "free space, pick another OUT or fewer --layers"),
])
def test_a_checkpoint_that_cannot_be_written_is_refused_in_one_line_with_nothing_written(tmp_path, args, why):
    out = tmp_path / "model"
    res, took = modelgen(str(out), *args)
    assert res.returncode == 2 and why in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not out.exists() and took < 30


def test_an_out_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "a-file"
    out.write_text("keep me")
    res, _ = modelgen(str(out), "--layers", "1")
    assert res.returncode == 2 and "is not a directory" in res.stderr and "Traceback" not in res.stderr
    assert out.read_text() == "keep me"
