"""The shipped flashinfer-python patch (patches/flashinfer-python/cuda-version-no-subprocess) over
EVERY flashinfer-python release on PyPI: for each, whether the release has the bug (a traced
is_cuda_version_at_least() reaching get_cuda_version()'s nvcc subprocess), whether the patch
applies with real patch(1) (no fuzz, as the host runs it; and with patch's default fuzz), whether
it round-trips (re-apply refused, reverse restores the exact bytes, the result compiles) and
whether the metadata's `applies_to` claims exactly the releases with the bug.

    python bench/flashinfer_patch_sweep.py                 # the table, from the cache
    python bench/flashinfer_patch_sweep.py --download      # first fetch every release on PyPI
    python bench/flashinfer_patch_sweep.py --sglang       # + each cached sglang wheel's flashinfer pin
    python bench/flashinfer_patch_sweep.py --semantic 0.2.14.post1 0.7.4
                                                           # + torch.compile(fullgraph) pristine/patched

Archives (wheels; sdists for releases with no wheel) are cached under
~/.cache/servops-tests/flashinfer-src/dl/ (the tests' wheel cache, ~/.cache/servops-tests/wheels,
is read too). Only flashinfer/jit/cpp_ext.py and the patch's files are unpacked, into
~/.cache/servops-tests/flashinfer-src/<version>/, with what a scan of the whole package found
recorded in its .complete marker, written last under the cache's lock (a tree without it is a
killed run's, unpacked again); a complete tree is enough without its archive.
tests/test_flashinfer_release_sweep.py asserts the verdicts.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from packaging.version import InvalidVersion, Version  # noqa: E402

from servops.lab import venvs  # noqa: E402
from servops.lab.venvs import CACHE, venv_key  # noqa: E402
from servops.patchstore import find_patch  # noqa: E402

NAME = "cuda-version-no-subprocess"
DIST = "flashinfer-python"
CPP_EXT = "flashinfer/jit/cpp_ext.py"
SRC = CACHE / "flashinfer-src"
DL = SRC / "dl"
WHEELS = CACHE / "wheels"
OLDEST = Version("0.2")
FUNCS = ("get_cuda_version", "is_cuda_version_at_least", "_get_cuda_version")
MARKER_VERSION = 1


def _archive_version(name: str) -> str | None:
    m = re.match(r"flashinfer_python-(.+?)(?:-py3-none-any\.whl|\.tar\.gz)$", name)
    return m.group(1) if m else None


def archives() -> dict[str, Path]:
    """version -> cached archive (a wheel preferred over an sdist)."""
    out: dict[str, Path] = {}
    for d in (DL, WHEELS):
        for p in sorted(d.glob("flashinfer_python-*")) if d.is_dir() else []:
            v = _archive_version(p.name)
            if v and (v not in out or p.name.endswith(".whl")):
                out[v] = p
    return out


def ensure_archive(version: str) -> Path | None:
    """The cached archive of flashinfer-python==version, fetched once. A wheel with pip download;
    for a release that has only an sdist, pip cannot prepare it (its build requirements pin
    packages PyPI no longer serves), so the sdist link pip resolves is fetched as a file."""
    found = archives().get(version)
    if found:
        return found
    DL.mkdir(parents=True, exist_ok=True)
    spec = f"{DIST}=={version}"
    try:  # the wheel: under the cache's lock, renamed in whole
        return venvs.cached_wheel(f"flashinfer_python-{version}-*.whl", spec, DL, ("--only-binary", ":all:"))
    except (subprocess.CalledProcessError, OSError):
        with tempfile.TemporaryDirectory() as scratch:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-vv", "--no-deps", "--no-build-isolation",
                                "--no-binary", ":all:", "-d", scratch, spec], capture_output=True, text=True)
        m = re.search(r"Found link (https://\S+/flashinfer_python-" + re.escape(version) + r"\.tar\.gz)\S* .*"
                      r"version: " + re.escape(version) + r"\s*$", r.stdout + r.stderr, re.M)
        if m:
            dest = DL / m.group(1).rsplit("/", 1)[1]
            try:
                urllib.request.urlretrieve(m.group(1), str(dest) + ".part")
                os.replace(str(dest) + ".part", dest)
            except OSError:
                pass
    return archives().get(version)


def _members(archive: Path):
    """(path inside the flashinfer distribution, reader) for every .py in a wheel or an sdist."""
    if archive.name.endswith(".whl"):
        z = zipfile.ZipFile(archive)
        for n in z.namelist():
            if n.endswith(".py"):
                yield n, (lambda n=n: z.read(n))
    else:
        t = tarfile.open(archive)
        for m in t.getmembers():
            if m.isfile() and m.name.endswith(".py") and "/" in m.name:
                yield m.name.split("/", 1)[1], (lambda m=m: t.extractfile(m).read())


def _scan(text: str) -> dict:
    """Which of FUNCS a module defines, and which of them run `nvcc --version` in a subprocess."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCS + ("_query_cuda_version",):
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
            subproc = any(isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                          and c.func.value.id == "subprocess" for c in calls)
            version_arg = any(isinstance(k, ast.Constant) and k.value == "--version" for k in ast.walk(node))
            found[node.name] = {"nvcc_subprocess": subproc and version_arg,
                                "calls": sorted({c.func.id for c in calls if isinstance(c.func, ast.Name)}),
                                "cached": any("cache" in ast.unparse(d) for d in node.decorator_list)}
    return found


