"""The piecewise fix set per sglang release: the sglang patch flashinfer-fp8-blockscale-custom-op
covers exactly the releases whose fp8_utils.py calls FlashInfer's fp8_blockscale_gemm_sm90 bare
(bench/sglang_fp8_call_sweep.py reads each released wheel): there it applies with real patch(1) and
no fuzz, removes the bare call, is refused a second time and reverts to the exact bytes; elsewhere it
is outside applies_to ("version does not match"). And the piecewise variant resolves the set."""

import pytest

from conftest import bench_script
from servops.playbooks import load_variant, resolve

sweep = bench_script("sglang_fp8_call_sweep")
FIRST_BARE = "0.5.9"  # read from the wheels: 0.5.5-0.5.8 have no such call


@pytest.mark.parametrize("version", sweep.RELEASES)
def test_the_sglang_patch_covers_exactly_the_releases_with_the_bare_call(version):
    row = sweep.check_release(version)
    if not row["cached"]:
        pytest.skip(f"sglang {version}: not cached and the download failed (offline?)")
    from packaging.version import Version
    assert row["bare"] == (Version(version) >= Version(FIRST_BARE)), row
    assert row["in_applies_to"] == row["bare"], row
    if row["bare"]:
        assert row["applies"] and row["fixed"] and row["reapply_refused"] and row["reverts_exactly"], row


@pytest.mark.parametrize("version,expected", [
    ("0.5.8", ["cuda-version-no-subprocess"]),
    ("0.5.9", ["cuda-version-no-subprocess", "flashinfer-fp8-blockscale-custom-op"]),
    ("0.5.17", ["cuda-version-no-subprocess", "flashinfer-fp8-blockscale-custom-op"]),
    ("0.5.21", ["cuda-version-no-subprocess", "flashinfer-fp8-blockscale-custom-op"]),
    ("0.5.22", ["cuda-version-no-subprocess"]),  # no dynamo capture there: the breakable prefill graph
])
def test_piecewise_resolves_the_fix_set_of_each_release(version, expected):
    resolved, rules = resolve(load_variant("piecewise"), version)
    # the NVFP4 linear's patches (tests/test_sglang_fp4_fix_set.py) join the set where they apply
    nvfp4 = ("flashinfer-fp4-quantize", "flashinfer-mm-fp4")
    assert [p for p in resolved["patches"] if not p.startswith(nvfp4)] == expected
    assert any("+patch flashinfer-fp8-blockscale-custom-op" in r for r in rules) == (len(expected) == 2)


def test_the_patch_the_audit_synthesised_on_the_gpu_applies_to_its_release_only(tmp_path):
    """patches/sglang/audit-per-token-group-quant-0.5.17: written and proven by `invoke audit --fix`
    on an H100 (2026-12-07), stored as the cache of that proof: it applies to the released 0.5.17
    file with patch(1) and no fuzz, the result compiles, a second apply is refused, and its
    applies_to is that release alone."""
    import py_compile
    import subprocess
    import zipfile

    from servops.lab.venvs import cached_sglang_wheel
    from servops.patchstore import find_patch

    p = find_patch("audit-per-token-group-quant-0.5.17")
    assert p.version_ok("0.5.17") and not p.version_ok("0.5.16") and not p.version_ok("0.5.18")
    wheel = cached_sglang_wheel("0.5.17")
    if wheel is None:
        pytest.skip("sglang 0.5.17: not cached and the download failed (offline?)")
    with zipfile.ZipFile(wheel) as z:
        z.extract(p.files[0], tmp_path)
    patch = ["patch", "-p1", "-F0", "-N", "-s", "-d", str(tmp_path)]
    assert subprocess.run(patch, input=p.text.encode(), capture_output=True).returncode == 0
    py_compile.compile(str(tmp_path / p.files[0]), doraise=True)
    assert "servops::sglang_per_token_group_quant_" in (tmp_path / p.files[0]).read_text()
    assert subprocess.run(patch + ["--dry-run"], input=p.text.encode(), capture_output=True).returncode != 0


def test_diagnose_names_the_gpu_crashes_and_the_healthy_capture():
    """The server.logs of the H100 run (bench/evidence/seed-sm90/): the flashinfer patch alone is the
    JIT-loader crash, with the fix it names; the complete set's log is a healthy server."""
    from conftest import REPO, run_invoke

    evidence = REPO / "bench" / "evidence" / "seed-sm90"
    res = run_invoke("diagnose", "--log", str(evidence / "server-flashinfer-patch-alone.log"), "--offline")
    assert res.returncode == 1, res.stdout + res.stderr  # a crash, explained
    assert "matched: dynamo-flashinfer-jit-loader (dynamo-trace)" in res.stdout
    assert "flashinfer-fp8-blockscale-custom-op" in res.stdout
    assert "dynamo-get-cuda-version-subprocess" not in res.stdout
    res = run_invoke("diagnose", "--log", str(evidence / "server-complete-fix-set.log"), "--offline")
    assert res.returncode == 0 and "no errors found" in res.stdout, res.stdout
