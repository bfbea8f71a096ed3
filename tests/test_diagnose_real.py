"""diagnose on real logs posted in public issue threads (tests/fixtures/real): every known issue is
named for its own logs and for nothing else; the same log parses the same under every line-prefix
style real tools use; multi-rank logs are read rank by rank. No host: parsing is pure."""

import re
from pathlib import Path

import pytest
import yaml

from servops.diagnose import CATEGORIES, evidence, known_issues, match, match_log, report
from servops.remote.logscan import normalise
from servops.remote.tracebacks import all_frames, scan

from diagnose_score import HELD_OUT, shown_finding

REAL = Path(__file__).resolve().parent / "fixtures" / "real"
FIXTURES = REAL.parent
MANIFEST = yaml.safe_load((REAL / "manifest.yml").read_text())
# the logs diagnose is held to one by one: all but the held-out blind batches, which are only
# scored (tests/test_diagnose_score.py), never fixed against
FIXED = [e for e in MANIFEST if e.get("batch") not in HELD_OUT]
HEALTHY = yaml.safe_load((REAL / "healthy" / "manifest.yml").read_text())
ISSUES = known_issues()
CATEGORY = {e["id"]: e["category"] for e in ISSUES}
# the real vLLM's own crashes, provoked on the lab (tests/test_vllm_e2e.py, README's section):
# each names its entry, and nothing else is named for it
MADE_HERE = {"vllm-lab-head-dim-16.log": "attention-backend-unsupported-head-dim",
             "vllm-lab-max-model-len.log": "context-length-exceeds-model",
             "vllm-lab-eager-amx-sigill.log": "cpu-amx-state-not-requested",
             "vllm-lab-eager-amx-sigill-faulthandler.log": "cpu-amx-state-not-requested",
             # the same crash where vLLM's monitor read the worker's exit status before it was reaped
             # ("exit code: None"): the log carries no signal, so no cause may be named
             "vllm-lab-eager-amx-exitcode-none.log": None}

# the real sglang 0.5.17's crashes on the lent H100 (the GPU kit, bench/evidence/seed-sm90/)
GPU_EVIDENCE = REAL.parent.parent.parent / "bench" / "evidence" / "seed-sm90"
MADE_ON_GPU = {"server-flashinfer-patch-alone.log": "dynamo-flashinfer-jit-loader"}


def findings(text):
    return scan(text)["findings"]


def hits_of(text):
    return [[h["id"] for h in match(f, ISSUES)] for f in findings(text)]


# -- the corpus itself -------------------------------------------------------------------------

def test_manifest_readme_and_logs_agree():
    # vllm-lab-*.log were made here by the real vLLM on the lab, not taken from a thread: the
    # README's own section says how each was made
    made_here = {p.name for p in REAL.glob("vllm-lab-*.log")}
    logs = {p.name for p in REAL.glob("*.log")} - made_here
    assert all(name in (REAL / "README.md").read_text() for name in made_here)
    listed = [e["file"] for e in MANIFEST]
    assert sorted(listed) == sorted(logs) and len(set(listed)) == len(listed)
    readme = (REAL / "README.md").read_text()
    for e in MANIFEST:
        assert e["file"] in readme and e["url"] in readme, e["file"]
        assert e["repo"] and e["number"] and e["title"] and e["cause"] and e["excerpt"]
        assert e["expect"] is None or e["expect"] in CATEGORY, e["file"]


def test_knowledge_base_covers_every_category_from_real_logs():
    assert len(ISSUES) >= 15
    assert {e["category"] for e in ISSUES} == set(CATEGORIES)
    expected = {e["expect"] for e in MANIFEST} | {v for v in MADE_HERE.values() if v} | set(MADE_ON_GPU.values())
    for entry in ISSUES:
        assert entry["id"] in expected, f"{entry['id']} has no real log of its own"
        assert entry.get("suggest") or entry.get("link"), f"{entry['id']} gives no next step"


