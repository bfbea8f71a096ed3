"""The call-site preflight (servops/remote/preflight_dynamo.py, check dynamo_call_site) on CPU torch,
run as the host runs it (`python -` with its arguments on stdin) against a venv of its own.

The venv holds a small library shaped as FlashInfer's kernel selection is (a version query behind
@functools.cache that runs a subprocess, a JIT loader that stats a file, then the kernel) and an
engine module whose call site calls it, as sglang's FP8 linear calls fp8_blockscale_gemm_sm90. Two
patches make the fix set, as on the GPU: the version query made a constant (dynamo then stops in the
loader: the flashinfer patch alone is not enough) and the call made an opaque torch.library custom op.
The real call site (sglang's, on an H100) is proven by the GPU kit: bench/evidence/."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from servops import remote
from servops.lab import venvs

LIB = '''\
import functools, os, subprocess

@functools.cache
def get_version():
    return subprocess.check_output(["echo", "13.0"]).decode().strip()

def version_at_least(v):
    return tuple(map(int, get_version().split("."))) >= tuple(map(int, v.split(".")))

def is_aot(path):
    return os.path.exists(path)

def gemm(x, w):
    if not version_at_least("12.8"):
        raise RuntimeError("too old")
    if is_aot("/nonexistent/prebuilt.so"):
        raise RuntimeError("unexpected")
    return x @ w.T
'''
LIB_FIXED = LIB.replace('''@functools.cache
def get_version():
    return subprocess.check_output(["echo", "13.0"]).decode().strip()
''', '''_VERSION = subprocess.check_output(["echo", "13.0"]).decode().strip()

def get_version():
    return _VERSION
''')
ENGINE = '''\
from __future__ import annotations
import torch
from fakelib.kernels import gemm

def linear(x, w):
    return gemm(x, w) + 1
'''
ENGINE_FIXED = ENGINE.replace("from fakelib.kernels import gemm\n", '''from fakelib.kernels import gemm as _raw_gemm

@torch.library.custom_op("servopstest::gemm", mutates_args=(), schema="(Tensor x, Tensor w) -> Tensor")
def gemm(x, w):
    return _raw_gemm(x, w)

@gemm.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))
''')


def diff(rel: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}"))


@pytest.fixture(scope="module")
def call_site_venv(tmp_path_factory):
    """A bare venv seeing the cached venv's torch through a .pth, with fakelib and fakeengine."""
    base = venvs.site_packages(venvs.build_venv())
    root = tmp_path_factory.mktemp("callsite") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = venvs.site_packages(root)
    (site / "base.pth").write_text(f"{base}\n")
    for rel, text in (("fakelib/__init__.py", ""), ("fakelib/kernels.py", LIB),
                      ("fakeengine/__init__.py", ""), ("fakeengine/linear.py", ENGINE)):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return root


def patch_spec(name, rel, old, new):
    return {"name": name, "dist": name, "text": diff(rel, old, new), "strip": 1, "files": [rel]}


VERSION_FIX = patch_spec("version-constant", "fakelib/kernels.py", LIB, LIB_FIXED)
OPAQUE_FIX = patch_spec("opaque-call", "fakeengine/linear.py", ENGINE, ENGINE_FIXED)


def prove(venv: Path, patches: list[dict], device: str = "cpu") -> dict:
    args = {"check": "dynamo_call_site", "module": "fakeengine.linear", "call": "linear", "device": device,
            "args": [{"shape": [4, 64], "dtype": "float32"}, {"shape": [32, 64], "dtype": "float32"}],
            "patches": patches}
    res = subprocess.run([str(venv / "bin" / "python"), "-"], input=remote.with_args("preflight_dynamo", args),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_pristine_crashes_as_the_seed_and_the_fix_set_compiles_and_matches_eager(call_site_venv):
    res = prove(call_site_venv, [VERSION_FIX, OPAQUE_FIX])
    assert res["result"] == "pass", res
    assert res["call_site"] == "fakeengine.linear.linear"
    assert res["pristine"]["result"] == "unsupported"
    assert "_thread.allocate_lock" in res["pristine"]["message"] + res["pristine"]["traceback"]
    assert res["fixed"]["cases"][0]["max_abs_diff"] == 0.0
    # the host's files were never touched: the proof ran on copies
    site = venvs.site_packages(call_site_venv)
    assert (site / "fakelib/kernels.py").read_text() == LIB and (site / "fakeengine/linear.py").read_text() == ENGINE


def test_the_version_fix_alone_moves_the_crash_into_the_loader(call_site_venv):
    res = prove(call_site_venv, [VERSION_FIX])
    assert res["result"] == "fail"
    assert res["fixed"]["result"] == "unsupported"
    text = res["fixed"]["message"] + res["fixed"]["traceback"]
    assert "allocate_lock" not in text and "is_aot" in text  # dynamo went on into the JIT loader


def test_a_fix_set_already_applied_on_disk_is_reversed_for_the_pristine_run(call_site_venv, tmp_path):
    site = venvs.site_packages(call_site_venv)
    try:
        (site / "fakelib/kernels.py").write_text(LIB_FIXED)
        (site / "fakeengine/linear.py").write_text(ENGINE_FIXED)
        res = prove(call_site_venv, [VERSION_FIX, OPAQUE_FIX])
        assert res["pristine"]["result"] == "unsupported" and res["fixed"]["result"] == "pass", res
    finally:
        (site / "fakelib/kernels.py").write_text(LIB)
        (site / "fakeengine/linear.py").write_text(ENGINE)


def test_no_gpu_is_unproven_never_a_pass(call_site_venv):
    res = prove(call_site_venv, [VERSION_FIX, OPAQUE_FIX], device="cuda")
    assert res["result"] == "unproven"
    assert "no CUDA device" in res["fixed"]["message"]
