"""Which sglang releases call FlashInfer's fp8_blockscale_gemm_sm90 bare (the call the piecewise capture
traces into FlashInfer's version query and JIT loader on SM90), and does the shipped fix
(patches/sglang/flashinfer-fp8-blockscale-custom-op.patch) cover exactly those?

For each `sglang==X` wheel (fetched once into ~/.cache/servops-tests/wheels, servops.lab.venvs), only
sglang/srt/layers/quantization/fp8_utils.py is read: "bare" when it imports fp8_blockscale_gemm_sm90
from flashinfer.gemm and defines no function of that name (an opaque custom op would be one); the
patch is applied to a copy with real patch(1), no fuzz, re-applied (must be refused) and reversed
(must restore the exact bytes).

    python bench/sglang_fp8_call_sweep.py            # the table over 0.5.5 .. 0.5.23
    python bench/sglang_fp8_call_sweep.py 0.5.17     # some releases
"""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from servops.lab.patchtrial import try_on_copy  # noqa: E402
from servops.lab.venvs import cached_sglang_wheel  # noqa: E402
from servops.patchstore import find_patch  # noqa: E402

FILE = "sglang/srt/layers/quantization/fp8_utils.py"
PATCH = "flashinfer-fp8-blockscale-custom-op"
RELEASES = ("0.5.5 0.5.6 0.5.7 0.5.8 0.5.9 0.5.10 0.5.11 0.5.12 0.5.13 0.5.14 0.5.15 0.5.15.post1 0.5.16 "
            "0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23").split()


def calls_bare(source: str) -> bool:
    tree = ast.parse(source)
    imported = any(isinstance(n, ast.ImportFrom) and n.module == "flashinfer.gemm"
                   and any(a.name == "fp8_blockscale_gemm_sm90" and a.asname is None for a in n.names)
                   for n in ast.walk(tree))
    wrapped = any(isinstance(n, ast.FunctionDef) and n.name == "fp8_blockscale_gemm_sm90" for n in ast.walk(tree))
    return imported and not wrapped


def check_release(version: str) -> dict:
    whl = cached_sglang_wheel(version)
    if whl is None:
        return {"version": version, "cached": False}
    with zipfile.ZipFile(whl) as z:
        original = z.read(FILE) if FILE in z.namelist() else None
    row = {"version": version, "cached": True, "has_file": original is not None}
    patch = find_patch(PATCH)
    row["in_applies_to"] = patch.version_ok(version)
    if original is None:
        return dict(row, bare=False)
    row["bare"] = calls_bare(original.decode())
    return dict(row, **try_on_copy(FILE, original, [patch.text], lambda source: not calls_bare(source)))


def verdict(row: dict) -> str:
    if not row["cached"]:
        return "not downloadable (offline?)"
    if not row.get("bare"):
        return "no bare call: outside applies_to" if not row["in_applies_to"] else "NO BARE CALL BUT IN applies_to"
    if not row["in_applies_to"]:
        return "BARE CALL OUTSIDE applies_to"
    ok = row.get("applies") and row.get("fixed") and row.get("reapply_refused") and row.get("reverts_exactly")
    return "bare call: patch applies, fixes, reverts exactly" if ok else f"PATCH PROBLEM {row}"


def main() -> None:
    for version in sys.argv[1:] or RELEASES:
        print(f"sglang {version:13} {verdict(check_release(version))}", flush=True)


if __name__ == "__main__":
    main()