@pytest.mark.parametrize("case", FIXED, ids=[e["file"][:-4] for e in FIXED])
def test_each_entry_matches_its_own_logs_and_nothing_else(case):
    text = (REAL / case["file"]).read_text()
    found = findings(text)
    assert found, "no failure found in a log that shows one"
    all_hits = match_log(found, ISSUES)[0]
    named = [hits[0]["id"] for hits in all_hits if hits]
    if case["expect"] is None:
        assert named == [], f"{case['file']} must match nothing, matched {named}"
        return
    assert named and named[0] == case["expect"], f"{case['file']}: {named}"
    want = CATEGORY[case["expect"]]
    for hits in all_hits:
        for h in hits:
            assert h["category"] == want, f"{h['id']} ({h['category']}) hit a {want} log: {case['file']}"


@pytest.mark.parametrize("case", [e for e in FIXED if e.get("root")], ids=[e["file"][:-4] for e in FIXED if e.get("root")])
def test_the_root_exception_is_the_line_the_thread_shows_without_its_prefixes(case):
    # anchored: a prefix, a quote mark or a colour code left in front of it is wrong
    found = findings((REAL / case["file"]).read_text())
    hit = shown_finding(found, match_log(found, ISSUES)[0])
    assert re.search(case["root"], hit["root_exception"]), hit["root_exception"]


@pytest.mark.parametrize("name,entry", sorted(MADE_HERE.items()))
def test_a_real_vllm_crash_made_on_the_lab_names_its_known_issue(name, entry):
    named = {i for hits in hits_of((REAL / name).read_text(errors="replace")) for i in hits[:1]}
    assert named == ({entry} if entry else set()), named


@pytest.mark.parametrize("name,entry", sorted(MADE_ON_GPU.items()))
def test_a_real_sglang_crash_made_on_the_gpu_names_its_known_issue(name, entry):
    named = {i for hits in hits_of((GPU_EVIDENCE / name).read_text(errors="replace")) for i in hits[:1]}
    assert named == {entry}, named


def test_every_lab_made_log_has_its_entry():
    assert set(MADE_HERE) == {p.name for p in REAL.glob("vllm-lab-*.log")}


def test_healthy_manifest_and_logs_agree():
    assert sorted(e["file"] for e in HEALTHY) == sorted(p.name for p in (REAL / "healthy").glob("*.log"))
    readme = (REAL / "README.md").read_text()
    assert all(e["file"] in readme and e["url"] in readme for e in HEALTHY)


@pytest.mark.parametrize("case", HEALTHY, ids=[e["file"][:-4] for e in HEALTHY])
def test_a_healthy_log_has_no_failure(case):
    assert findings((REAL / "healthy" / case["file"]).read_text()) == []


def test_the_double_and_the_hand_written_log_still_match():
    assert hits_of((FIXTURES / "double_piecewise_crash.log").read_text())[0][0] == "dynamo-get-cuda-version-subprocess"
    assert [h[0] for h in hits_of((FIXTURES / "sglang_tp8_oom_and_nccl.log").read_text())] == \
        ["cuda-oom-graph-capture", "nccl-watchdog-timeout"]


# -- what a finding says ---------------------------------------------------------------------------

def real(name):
    return (REAL / name).read_text()


def test_capture_oom_raised_in_the_runner_init_is_a_capture_oom():
    [f] = findings(real("sglang-5285-capture-oom.log"))
    assert f["root_exception"].startswith("Exception: Capture cuda graph failed: CUDA out of memory")
    assert [fr["func"] for fr in all_frames(f)][-2:] == ["init_cuda_graphs", "__init__"]
    assert "capture" not in [fr["func"] for fr in all_frames(f)]
    assert match(f, ISSUES)[0]["id"] == "cuda-oom-graph-capture"


def test_error_above_the_header_is_the_root_of_the_chain():
    [f] = findings(real("sglang-pr19573-dynamo-logger.log"))
    assert f["root_exception"].startswith("torch._dynamo.exc.Unsupported: Logger not supported")
    assert f["final_exception"] == "(exception line not in the log)"
    assert f["links"] == ["cause"] and len(all_frames(f)) == 6
    [f] = findings(real("sglang-pr10062-dynamo-non-tensor.log"))
    assert f["chain"][0]["type"] == "torch._dynamo.exc.Unsupported"
    assert "get_device_name" in evidence(f).text


