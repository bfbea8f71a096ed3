"""The shipped flashinfer-python patch on EVERY flashinfer-python release on PyPI (0.2.0.post1-0.7.4).

For each release: does it have the bug (is_cuda_version_at_least() -> get_cuda_version() ->
subprocess nvcc --version, which torch dynamo cannot trace), and does the shipped patch cover it:
`applies_to` holds exactly the releases with the bug, the patch applies there with real patch(1)
and no fuzz (as the host runs it), re-applying is refused, the reverse restores the exact bytes.
Releases without the bug are outside `applies_to`, so patch.status says "version does not match"
(never "conflicts"). Semantically, on the oldest and the newest release with the bug, a
torch.compile(fullgraph=True) of is_cuda_version_at_least is Unsupported pristine and passes patched.

Archives come from the cache (~/.cache/servops-tests/flashinfer-src/, bench/flashinfer_patch_sweep.py),
fetched once where missing; only flashinfer/jit/cpp_ext.py is unpacked. Offline and uncached: skipped.
"""


import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import bench_script
from servops import patching
from servops.patchstore import find_patch

pytestmark = pytest.mark.sweep  # every release from the wheel cache: not the edit loop (-m quick)

sweep = bench_script("flashinfer_patch_sweep")

# Every flashinfer-python release on PyPI (`pip index versions flashinfer-python`; there is no 0.2.0).
RELEASES = """
0.2.0.post1 0.2.0.post2 0.2.1 0.2.1.post1 0.2.1.post2 0.2.2 0.2.2.post1 0.2.3 0.2.4 0.2.5 0.2.6 0.2.6.post1
0.2.7 0.2.7.post1 0.2.8 0.2.9 0.2.10 0.2.11 0.2.11.post1 0.2.11.post2 0.2.11.post3 0.2.12 0.2.13 0.2.14
0.2.14.post1 0.3.0 0.3.0.post1 0.3.1 0.3.1.post1 0.4.0 0.4.1 0.5.0 0.5.1 0.5.2 0.5.3 0.6.0 0.6.1 0.6.2
0.6.3 0.6.4 0.6.5 0.6.6 0.6.7 0.6.7.post1 0.6.7.post2 0.6.7.post3 0.6.8 0.6.8.post1 0.6.9 0.6.10
0.6.10.post1 0.6.11 0.6.11.post1 0.6.11.post2 0.6.11.post3 0.6.12 0.6.13 0.6.14 0.6.15 0.6.15.post1
0.6.16 0.6.16.post1 0.6.16.post2 0.6.16.post3 0.6.16.post4 0.6.17 0.6.18 0.6.18.post1 0.7.0 0.7.0.post1
0.7.1 0.7.2 0.7.2.post1 0.7.4
""".split()

# Read from the releases (the sweep re-derives it from each file): get_cuda_version() with its nvcc
# subprocess arrives in 0.2.14.post1 (0.2.14 has only a private _get_cuda_version() used while
# building kernels, 0.2.5 and older have no jit/cpp_ext.py) and is still there in 0.7.4.
FIRST_BUG = "0.2.14.post1"
# sglang's pins (Requires-Dist of each release's wheel) that the note in the patch's .yml names
SGLANG_PINS = {"0.5.1.post2": "0.2.14.post1", "0.5.3.post2": "0.4.0", "0.5.9": "0.6.3",
               "0.5.15": "0.6.12", "0.5.23": "0.7.2"}


def bug_expected(version: str) -> bool:
    return Version(version) >= Version(FIRST_BUG)


def tree_for(version: str):
    tree = sweep.release_tree(version)
    if tree is None:
        pytest.skip(f"flashinfer-python {version}: not cached and the download failed (offline?)")
    return tree


@pytest.mark.parametrize("version", RELEASES)
def test_the_patch_covers_exactly_the_releases_with_the_bug(version):
    row = sweep.check_release(version, tree_for(version))
    assert row["bug"] == bug_expected(version), row
    if row["bug"]:
        assert row["where"]["get_cuda_version"] == [sweep.CPP_EXT], row["where"]
        assert row["in_range"], f"{version} has the bug but is outside applies_to"
        assert row["applies"], f"{version}: the patch does not apply with patch(1) --fuzz=0: {row['detail']}"
        assert row["roundtrip"] == [], row["roundtrip"]
    else:
        assert row["where"]["get_cuda_version"] == [] and row["where"]["is_cuda_version_at_least"] == []
        assert not row["in_range"], f"{version} has no bug but is inside applies_to"
        assert not row["applies"]  # and patch.status never gets to say "conflicts": see below
    assert sweep.verdict(row) in ("covered", "no bug; excluded by applies_to (status: version does not match)")