def wanted_files() -> list[str]:
    return sorted({CPP_EXT, *find_patch(NAME).files})


def release_tree(version: str, download: bool = True) -> Path | None:
    """SRC/<version>: the release's CPP_EXT and the patch's files, plus its scan in .complete."""
    dest = SRC / version
    if _complete(dest):
        return dest
    with venvs.BuildLock(f"flashinfer-src-{version}"):  # another test process may be unpacking it
        return dest if _complete(dest) else _unpack_release(version, dest, download)


def _complete(dest: Path) -> bool:
    try:
        meta = json.loads((dest / ".complete").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("v") == MARKER_VERSION and set(wanted_files()) <= set(meta["looked_for"])


def _unpack_release(version: str, dest: Path, download: bool) -> Path | None:
    want = wanted_files()
    archive = ensure_archive(version) if download else archives().get(version)
    if archive is None:
        return None
    shutil.rmtree(dest, ignore_errors=True)
    scan: dict[str, dict] = {}
    present = []
    for rel, read in _members(archive):
        if not rel.startswith("flashinfer/"):
            continue
        data = None
        if rel in want:
            data = read()
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
            present.append(rel)
        if rel.endswith(".py"):
            data = data if data is not None else read()
            if b"cuda_version" in data:
                found = _scan(data.decode("utf-8", "replace"))
                if found:
                    scan[rel] = found
    dest.mkdir(parents=True, exist_ok=True)
    (dest / ".complete").write_text(json.dumps({"v": MARKER_VERSION, "archive": archive.name, "looked_for": want,
                                                "present": sorted(present), "scan": scan}, indent=1) + "\n")
    if archive.parent == DL:  # the few files kept are all the sweep reads: 74 releases are 850 MB
        archive.unlink(missing_ok=True)
    return dest


def _patch(workdir: Path, text: str, *extra: str) -> tuple[bool, str]:
    proc = subprocess.run(["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-r", "-",
                           "-d", str(workdir), *extra], input=text, capture_output=True, text=True)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def check_release(version: str, tree: Path) -> dict:
    """One row: the release's bug, and what the shipped patch does to it."""
    patch = find_patch(NAME)
    meta = json.loads((tree / ".complete").read_text())
    where = {f: sorted(rel for rel, found in meta["scan"].items() if f in found) for f in FUNCS}
    cpp = meta["scan"].get(CPP_EXT, {})
    gcv = cpp.get("get_cuda_version")
    at_least = cpp.get("is_cuda_version_at_least")
    bug = bool(gcv and gcv["nvcc_subprocess"] and at_least and "get_cuda_version" in at_least["calls"])
    row = {"version": version, "cpp_ext": CPP_EXT in meta["present"], "where": where, "bug": bug,
           "build_only_nvcc": bool(cpp.get("_get_cuda_version", {}).get("nvcc_subprocess")),
           "in_range": patch.version_ok(version), "applies": False, "applies_fuzz": False,
           "roundtrip": None, "detail": ""}
    if not row["cpp_ext"]:
        row["detail"] = f"no {CPP_EXT}"
        return row
    with tempfile.TemporaryDirectory(prefix="fi-sweep-") as tmp:
        work = Path(tmp) / "w"
        for rel in patch.files:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            if (tree / rel).exists():
                shutil.copy2(tree / rel, work / rel)
        row["applies"], msg = _patch(work, patch.text, "--dry-run", "--fuzz=0")
        row["applies_fuzz"], fuzz_msg = _patch(work, patch.text, "--dry-run")
        row["detail"] = " ".join((msg if row["applies"] else fuzz_msg if row["applies_fuzz"] else msg).split())
        if row["applies"]:
            pristine = {rel: (work / rel).read_bytes() for rel in patch.files}
            ok, msg = _patch(work, patch.text, "--fuzz=0")
            patched_text = (work / CPP_EXT).read_text()
            after = _scan(patched_text)
            again, _ = _patch(work, patch.text, "--dry-run", "--fuzz=0")
            reverse_ok, _ = _patch(work, patch.text, "--dry-run", "--fuzz=0", "--reverse")
            problems = []
            if not ok:
                problems.append("apply failed after a clean dry run: " + msg)
            if again:
                problems.append("applies twice")
            if not reverse_ok:
                problems.append("the reverse does not apply")
            try:
                compile(patched_text, CPP_EXT, "exec")
            except SyntaxError as exc:
                problems.append(f"patched file does not compile: {exc}")
            if "_query_cuda_version" not in after or after.get("get_cuda_version", {}).get("nvcc_subprocess", True):
                problems.append("patched get_cuda_version still runs nvcc")
            _patch(work, patch.text, "--fuzz=0", "--reverse")
            if {rel: (work / rel).read_bytes() for rel in patch.files} != pristine:
                problems.append("revert does not restore the exact bytes")
            row["roundtrip"] = problems
    return row


# ---- semantic: torch.compile(fullgraph=True) of is_cuda_version_at_least, pristine vs patched ----

PROBE = r'''
import importlib, json, sys, types
import torch
out = {"torch": torch.__version__}
for pkg, root in json.loads(sys.argv[1]):
    sys.path.insert(0, root)
    mod = importlib.import_module(pkg + ".jit.cpp_ext")
    def probe(x, f=mod.is_cuda_version_at_least):
        return x + 1 if f("12.8") else x - 1
    torch._dynamo.reset()
    try:
        value = torch.compile(probe, fullgraph=True, backend="eager")(torch.ones(2)).tolist()
        res = {"result": "pass", "value": value, "version": str(mod.get_cuda_version())}
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        res = {"result": "unsupported" if type(exc).__name__ == "Unsupported" else "error",
               "error": "%s.%s: %s" % (type(exc).__module__, type(exc).__name__, first)}
    out[pkg] = res
print("PROBE-JSON " + json.dumps(out))
'''


def torch_python() -> Path | None:
    """The tests' CPU torch venv (servops/lab/venvs.py build_venv), if it is built."""
    venv = CACHE / f"venv-{venv_key()}"
    py = venv / "bin" / "python"
    return py if (venv / ".servops-test-ready").exists() and py.exists() else None


def _stage_package(root: Path, pkg: str, cpp_ext: bytes) -> None:
    """`pkg` = a flashinfer package holding only jit/cpp_ext.py; the modules it imports relatively
    (jit/env.py, compilation_context.py: kernel paths, JIT build state) are stubs, so the probe
    runs the release's own get_cuda_version()/is_cuda_version_at_least() and nothing else."""
    (root / pkg / "jit").mkdir(parents=True)
    (root / pkg / "__init__.py").write_text("")
    (root / pkg / "jit" / "__init__.py").write_text("")
    (root / pkg / "jit" / "env.py").write_text("")
    (root / pkg / "compilation_context.py").write_text("class CompilationContext:\n    pass\n")
    (root / pkg / "jit" / "cpp_ext.py").write_bytes(cpp_ext)


def semantic(versions: list[str], nvcc_release: str | None = None, timeout: int = 240) -> dict:
    """{version: {"pristine": {...}, "patched": {...}}} from one torch process. CUDA_HOME holds
    version.json 12.9.1 and, with nvcc_release, a bin/nvcc that reports it (else no nvcc)."""
    py = torch_python()
    if py is None:
        raise FileNotFoundError(f"no CPU torch venv under {CACHE} (the tests build it: servops/lab/venvs.py)")
    patch = find_patch(NAME)
    with tempfile.TemporaryDirectory(prefix="fi-semantic-") as tmp:
        root = Path(tmp)
        cuda = root / "cuda"
        (cuda / "bin").mkdir(parents=True)
        (cuda / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "12.9.1"}}')
        if nvcc_release:
            nvcc = cuda / "bin" / "nvcc"
            nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.0'\n")
            nvcc.chmod(0o755)
        pkgs, names = [], {}
        for i, v in enumerate(versions):
            tree = release_tree(v)
            pristine = (tree / CPP_EXT).read_bytes()
            work = root / f"w{i}"
            (work / CPP_EXT).parent.mkdir(parents=True)
            (work / CPP_EXT).write_bytes(pristine)
            ok, msg = _patch(work, patch.text, "--fuzz=0")
            if not ok:
                raise RuntimeError(f"{v}: the patch does not apply: {msg}")
            for kind, data in (("pristine", pristine), ("patched", (work / CPP_EXT).read_bytes())):
                pkg = f"fi_{kind}_{i}"
                _stage_package(root / "pkgs", pkg, data)
                pkgs.append((pkg, str(root / "pkgs")))
                names[pkg] = (v, kind)
        env = {k: val for k, val in os.environ.items() if not k.startswith(("CUDA", "PYTHON", "VIRTUAL_ENV"))}
        env.update(CUDA_HOME=str(cuda), PATH=f"{cuda / 'bin'}:/usr/bin:/bin", TORCHINDUCTOR_CACHE_DIR=str(root / "ind"))
        proc = subprocess.run([str(py), "-c", PROBE, json.dumps(pkgs)], capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=tmp)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("PROBE-JSON ")), None)
        if line is None:
            raise RuntimeError(f"probe failed (rc {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        data = json.loads(line.split(" ", 1)[1])
    out: dict = {"torch": data.pop("torch")}
    for pkg, res in data.items():
        v, kind = names[pkg]
        out.setdefault(v, {})[kind] = res
    return out


# ---- which flashinfer-python each sglang release pins ------------------------------------------

def sglang_pins() -> dict[str, str | None]:
    """sglang version -> the flashinfer-python version its wheel pins (Requires-Dist ==X), for every
    sglang wheel in the tests' cache (None: no flashinfer-python pin, e.g. the old `flashinfer`)."""
    out = {}
    for whl in WHEELS.glob("sglang-*.whl"):
        version = whl.name.split("-")[1]
        try:
            with zipfile.ZipFile(whl) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                text = z.read(meta).decode("utf-8", "replace")
        except (OSError, zipfile.BadZipFile, StopIteration):
            continue
        pin = None
        for line in text.splitlines():
            m = re.match(r"Requires-Dist:\s*flashinfer[-_]python(?:\[[^\]]*\])?\s*==\s*([^\s;,]+)", line, re.I)
            if m:
                pin = m.group(1)
                break
        out[version] = pin
    return dict(sorted(out.items(), key=lambda kv: Version(kv[0])))


# ---- the table --------------------------------------------------------------------------------

def pypi_versions() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", DIST], capture_output=True,
                         text=True).stdout
    line = next((l for l in out.splitlines() if l.startswith("Available versions:")), "")
    vs = []
    for v in line.split(":", 1)[-1].split(","):
        try:
            if v.strip() and Version(v.strip()) >= OLDEST:
                vs.append(v.strip())
        except InvalidVersion:
            pass
    return sorted(vs, key=Version)