def test_a_kernel_error_printed_above_a_traceback_is_the_root_cause():
    [f] = findings(real("sglang-5491-illegal-memory-access-eagle.log"))
    assert f["root_exception"].startswith("CUDA Error: an illegal memory access was encountered")
    assert f["ranks"] == ["TP0"] and [fr["func"] for fr in all_frames(f)][0] == "run_scheduler_process"


def test_cxx_abort_with_what_and_its_trace():
    [f] = findings(real("sglang-1693-nccl-watchdog-abort.log"))
    assert f["kind"] == "abort" and f["abort"]["type"] == "c10::DistBackendError"
    assert "Watchdog caught collective operation timeout" in f["abort"]["what"]
    assert f["abort"]["raised_from"].startswith("checkTimeout at ")
    assert f["abort"]["cxx_frames"][0].startswith("c10::Error::Error")


def test_fatal_python_error_with_its_threads():
    [f] = findings(real("sglang-10350-segfault-pd.log"))
    assert f["kind"] == "fatal" and f["root_exception"] == "Fatal Python error: Segmentation fault"
    assert len(f["fatal"]["threads"]) == 2 and match(f, ISSUES) == []


def test_zero_indent_frames_and_faulthandler_frames_parse():
    [f] = findings(real("flashinfer-924-illegal-memory-access-unindented.log"))
    assert [fr["func"] for fr in all_frames(f)] == ["run_scheduler_process", "decorate_context", "event_loop_normal",
                                                     "run_batch"]
    assert all_frames(f)[0]["code"] == "scheduler.event_loop_normal()"


def test_nccl_watchdog_of_an_illegal_memory_access_is_not_a_timeout():
    [hits] = hits_of(real("vllm-20170-illegal-memory-access.log"))
    assert hits == ["cuda-illegal-memory-access"]


def test_a_what_line_without_its_terminate_line_is_a_cxx_abort():
    [f] = findings(real("sglang-8296-watchdog-what-first-line.log"))
    assert f["kind"] == "abort" and f["abort"]["type"] == ""
    assert f["root_exception"].startswith("[PG ID 2 PG GUID 3 Rank 1] Process group watchdog thread terminated")
    assert f["abort"]["raised_from"].startswith("c10_cuda_check_implementation at ")
    assert match(f, ISSUES)[0]["id"] == "cuda-illegal-memory-access"


def test_an_error_line_that_repeats_the_exception_is_not_an_earlier_cause():
    # asyncio's "Task exception was never retrieved" repr, wrapped: its second line is a bind error
    [f] = findings(real("exo-827-uvloop-bind-wrapped-inline.log"))
    assert f["root_exception"].startswith("OSError: [Errno 98] error while attempting to bind")
    # a kernel's device-side assert above the traceback still is the earlier cause
    [f] = findings(real("sglang-271-device-assert-above-traceback.log"))
    assert "index out of bounds" in f["root_exception"]


