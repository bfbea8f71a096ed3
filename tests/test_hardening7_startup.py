"""Hardening round 7, start-up phases and the kernel caches: an engine log whose phase lines lie
(read by startlog in the health gate, after the server is healthy), history records of starts
that lie, and the ledger in a jit_cache_dir another hand has been in (read and written by the
real host code: _common.py and cache_ledger.py as the programs ship them, in a child python).

Each attack failed before its fix: a ValueError out of the health gate of a healthy server (the
deploy then fails and rolls back), a negative or an infinite phase in release.json and the
journal, a health gate hanging on a FIFO, a failed ledger write failing the gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servops import schema, startup
from servops.errors import ServopsError
from servops.remote.startlog import start_phases

REMOTE = Path(__file__).resolve().parent.parent / "servops" / "remote"
S = "[2026-12-07 10:00:00] "

LYING_LOGS = {
    "seconds-1.2.3": [S + "Load weight end. elapsed=1.2.3 s"],
    "seconds-dot": [S + "Capture cuda graph end. Time elapsed: . s"],
    "month-13": ["[2026-13-45 99:99:99] Load weight begin"],
    "february-30": ["[2026-02-30 10:00:00] Load weight begin"],
    "asctime-month-99": ["2026-99-07 10:00:10,123 - INFO - Loading weights took 3 seconds"],
    "vllm-month-13": ["INFO 13-45 10:00:00 Loading weights took 3 seconds"],
    "clock-backwards": ["[2026-12-07 10:00:10] Load weight begin", "[2026-12-07 10:00:00] Load weight end."],
    "jit-backwards": ["[2026-12-07 10:00:10] flashinfer.jit: Loading JIT ops: a",
                      "[2026-12-07 10:00:00] flashinfer.jit: Finished loading JIT ops: a"],
    "seconds-1e30": [S + "Load weight end. elapsed=1000000000000000000000000000000 s"],
    "seconds-400-digits": [S + "torch.compile takes " + "9" * 400 + " s in total"],
    "a-50MB-line": [S + "Load weight end. elapsed=" + "1" * (50 << 20)],
}


@pytest.mark.parametrize("name", sorted(LYING_LOGS))
def test_a_lying_phase_line_is_left_out_never_a_crash_a_negative_or_an_infinity(name):
    started = time.monotonic()
    phases = start_phases(LYING_LOGS[name] + [S + "Capture cuda graph end. Time elapsed: 2.5 s"], total=9.0)
    assert time.monotonic() - started < 5
    json.dumps(phases, allow_nan=False)  # strict JSON: release.json, the journal, the ledger
    assert all(0 <= v <= 9.0 for v in phases.values())
    assert phases["capture_s"] == 2.5 and phases["start_s"] == 9.0  # the honest line still counts


@pytest.mark.parametrize("total", [float("nan"), float("inf"), -5.0, 1e30])
def test_a_total_no_start_takes_is_not_recorded(total):
    assert start_phases([S + "Load weight end. elapsed=3 s"], total) == {"weights_s": 3.0}


def test_a_history_record_with_negative_or_huge_phases_shows_none_of_them():
    record = {"weights_s": -10.0, "jit_s": 1e8, "capture_s": 2.0, "start_s": "3", "other_s": True}
    assert startup.clean(record) == {"capture_s": 2.0}
    assert startup.grown({"weights_s": 1.0}, startup.clean({"weights_s": -500.0, "other_s": 1})) == []


# ---- the cache ledger, as the host code reads and writes it -----------------------------------------

def host_code(snippet: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """`snippet` after _common.py and cache_ledger.py, as deploy_ctl ships them, in a child python."""
    program = "\n\n".join((REMOTE / f"{p}.py").read_text() for p in ("_common", "cache_ledger")) + "\n" + snippet
    return subprocess.run([sys.executable, "-"], input=program, text=True, capture_output=True, timeout=timeout)


def read_ledger_of(root: Path) -> dict:
    res = host_code(f"print(json.dumps(read_ledger({str(root)!r})))")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_fifo_as_the_ledger_is_damaged_not_a_hung_gate(tmp_path):
    os.mkfifo(tmp_path / "servops-ledger.json")
    started = time.monotonic()
    ledger = read_ledger_of(tmp_path)  # before: open() waited for a writer (TimeoutExpired here)
    assert "not a regular file" in ledger["damaged"] and time.monotonic() - started < 10


@pytest.mark.parametrize("kinds", [{"jit_s": []}, {"jit_s": {"k": 5}}, {"jit_s": "x"}])
def test_a_ledger_of_the_wrong_shape_is_damaged_and_the_start_still_recorded_as_a_problem(tmp_path, kinds):
    (tmp_path / "servops-ledger.json").write_text(json.dumps({"kinds": kinds}))
    assert "not a ledger" in read_ledger_of(tmp_path)["damaged"]
    # before: AttributeError/TypeError out of record_built, after a healthy start
    res = host_code(f"print(json.dumps(record_built({{'dir': {str(tmp_path)!r}, 'keys': {{'jit_s': 'k'}}}}, "
                    f"{{'jit_s': 1.0}}, 'r1')))")
    assert res.returncode == 0 and "not a ledger" in json.loads(res.stdout)


FULL_DISK = ("import resource, signal\n"
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))  # a write past 16 bytes fails, as on a full disk\n")
RECORD = "print(json.dumps(record_built({'dir': %r, 'keys': {'jit_s': 'k'}}, {'jit_s': 1.0}, 'r1')))"


def test_a_ledger_write_that_fails_is_said_and_leaves_no_scratch_file(tmp_path):
    root = tmp_path / "jit"
    res = host_code(FULL_DISK + RECORD % str(root))
    assert res.returncode == 0, res.stderr  # before: OSError (EFBIG) out of the health gate
    assert "not written" in json.loads(res.stdout)
    assert list(root.iterdir()) == []  # before: servops-ledger.json.<pid>.tmp left in the shared directory


def test_a_cache_dir_that_is_a_file_is_said_not_a_failed_gate(tmp_path):
    as_file = tmp_path / "afile"
    as_file.write_text("x")
    res = host_code(RECORD % str(as_file))  # before: FileExistsError out of the health gate
    assert res.returncode == 0 and "not written" in json.loads(res.stdout)


def unsafe(path: Path) -> str | None:
    res = host_code(f"print(json.dumps(unsafe_cache_dir(cache_root({str(path)!r}))))")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_cache_dir_anyone_can_write_or_that_is_a_file_is_unsafe_a_new_one_is_not(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # /tmp-like: anyone may plant a kernel the server loads
    assert "writable by anyone" in unsafe(shared)
    as_file = tmp_path / "file"
    as_file.write_text("")
    assert "not a directory" in unsafe(as_file)
    assert "not a directory" in unsafe(as_file / "under")
    link = tmp_path / "to-root"
    link.symlink_to("/")
    assert "is /" in unsafe(link)  # the engines' caches and the ledger would be written at the root
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    if os.getuid() == 0:  # (as root the test can hand it to another user; as anyone else, root's /usr is theirs)
        os.chown(theirs, 65534, 65534)
    else:
        theirs = Path("/usr")
    assert "owned by uid" in unsafe(theirs)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    assert unsafe(mine) is None and unsafe(tmp_path / "new" / "jit") is None


@pytest.mark.parametrize("value, why", [("~/jit", "not an absolute path"), ("cache/jit", "not an absolute path"),
                                        ("/var/cache/../../etc", "'..'")])
def test_a_jit_cache_dir_the_launch_script_and_the_ledger_would_read_differently_is_refused(value, why):
    # before: '~/jit' was exported quoted (a directory named ~ in each release's own directory)
    # while the ledger expanded it (the user's home): every start "reused" a cache it never had
    with pytest.raises(ServopsError, match=why):
        schema.coerce(value, schema.INVENTORY_VARS["jit_cache_dir"], "inventory/x.yml: hosts.h1.jit_cache_dir")
    assert schema.coerce("/var/cache/a b/$(id)", schema.INVENTORY_VARS["jit_cache_dir"], "x") == "/var/cache/a b/$(id)"


def test_a_journal_entry_whose_fields_are_numbers_or_objects_is_shown_not_a_crash(capsys):
    from servops.ops import print_history
    # the host's journal check holds `at` and `action` to text; every other field may be any JSON
    print_history("h1", [{"at": "2026-12-07T10:00:00Z", "action": "deploy", "release": 7, "to": ["r2"],
                          "who": {"user": "x"}, "outcome": 3, "start": {"weights_s": -3.0, "start_s": 2.0}},
                         {"at": "2026-12-07T10:01:00Z", "action": "restart", "release": "r1", "start": "fast"}])
    out = capsys.readouterr().out
    # before: TypeError (7 + " -> ..."), and rich's NotRenderableError for an object in a cell
    assert "7 -> ['r2']" in out and "start to healthy 2.0s" in out and "-3.0" not in out


def test_a_full_ledger_whose_entries_another_hand_wrote_is_pruned_and_counted(tmp_path):
    # 500 keys whose "at" is a number, one whose "starts" is text: TypeError/ValueError out of the gate before
    entries = {f"k{i}": {"release": "r0", "at": i, "starts": 1} for i in range(500)}
    entries["k0"]["starts"] = "many"
    (tmp_path / "servops-ledger.json").write_text(json.dumps({"kinds": {"jit_s": entries}}))
    res = host_code(f"print(json.dumps(record_built({{'dir': {str(tmp_path)!r}, 'keys': {{'jit_s': 'new'}}}}, "
                    f"{{'jit_s': 1.0}}, 'r1')))\n"
                    f"print(json.dumps(record_built({{'dir': {str(tmp_path)!r}, 'keys': {{'jit_s': 'k0'}}}}, {{}}, 'r1')))")
    assert res.returncode == 0, res.stderr
    kept = read_ledger_of(tmp_path)["kinds"]["jit_s"]
    assert len(kept) == 500 and "new" in kept


@pytest.mark.parametrize("key", ["port", "--port", "host"])
def test_warm_up_args_that_move_its_port_are_refused(key):
    # the pre-build polled jit_warmup_port while the warm-up listened elsewhere: 20 minutes to time out
    with pytest.raises(ServopsError, match="jit_warmup_port"):
        schema.coerce({key: 1234, "mem-fraction-static": 0.3}, schema.INVENTORY_VARS["jit_warmup_args"], "x")
    assert schema.coerce({"mem-fraction-static": 0.3}, schema.INVENTORY_VARS["jit_warmup_args"], "x")


def test_build_times_a_ledger_holds_that_no_build_takes_are_not_an_expectation():
    from servops import engines, jitcache
    sglang = engines.get("sglang")
    argv = ["--model-path", "/m", "--port", "30000"]
    key = jitcache.keys("sglang", argv, {})["jit_s"]
    facts = {"dir": "/c", "versions": {}, "ledger": {"kinds": {"jit_s": {
        "a": {"seconds": float("inf")}, "b": {"seconds": float("nan")}, "c": {"seconds": -5}, "d": {"seconds": 40},
        key: {"release": "r", "at": "t", "warm_s": float("nan")}}}}}
    plan = jitcache.plan(sglang, argv, facts)
    jit = next(k for k in plan.kinds if k.kind == "jit_s")
    # before: "its latest start spent nans there"; the compile kind's median over inf: "~infs"
    assert jit.reuse and "nan" not in jit.text()
    facts["ledger"]["kinds"]["compile_s"] = {"x": {"seconds": float("inf")}, "y": {"seconds": 1e308}, "z": {"seconds": 12}}
    compile_kind = next(k for k in jitcache.plan(sglang, argv, facts).kinds if k.kind == "compile_s")
    assert compile_kind.history == [12.0] and "~12s" in compile_kind.text()


@pytest.mark.parametrize("start", [[1, 2], "fast", {"weights_s": -4.0, "jit_s": float("inf"), "capture_s": 2.0}])
def test_a_tuning_trials_start_up_from_the_host_keeps_plausible_phases_only(start):
    from servops.tune import Runner
    # before: a list or text was .items()-ed (AttributeError ended the campaign), -4 s and inf were kept
    times = Runner._start_times({"elapsed": 9.5, "start": start})
    assert times["start_s"] == 9.5 and all(0 <= v <= 9.5 for v in times.values())


def test_phases_summed_past_the_whole_start_are_left_out():
    # 2,000 JIT modules opened and never finished, each counted to the log's end: 2,000 x 60 s in a 70 s start
    lines = [f"[2026-12-07 10:00:{i % 10:02d}] flashinfer.jit: Loading JIT ops: m{i}" for i in range(2000)]
    lines.append("[2026-12-07 10:01:10] Load weight end. elapsed=5 s")
    phases = start_phases(lines, total=70.0)
    assert "jit_s" not in phases and phases["weights_s"] == 5.0 and phases["other_s"] == 65.0


def test_jit_builds_are_read_from_the_files_a_start_wrote_grouped_by_their_directory(tmp_path):
    """The health gate's reading of the JIT caches on a local directory, as the host code runs it:
    a build lasts from its directory's first new file to its last; files from before the start,
    caches of another kind and a symlink out of the cache are not counted."""
    now = time.time()
    def put(rel: str, age: float) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        os.utime(path, (now - age, now - age))
    put("tvm_ffi/sgl_kernel_jit_a/build.ninja", 100)     # a build: 100 s to 40 s ago
    put("tvm_ffi/sgl_kernel_jit_a/main.o", 70)
    put("tvm_ffi/sgl_kernel_jit_a/sgl_kernel_jit_a.so", 40)
    put("triton/ABC/kernel.cubin", 30)                    # a kernel written in one go: counts ~0
    put("triton/ABC/kernel.json", 30)
    put("triton/OLD/kernel.cubin", 5000)                  # built by an earlier start
    put("inductor/fx/graph", 20)                          # compile, not JIT
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    outside.mkdir()
    (outside / "big.so").write_text("x")
    (tmp_path / "triton" / "link").symlink_to(outside)
    spec = {"dir": str(tmp_path), "jit_dirs": ["tvm_ffi", "triton", "missing"]}
    res = host_code(f"print(json.dumps(jit_builds_since({spec!r}, {now - 200})))\n"
                    f"s = {{'other_s': 50.0, 'weights_s': 3.0}}\nnote_jit_builds({spec!r}, s, 200)\nprint(json.dumps(s))\n"
                    f"t = {{'jit_s': 4.0, 'other_s': 50.0}}\nnote_jit_builds({spec!r}, t, 200)\nprint(json.dumps(t))")
    assert res.returncode == 0, res.stderr
    found, capped, logged = map(json.loads, res.stdout.splitlines())
    assert found[0] == 2 and abs(found[1] - 60.0) < 0.5, found
    assert capped == {"other_s": 50.0, "weights_s": 3.0, "jit_builds": 2, "jit_files_s": 50.0}  # within the rest
    assert logged == {"jit_s": 4.0, "other_s": 50.0}      # the log timed it: its figure stands
    assert startup.text(startup.clean(dict(capped, start_s=53.0))).endswith(
        "(weights 3.0s, other 50.0s; not in the log: JIT, compile, capture; the JIT caches show 2 builds, "
        "~50.0s by their files, within other)")


def test_a_cache_too_big_to_read_in_time_gives_no_figure_rather_than_a_wrong_one(tmp_path):
    for i in range(40):
        (tmp_path / "triton" / f"k{i}").mkdir(parents=True)
        (tmp_path / "triton" / f"k{i}" / "kernel.cubin").write_text("x")
    res = host_code("BUILD_SCAN_ENTRIES = 30\n"
                    f"print(json.dumps(jit_builds_since({{'dir': {str(tmp_path)!r}, 'jit_dirs': ['triton']}}, 0)))")
    assert res.returncode == 0 and json.loads(res.stdout) is None, res.stdout + res.stderr


def test_a_phase_that_grew_counts_the_jit_the_caches_showed_where_the_log_showed_none():
    before = {"start_s": 30.0, "weights_s": 2.0, "other_s": 28.0, "jit_builds": 0.0, "jit_files_s": 0.0}
    cold = {"start_s": 235.0, "weights_s": 2.0, "other_s": 233.0, "jit_builds": 9.0, "jit_files_s": 205.0}
    # the builds lie within other: named once, as JIT (the rest, 28 s, is as before)
    assert startup.grown(cold, before) == ["JIT 0.0s -> 205.0s (+205.0s; noise 1.0s)"]
    slow = dict(cold, other_s=253.0)
    assert startup.grown(slow, before)[1] == "other 28.0s -> 48.0s (+20.0s; noise 2.8s)"