def sweep(versions: list[str] | None = None, download: bool = False) -> list[dict]:
    if versions is None:
        versions = sorted({*archives(), *(p.name for p in SRC.glob("*/") if (p / ".complete").exists())},
                          key=Version)
    rows = []
    for v in versions:
        tree = release_tree(v, download=download)
        rows.append(check_release(v, tree) if tree else {"version": v, "missing": True})
    return rows


def verdict(row: dict) -> str:
    if row.get("missing"):
        return "not cached (run with --download)"
    if row["bug"] and row["in_range"] and row["applies"] and row["roundtrip"] == []:
        return "covered"
    if not row["bug"] and not row["in_range"]:
        return "no bug; excluded by applies_to (status: version does not match)"
    return "WRONG: " + "; ".join(filter(None, [
        "bug but outside applies_to" if row["bug"] and not row["in_range"] else "",
        "no bug but inside applies_to" if not row["bug"] and row["in_range"] else "",
        "bug but the patch does not apply" if row["bug"] and not row["applies"] else "",
        "; ".join(row["roundtrip"] or [])]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--download", action="store_true", help="fetch every flashinfer-python release on PyPI first")
    ap.add_argument("--semantic", nargs="*", metavar="VERSION",
                    help="torch.compile(fullgraph) pristine vs patched on these releases (CPU torch venv)")
    ap.add_argument("--sglang", action="store_true", help="also: the flashinfer-python each cached sglang wheel pins")
    ap.add_argument("versions", nargs="*")
    args = ap.parse_args()
    versions = args.versions or (pypi_versions() if args.download else None)
    rows = sweep(versions, download=args.download)
    print(f"patch {NAME}: applies_to '{find_patch(NAME).applies_to}'")
    print(f"{'release':<14} {'get_cuda_version':<26} {'bug':<4} {'fuzz0':<6} {'fuzz2':<6} verdict")
    for row in rows:
        if row.get("missing"):
            print(f"{row['version']:<14} {'-':<26} {'-':<4} {'-':<6} {'-':<6} {verdict(row)}")
            continue
        where = ",".join(row["where"]["get_cuda_version"]) or (
            "-" if row["cpp_ext"] else "- (no cpp_ext.py)")
        if not row["where"]["get_cuda_version"] and row["build_only_nvcc"]:
            where = "- (_get_cuda_version: build)"
        print(f"{row['version']:<14} {where:<26} {'yes' if row['bug'] else 'no':<4} "
              f"{'yes' if row['applies'] else 'no':<6} {'yes' if row['applies_fuzz'] else 'no':<6} {verdict(row)}")
    if args.sglang:
        patch = find_patch(NAME)
        print("\nsglang (cached wheels) -> the flashinfer-python it pins -> the patch")
        for sg, pin in sglang_pins().items():
            state = "-" if pin is None else "pre-release pin (not swept)" if Version(pin).is_prerelease else (
                "covered" if patch.version_ok(pin) else
                                             "version does not match (no bug)" if Version(pin) < Version("0.2.14.post1")
                                             else "outside applies_to")
            print(f"  sglang {sg:<14} flashinfer-python {pin or '-':<14} {state}")
    if args.semantic is not None:
        targets = args.semantic or [r["version"] for r in rows if r.get("bug")][:1] + \
            [r["version"] for r in rows if r.get("bug")][-1:]
        for label, nvcc in (("no nvcc, version.json 12.9.1", None), ("nvcc reports 12.4", "12.4")):
            res = semantic(targets, nvcc)
            print(f"\ntorch.compile(fullgraph=True) of is_cuda_version_at_least('12.8'), torch {res.pop('torch')}, "
                  f"CUDA_HOME: {label}")
            for v, kinds in res.items():
                for kind in ("pristine", "patched"):
                    r = kinds[kind]
                    print(f"  {v:<14} {kind:<9} {r['result']:<12} " + (
                        f"get_cuda_version()={r['version']} value={r['value']}" if r["result"] == "pass"
                        else textwrap.shorten(r["error"], 110)))


if __name__ == "__main__":
    main()
