"""The launch preflight's static path and the shipped variants on EVERY sglang release 0.4.0-0.5.23.

For each release: its parser rebuilt from its own source (servops/remote/sglang_args.py, the code
the remote launch_check runs when sglang does not import), and baseline + piecewise resolved for
that version (their `when:` rules) parsed with it. Expected: both variants launch on every release
where their intent exists, and a `when:` rule refuses, in one line naming the version, where it
does not; that refusal is right because the release's own parser rejects the flag the intent
needs (so the rule is never a guess).

Wheels come from the tests' cache (~/.cache/servops-tests/wheels, servops/lab/venvs.py), fetched
once with `pip download --no-deps` where missing; only the modules the static read reaches are
unpacked (~/.cache/servops-tests/sglang-src/<version>, a few files each), and a cached unpacked
tree is enough without its wheel. bench/sglang_release_sweep.py prints the same table.
"""

import shutil

import pytest
from packaging.version import Version

from conftest import REPO, bench_script
from servops.launchcheck import _problem_lines, refusal_line
from servops.playbooks import load_variant, resolve
from servops.remote import sglang_args as sa

pytestmark = pytest.mark.sweep  # every release from the wheel cache: not the edit loop (-m quick)

sweep = bench_script("sglang_release_sweep")

# Every release on PyPI from 0.4.0 to 0.5.23 (there is no 0.5.0).
RELEASES = """
0.4.0 0.4.0.post1 0.4.0.post2 0.4.1 0.4.1.post1 0.4.1.post2 0.4.1.post3 0.4.1.post4 0.4.1.post5 0.4.1.post6
0.4.1.post7 0.4.2 0.4.2.post1 0.4.2.post2 0.4.2.post3 0.4.2.post4 0.4.3 0.4.3.post1 0.4.3.post2 0.4.3.post3
0.4.3.post4 0.4.4 0.4.4.post1 0.4.4.post2 0.4.4.post3 0.4.4.post4 0.4.5 0.4.5.post1 0.4.5.post2 0.4.5.post3
0.4.6 0.4.6.post1 0.4.6.post2 0.4.6.post3 0.4.6.post4 0.4.6.post5 0.4.7 0.4.7.post1 0.4.8 0.4.8.post1 0.4.9
0.4.9.post1 0.4.9.post2 0.4.9.post3 0.4.9.post4 0.4.9.post5 0.4.9.post6 0.4.10 0.4.10.post1 0.4.10.post2
0.5.1 0.5.1.post1 0.5.1.post2 0.5.1.post3 0.5.2 0.5.3 0.5.3.post1 0.5.3.post2 0.5.3.post3 0.5.4 0.5.4.post1
0.5.4.post2 0.5.4.post3 0.5.5 0.5.5.post1 0.5.5.post2 0.5.5.post3 0.5.6 0.5.6.post1 0.5.6.post2 0.5.7 0.5.8
0.5.8.post1 0.5.9 0.5.10 0.5.10.post1 0.5.11 0.5.12 0.5.12.post1 0.5.13 0.5.13.post1 0.5.14 0.5.15
0.5.15.post1 0.5.16 0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23
""".split()

# (flag the intent needs, first release that has it): refused by a `when:` rule before that
NEEDS = {"baseline": ("--moe-runner-backend", "0.5.1"),
         "piecewise": ("--enable-piecewise-cuda-graph", "0.5.3.post2")}


def expected(variant: str, version: str) -> str:
    """"ok", or "refused" (by a rule) for the releases that lack the variant's intent."""
    if Version(version) < Version(NEEDS["baseline"][1]):
        return "refused"  # piecewise extends baseline: refused there too
    return "refused" if Version(version) < Version(NEEDS[variant][1]) else "ok"


def release_tree(version: str):
    whl = sweep.wheel_versions().get(version)
    if whl is None and not (sweep.SOURCES / version / ".complete").exists():
        whl = sweep.ensure_wheel(version)
        if whl is None:
            pytest.skip(f"sglang {version}: no cached wheel and `pip download` failed (offline?)")
    return sweep.source_tree(version, whl)


@pytest.mark.parametrize("version", RELEASES)
def test_shipped_variants_on_every_release(version):
    tree = release_tree(version)
    assert sa.sglang_version(str(tree)) == version  # read from the package itself, as the host does
    row = sweep.check_release(version, tree)
    assert row["error"] is None, row["error"]
    assert row["actions"] > 80 and row["skipped"] == [], row["skipped"]  # every add_argument read
    for name in sweep.VARIANTS:
        cell = row[name]
        used = {a for a in cell["argv"] if a.startswith("--")}
        if expected(name, version) == "ok":
            assert cell["ok"], f"{name} on sglang {version}: {cell['problems']}"
            # current spellings: no deprecated alias, no abbreviation; every value really checked
            assert cell["warnings"] == [], f"{name} on sglang {version}: {cell['warnings']}"
            assert not used & set(row["unchecked"]), (name, version, used & set(row["unchecked"]))
        else:
            flag, since = NEEDS[name]  # the variant's own reason (a child's rule says it last)
            assert not cell["ok"] and cell["refuse"] and since in cell["refuse"], (name, version, cell)
            # the rule is right: this release's own parser does not know the flag the intent needs
            assert not cell["parsed"] and any(p.startswith(f"{flag}: unrecognized") for p in cell["problems"]), cell
            line = refusal_line(name, version, resolve(load_variant(name), version)[0])
            assert line.startswith(f"{name} cannot run on sglang {version}: ") and "\n" not in line