def test_metadata_range_is_the_swept_one_and_releases_are_all_listed():
    patch = find_patch("cuda-version-no-subprocess")
    assert patch.applies_to == SpecifierSet(f">={FIRST_BUG},<0.8")
    assert [v for v in RELEASES if patch.version_ok(v)] == [v for v in RELEASES if bug_expected(v)]
    assert RELEASES == sorted(RELEASES, key=Version) and len(set(RELEASES)) == len(RELEASES)
    meta = (patch.path.with_suffix(".yml")).read_text()
    for sglang, flashinfer in SGLANG_PINS.items():
        assert patch.version_ok(flashinfer) and f"{sglang}" in meta, (sglang, flashinfer)
    assert "0.2.14.post1" in meta and "0.7.4" in meta
    # newer than the sweep: a cached release after 0.7.4 is swept too and must still be covered
    newer = [v for v in sweep.archives() if Version(v) > Version(RELEASES[-1])]
    for v in newer:
        row = sweep.check_release(v, sweep.release_tree(v))
        assert not row["bug"] or (row["in_range"] and row["applies"]), row


def test_every_sglang_with_piecewise_cuda_graphs_pins_a_covered_flashinfer():
    """sglang's own pins (Requires-Dist in each cached sglang wheel): from 0.5.3.post2, the first
    release with --enable-piecewise-cuda-graph, every one pins a swept flashinfer release the patch
    covers (sglang 0.5.9 pins 0.6.3, which the patch as first written, for 0.7.2.post1, missed)."""
    pins = sweep.sglang_pins()
    if not pins:
        pytest.skip("no sglang wheels in the tests' cache")
    for sglang, flashinfer in SGLANG_PINS.items():
        if sglang in pins:
            assert pins[sglang] == flashinfer, (sglang, pins[sglang])
    patch = find_patch("cuda-version-no-subprocess")
    piecewise = {sg: pin for sg, pin in pins.items() if Version(sg) >= Version("0.5.3.post2")}
    assert piecewise, "no cached sglang with piecewise CUDA graphs"
    for sglang, flashinfer in piecewise.items():
        assert flashinfer in RELEASES and bug_expected(flashinfer), (sglang, flashinfer)
        assert patch.version_ok(flashinfer), (sglang, flashinfer)


@pytest.mark.parametrize("version,remote_state", [("0.2.5", "conflicts"), ("0.2.14", "conflicts"),
                                                  ("0.2.14", "not-applied")])
def test_a_release_without_the_bug_is_version_does_not_match_not_conflicts(version, remote_state):
    """What the host's patch(1) probe says there (it cannot apply: no get_cuda_version) is
    overridden by applies_to: status names the version mismatch (the rows from the host's entries,
    as patch_op writes them)."""
    patch = find_patch("cuda-version-no-subprocess")
    entry = {"name": patch.name, "dist": patch.distribution, "state": remote_state, "version": version,
             "recorded": False}
    [row] = patching.status_rows("lab1", [patch], [entry])
    assert row["state"] == patching.MISMATCH and row["version"] == version


def test_semantic_oldest_and_newest_bug_release_pristine_unsupported_patched_traces():
    if sweep.torch_python() is None:
        pytest.skip("no CPU torch venv in the tests' cache (servops/lab/venvs.py builds it)")
    bugged = [v for v in RELEASES if bug_expected(v)]
    targets = [bugged[0], bugged[-1]]
    for v in targets:
        tree_for(v)
    for nvcc, version, value in ((None, "12.9", [2.0, 2.0]), ("12.4", "12.4", [0.0, 0.0])):
        res = sweep.semantic(targets, nvcc)
        for v in targets:
            assert res[v]["pristine"]["result"] == "unsupported", (v, nvcc, res[v])
            assert "Unsupported" in res[v]["pristine"]["error"]
            # patched: the release's own nvcc query when nvcc is there, else the toolkit's version.json
            assert res[v]["patched"] == {"result": "pass", "value": value, "version": version}, (v, nvcc, res[v])
