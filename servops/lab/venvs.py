"""The "remote" Python environment the tests operate on: a real venv with real PyPI packages.

Built once and cached under ~/.cache/servops-tests (wheels too), because torch and the 62 MB
flashinfer wheel take a minute to install. Tests that edit files restore them afterwards; a
cached venv whose watched files drifted (an interrupted run) gets flashinfer reinstalled.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

FLASHINFER = "flashinfer-python==0.7.2.post1"
# CPU torch: the preflight and the server double really run dynamo. apache-tvm-ffi is what
# flashinfer/jit/cpp_ext.py imports at module level; packaging provides Version.
# aiohttp and prometheus-client serve the SGLang test double (servops/lab/sglang_double.py).
BASE_REQUIREMENTS = ["torch==2.13.0", "apache-tvm-ffi>=0.1.11,<0.2", "packaging>=24.2", "numpy",
                     "aiohttp>=3.9", "prometheus-client>=0.20"]

CACHE = Path(os.environ.get("SERVOPS_TEST_CACHE", Path.home() / ".cache" / "servops-tests"))


def _run(argv, **kw):
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kw)


def wheel_dir() -> Path:
    d = CACHE / "wheels"
    d.mkdir(parents=True, exist_ok=True)
    if not list(d.glob("flashinfer_python-0.7.2.post1-*.whl")):
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(d), FLASHINFER])
    return d


def flashinfer_wheel() -> Path:
    return next(wheel_dir().glob("flashinfer_python-0.7.2.post1-*.whl"))


def venv_key() -> str:
    blob = json.dumps([sys.version_info[:2], BASE_REQUIREMENTS, FLASHINFER]).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def install_flashinfer(venv: Path) -> None:
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
          "--no-index", str(flashinfer_wheel())])


def build_venv() -> Path:
    venv = CACHE / f"venv-{venv_key()}"
    marker = venv / ".servops-test-ready"
    if not marker.exists():
        if venv.exists():
            subprocess.run(["rm", "-rf", str(venv)], check=True)
        _run([sys.executable, "-m", "venv", str(venv)])
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *BASE_REQUIREMENTS])
        install_flashinfer(venv)
        marker.write_text("ok\n")
    return venv


# ---- sglang's real bench_serving, for bench/parity_bench_serving.py (never built by the tests) ----
SGLANG_BENCH = "sglang==0.5.23"
# What `import sglang.benchmark.serving` reaches in sglang 0.5.23 (installed --no-deps: the full
# dependency set is the GPU server's). Its import chain reaches torch and torchvision: the
# releases on this machine's disk (PyPI's torchvision build differs).
BENCH_SERVING_REQUIREMENTS = [
    "torch==2.14.1", "torchvision==0.29.1", "transformers==5.19.0", "tokenizers==0.23.2", "numpy", "aiohttp",
    "requests", "tqdm", "msgspec", "orjson", "pillow", "psutil", "pybase64", "starlette", "pyzmq", "ipython",
    "datasets", "apache-tvm-ffi==0.1.11", "sentencepiece==0.2.1", "compressed-tensors", "gguf", "prometheus-client",
]


def build_bench_serving_venv(log=print) -> Path:
    """A venv (~6 GB, cached) where `python -m sglang.benchmark.serving` runs: sglang 0.5.23
    --no-deps plus what its bench_serving module imports."""
    blob = json.dumps([sys.version_info[:2], BENCH_SERVING_REQUIREMENTS, SGLANG_BENCH]).encode()
    venv = CACHE / f"bench-serving-{hashlib.sha256(blob).hexdigest()[:12]}"
    marker = venv / ".servops-bench-serving-ready"
    if marker.exists():
        return venv
    if venv.exists():
        subprocess.run(["rm", "-rf", str(venv)], check=True)
    log(f"building the bench_serving venv {venv} (torch, transformers, sglang; several minutes, once)")
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", *BENCH_SERVING_REQUIREMENTS], stderr=subprocess.DEVNULL)
    _run([py, "-m", "pip", "install", "-q", "--no-deps", SGLANG_BENCH], stderr=subprocess.DEVNULL)
    _run([py, "-W", "ignore", "-c", "import sglang.benchmark.serving"])
    marker.write_text("ok\n")
    return venv