def test_the_sweep_covers_every_release_and_newer_cached_ones_pass():
    """Releases newer than the table (a cached 0.5.24+ wheel) get the newest rules and must pass."""
    newer = [v for v in sweep.wheel_versions() if Version(v) > Version(RELEASES[-1])]
    for version in newer:
        row = sweep.check_release(version, release_tree(version))
        assert row["baseline"]["ok"] and row["piecewise"]["ok"], (version, row["baseline"], row["piecewise"])


@pytest.fixture(scope="module")
def newest_tree():
    return release_tree(RELEASES[-1])


def future(tmp_path, newest_tree, renames: dict[str, str]):
    """sglang's newest tree with some flags renamed, standing in for a release nobody has read."""
    root = tmp_path / "future"
    shutil.copytree(newest_tree.parent, root, ignore=shutil.ignore_patterns(".complete"))
    for path in (root / "sglang").rglob("*.py"):
        text = path.read_text()
        new = text
        for old, repl in renames.items():
            new = new.replace(old, repl)
        if new != text:
            path.write_text(new)
    return root / "sglang"


def test_a_future_release_keeps_the_newest_rules_and_a_moved_flag_is_caught(tmp_path, newest_tree):
    # the newest rules keep applying past the last release anyone read
    for name in sweep.VARIANTS:
        resolved, rules = resolve(load_variant(name), "0.6.0")
        assert not resolved.get("refuse") and rules == resolve(load_variant(name), RELEASES[-1])[1]
    # unchanged flags: both variants pass
    same = sa.static_parser(str(future(tmp_path / "same", newest_tree, {})))
    for name in sweep.VARIANTS:
        argv = sweep.argv_for(name, "0.6.0")[0]
        assert sa.validate(same, argv, "0.6.0")["ok"]
    # a renamed flag: refused, naming the version and the new spelling (difflib)
    moved = sa.static_parser(str(future(tmp_path / "moved", newest_tree, {
        "cuda_graph_backend_prefill": "cuda_graph_prefill_backend",
        "cuda_graph_max_bs_decode": "cuda_graph_decode_max_bs"})))
    argv = sweep.argv_for("piecewise", "0.6.0")[0]
    lines = _problem_lines(sa.validate(moved, argv, "0.6.0"), "0.6.0", True)
    assert any(l.startswith("--cuda-graph-backend-prefill: unrecognized on sglang 0.6.0 (static check); did you "
                            "mean ") and "--cuda-graph-prefill-backend" in l for l in lines), lines
    assert any(l.startswith("--cuda-graph-max-bs-decode: unrecognized on sglang 0.6.0") and
               "--cuda-graph-decode-max-bs" in l for l in lines), lines


def launch_check_namespace() -> dict:
    """The remote launch_check program's functions (sglang_args included first, as it ships),
    without running its main()."""
    remote = REPO / "servops" / "remote"
    text = (remote / "sglang_args.py").read_text() + "\n" + (remote / "launch_check.py").read_text()
    text = text[:text.rindex("\nmain()")]
    ns: dict = {"__name__": "launch_check_under_test"}
    exec(compile(text, "launch_check", "exec"), ns)
    return ns


@pytest.mark.parametrize("version,known", [("0.5.8.post1", False), ("0.5.9", True)])
def test_the_model_architecture_is_looked_up_in_the_release(tmp_path, version, known):
    """GLM-5 (GlmMoeDsaForCausalLM) ships from 0.5.9: on 0.5.8 the flags pass but the model would
    not load, and the preflight says so (a warning: --model-impl transformers may still serve it)."""
    import zipfile

    whl = sweep.ensure_wheel(version)
    if whl is None:
        pytest.skip(f"no sglang {version} wheel (offline?)")
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.startswith("sglang/srt/models/") and name.endswith(".py"):
                z.extract(name, tmp_path)
    ns = launch_check_namespace()
    missing = ns["missing_architectures"](str(tmp_path / "sglang"), ["GlmMoeDsaForCausalLM", "LlamaForCausalLM"])
    assert missing == ([] if known else ["GlmMoeDsaForCausalLM"])


def test_a_tree_a_killed_run_left_half_unpacked_is_unpacked_again(tmp_path):
    """A tree without its .complete marker (the run was killed while unpacking: a file half-written,
    others missing) is unpacked again from scratch, never read as it is."""
    version = RELEASES[-1]
    whl = sweep.ensure_wheel(version)
    if whl is None:
        pytest.skip(f"no sglang {version} wheel (offline?)")
    pkg = sweep.source_tree(version, whl, root=tmp_path)
    whole = {p: p.read_bytes() for p in pkg.rglob("*.py")}
    args = pkg / "srt" / "server_args.py"
    args.write_bytes(whole[args][:1000])  # cut off mid-file, as a kill leaves it
    (pkg.parent / ".complete").unlink()
    next(p for p in whole if p != args).unlink()
    again = sweep.source_tree(version, whl, root=tmp_path)
    assert {p: p.read_bytes() for p in again.rglob("*.py")} == whole
    assert sweep.check_release(version, again)["error"] is None
