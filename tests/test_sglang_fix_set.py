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