def test_an_exception_group_is_reported_by_its_sub_exception():
    # Python 3.11+ (anyio/starlette in the OpenAI servers): the group wraps what failed
    [f] = findings(real("vllm-6689-exception-group-gutters.log"))
    assert f["root_exception"] == "ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)"
    assert len(all_frames(f)) == 5  # the group's frames and the sub-exception's, one failure
    text = "\n".join(real("vllm-6689-exception-group-gutters.log").splitlines()[:15] + [
        "    | vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        "    +------------------------------------"])
    [f] = findings(text)
    assert f["root_exception"] == "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."
    assert f["final_exception"].startswith("ExceptionGroup: ") and f["links"] == ["group"]


def test_a_double_spaced_paste_reads_like_the_log():
    [f] = findings(real("transformerlab-pr381-ninja-missing-double-spaced.log"))[:1]
    assert f["root_exception"] == "FileNotFoundError: [Errno 2] No such file or directory: 'ninja'"
    assert [fr["func"] for fr in all_frames(f)][:2] == ["build", "run_ninja"]
    for name in BASE_LOGS:
        text = (FIXTURES / name).read_text()
        assert canonical(text.replace("\n", "\n\n")) == canonical(text), name


def test_blank_lines_between_frames_also_stand_above_the_exception_line():
    # TGI prints the shard's stderr with a blank line after every frame and after the last one
    [f] = findings(real("tgi-686-v100-sharded-flash-attention.log"))
    assert f["root_exception"].startswith("NotImplementedError: Sharded Llama requires Flash Attention")
    assert len(all_frames(f)) == 2
    # without blank lines between the frames, a blank line ends the traceback as before
    text = 'Traceback (most recent call last):\n  File "a.py", line 1, in f\n    g()\n\nValueError: later\n'
    assert findings(text)[0]["root_exception"] == "(exception line not in the log)"


def test_a_message_quoted_whole_is_read_without_its_quotes():
    [f] = findings(real("oobabooga-2926-quoted-cuda-error-209.log"))
    assert f["root_exception"].startswith("CUDA error 209 at C:")
    [f] = findings(real("sglang-docs-13-inline-code-triton-shared-memory.log"))
    assert f["root_exception"].endswith("`num_stages` may help.")
    assert match(f, ISSUES)[0]["id"] == "triton-out-of-resources"


def test_a_launcher_reporting_a_child_killed_by_a_signal_is_a_failure_but_a_stop_is_not():
    [f] = findings(real("tgi-1627-shard-signal-4.log"))
    assert f["root_exception"].startswith("Shard process was signaled to shutdown with signal 4")
    [f] = findings(real("trtllm-1700-mpirun-rank-killed.log"))
    assert "exited on signal 9 (Killed)" in f["root_exception"]
    for sig in (2, 15):
        assert findings(f"mpirun noticed that process rank 1 with PID 7 on node n exited on signal {sig} (Terminated).") == []


def test_a_json_log_line_is_read_as_its_message_and_level():
    [f] = findings(real("tgi-3317-json-router-request-failed.log"))
    assert f["root_exception"].startswith("Request failed during generation: Server error: error trying to connect")
    docker = '{"log":"\\u001b[36m(Worker pid=6)\\u001b[0m RuntimeError: CUDA error: an illegal memory access was encountered\\n","stream":"stderr"}'
    [f] = findings(docker)
    assert f["root_exception"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert findings('{"level":"INFO","message":"Shard ready in 12.3s","target":"text_generation_launcher"}') == []


def test_an_mpi_runtime_error_above_a_traceback_is_its_cause():
    [f] = findings(real("trtllm-2476-prte-bad-parameter.log"))
    assert "PRTE ERROR: Bad parameter" in f["root_exception"]


# -- prefixes ----------------------------------------------------------------------------------

PREFIX_STYLES = {
    "vllm-worker": lambda i: "(Worker_TP2 pid=99) ERROR 06-26 23:10:17 [multiproc_executor.py:949] ",
    "vllm-enginecore": lambda i: "(EngineCore_DP0 pid=268) ",
    "ray": lambda i: "(SGLangEngine pid=952, ip=10.0.0.5) ",
    "ray-colour": lambda i: "\x1b[36m(SGLangEngine pid=952, ip=10.0.0.5)\x1b[0m ",
    "kubernetes-cri": lambda i: f"2025-06-01T10:00:{i % 60:02d}.123456789+08:00 stdout F ",
    "sglang": lambda i: "[2025-06-01 10:00:00 TP3] ",
    "torchrun": lambda i: "[rank3]: ",
    "github-actions": lambda i: f"2025-10-09T04:13:{i % 60:02d}.6371779Z ",
    "docker-compose": lambda i: "sglang-1  | ",
    "journald": lambda i: "Aug 19 18:34:27 gpu01 sglang[8727]: ",
    "nested": lambda i: "(APIServer pid=1) (EngineCore_DP0 pid=2) (Worker_TP0 pid=3) ERROR 10-30 17:32:00 "
                        "[v1/executor/multiproc_executor.py:671] ",
    "unknown-tag": lambda i: "[VLLM LOG] (Worker_TP3 pid=51793) ERROR 02-25 02:56:51 [multiproc_executor.py:783] ",
    # prefixes no rule knows: learned from the frame lines
    "torchserve": lambda i: f"2024-11-18T16:43:45,{400 + i} [INFO ] W-9000-model_1.0-stdout MODEL_LOG - ",
    "fastchat": lambda i: f"2024-01-22 14:32:{i % 60:02d} | ERROR | stderr | ",
    # logging's "%(levelname)s (%(name)s): " format
    "level-logger": lambda i: "ERROR (sglang.srt.managers.scheduler):  ",
}
BASE_LOGS = ["double_piecewise_crash.log", "real/sglang-5285-capture-oom.log", "real/sglang-4289-nccl-system-error.log",
             "real/sglang-1693-nccl-watchdog-abort.log", "real/sglang-pr10062-dynamo-non-tensor.log",
             "real/vllm-11617-address-in-use.log", "real/helion-470-triton-shared-memory.log",
             "real/sglang-10350-segfault-pd.log", "real/sglang-23386-dynamo-get-cuda-version.log",
             "real/flashinfer-1166-ninja-build-failed.log"]


def canonical(text):
    """A log's findings without what prefixes legitimately change (ranks, line numbers)."""
    out = []
    for f in findings(text):
        out.append((f["kind"], f["root_exception"], f["final_exception"], f["occurrences"],
                    [(fr["path"], fr["line"], fr["func"], fr["code"]) for fr in all_frames(f)],
                    [e["text"] for e in f["errors"]],
                    [(e["type"], e["message"], tuple(e["details"])) for e in f["chain"]],
                    (f["abort"] or {}).get("what"), (f["fatal"] or {}).get("message"),
                    [h["id"] for h in match(f, ISSUES)]))
    return out


@pytest.mark.parametrize("style", sorted(PREFIX_STYLES))
def test_the_same_log_with_each_prefix_style_gives_identical_findings(style):
    prefix = PREFIX_STYLES[style]
    for name in BASE_LOGS:
        text = (FIXTURES / name).read_text()
        prefixed = "".join(prefix(i) + line for i, line in enumerate(text.splitlines(keepends=True)))
        assert canonical(prefixed) == canonical(text), f"{style}: {name}"


def test_crlf_and_caret_m_line_ends():
    text = real("sglang-5285-capture-oom.log")
    assert canonical(text.replace("\n", "\r\n")) == canonical(text)
    assert canonical(text.replace("\n", "^M\n")) == canonical(text)


def test_prefixes_are_stripped_and_the_writer_named():
    lines = normalise("(Worker_TP2 pid=99) ERROR 06-26 23:10:17 [multiproc_executor.py:949]   File \"/x.py\", line 3, in f\n"
                      "[2025-03-20 00:44:38 DP1 TP3] Scheduler hit an exception: Traceback (most recent call last):\n"
                      "  File \"/y.py\", line 1, in g\n"
                      "(SGLangEngine pid=952, ip=10.0.0.1) [2025-11-06 01:16:21 TP0] Load weight begin\n"
                      "2025-06-01T10:00:00.1+08:00 stdout F [rank4]:[E626 23:10:17.921506443 ProcessGroupNCCL.cpp:1896] boom\n")
    assert [(ln.text, ln.rank) for ln in lines] == [
        ('  File "/x.py", line 3, in f', "TP2"),
        ("Scheduler hit an exception: Traceback (most recent call last):", "DP1 TP3"),
        ('  File "/y.py", line 1, in g', "DP1 TP3"),
        ("Load weight begin", "TP0"),
        ("boom", "rank4")]


# -- ranks -------------------------------------------------------------------------------------

def test_the_same_failure_on_eight_ranks_is_one_finding():
    body = real("sglang-5285-capture-oom.log").splitlines(keepends=True)
    order = [3, 0, 1, 2, 4, 5, 6, 7]
    # the ranks' lines interleave, as eight processes writing to one file do
    text = "".join(f"(Worker_TP{r} pid={100 + r}) ERROR 06-26 23:10:17 [multiproc_executor.py:949] {line}"
                   for line in body for r in order)
    [f] = findings(text)
    assert f["ranks"] == [f"TP{r}" for r in order] and f["occurrences"] == 8
    assert f["root_exception"].startswith("Exception: Capture cuda graph failed: CUDA out of memory")
    assert len(all_frames(f)) == 8


def test_interleaved_ranks_with_different_failures_are_read_apart():
    a = real("sglang-5285-capture-oom.log").splitlines(keepends=True)
    b = real("sglang-4289-nccl-system-error.log").splitlines(keepends=True)
    mixed = []
    for i in range(max(len(a), len(b))):
        if i < len(a):
            mixed.append("(Worker_TP0 pid=1) " + a[i])
        if i < len(b):
            mixed.append("(Worker_TP1 pid=2) " + b[i])
    got = {tuple(f["ranks"]): f["root_exception"] for f in findings("".join(mixed))}
    assert got[("TP0",)].startswith("Exception: Capture cuda graph failed")
    assert got[("TP1",)].startswith("RuntimeError: NCCL error: unhandled system error")


def test_clean_logs_and_warnings_are_not_failures():
    assert findings("[2025-01-01 00:00:00] server started\n[2025-01-01 00:00:01] The server is fired up and ready to roll!\n") == []
    warn = ("/usr/lib/python3.12/site-packages/torch/_dynamo/variables/functions.py:1575: UserWarning: Dynamo detected\n"
            "This call originates from:\n"
            '  File "/x/flashinfer/jit/cpp_ext.py", line 91, in is_cuda_version_at_least\n'
            "    return get_cuda_version() >= Version(version_str)\n\n  torch._dynamo.utils.warn_once(msg)\n"
            "WARNING 01-28 03:21:01 [x.py:1] ValueError: not fatal, only logged\n"
            "WARNING 01-28 03:21:02 [registry.py:1] Traceback (most recent call last):\n"
            'WARNING 01-28 03:21:02 [registry.py:1]   File "/x/plugin.py", line 3, in load\n'
            "WARNING 01-28 03:21:02 [registry.py:1] ModuleNotFoundError: No module named 'optional_plugin'\n")
    # (a server that started after them: logged and carried on; without one they are signs of a failure)
    assert findings(warn + "INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)\n") == []
    [sign] = findings(warn)
    assert sign["kind"] == "signs" and sign["root_exception"] == "ValueError: not fatal, only logged"


def test_the_engine_core_wrapper_is_not_named_beside_the_cause_the_log_shows():
    # a worker's illegal memory access, then vLLM's "EngineCore failed to start": the second
    # finding is the report of the first, not a second known issue
    from io import StringIO

    from rich.console import Console

    name = "vllm-windows-72-illegal-memory-access.log"
    found = findings((REAL / name).read_text())
    assert [h[0]["id"] if h else None for h in (match(f, ISSUES) for f in found)] == \
        ["cuda-illegal-memory-access", "vllm-engine-core-died"]
    hits, reported = match_log(found, ISSUES)
    assert [h[0]["id"] if h else None for h in hits] == ["cuda-illegal-memory-access", None]
    assert [r and r["id"] for r in reported] == [None, "vllm-engine-core-died"]
    out = StringIO()
    rep = report(name, {"scan": scan((REAL / name).read_text()), "source": name, "offline": True}, ISSUES,
                 con=Console(file=out, width=200))
    assert rep.verdict == "matched: cuda-illegal-memory-access (illegal-memory-access); action: change flag --attention-backend"
    assert "reports the failure another finding of this log names (vllm-engine-core-died is named only" in out.getvalue()
    # where the log shows nothing else, the wrapper is still named
    only = findings((REAL / "vllm-17939-engine-core-init-wrapper.log").read_text())
    assert [h[0]["id"] for h in match_log(only, ISSUES)[0] if h] == ["vllm-engine-core-died"]
