"""diagnose that knows when it does not know (issue 47): a category from the evidence shown only
above the threshold held-out logs chose, else "uncategorised" with its leaning; the boilerplate of
every CUDA/HIP error weighs nothing; the first real error wins over a wrapper's epitaph; failure
signs without an exception word; roots a terminal wrapped or a table cell split joined; the next step worded for the
host's release. Each shape on a real log of it from a thread no earlier fixture used
(tests/fixtures/real, batch h47-shapes), but the issue 45 crash, assembled from the real sglang
0.5.17 wheel's source lines (no log of it is public: tests/fixtures/sglang-0.5.17-dynamo-gcd-import-constructed.log).
No host, but the last test (the sshd lab)."""

import json
import re
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from conftest import run_invoke
from servops.categorize import load_model
from servops.diagnose import evidence, finding_features, known_issues, match_log, report, scan_local, shown_finding
from servops.remote.logscan import MAX_LINE, continue_cell, join_table_cells, normalise
from servops.remote.tracebacks import scan

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REAL = FIXTURES / "real"
GCD_IMPORT = FIXTURES / "sglang-0.5.17-dynamo-gcd-import-constructed.log"
ISSUES = known_issues()


def real(name: str) -> str:
    return (REAL / name).read_text()


def diagnosed(text: str):
    """(the report, its printed text, its JSON rows) of a log, offline."""
    out = StringIO()
    rep = report("x.log", scan_local(text, "x.log"), ISSUES, con=Console(file=out, width=300))
    rows = StringIO()
    report("x.log", scan_local(text, "x.log"), ISSUES, as_json=True, con=Console(file=rows, width=100000))
    return rep, out.getvalue(), [json.loads(line) for line in rows.getvalue().splitlines()]


def named(text: str) -> list[str]:
    return [hits[0]["id"] for hits in match_log(scan(text)["findings"], ISSUES)[0] if hits]


# -- 1. calibrated, or nothing ------------------------------------------------------------------------

def test_below_the_threshold_a_failure_is_uncategorised_with_what_it_leans_to():
    threshold = load_model()["threshold"]
    assert 0.3 < threshold < 1
    # the KV cache too small for max_seq_len, said only by "# GPU blocks: 229": the evidence leans
    # elsewhere, weakly; the report says what is known and that it is not enough
    rep, out, [row] = diagnosed(real("vllm-2418-max-seq-len-exceeds-kv-cache.log"))
    assert not rep.matched and not rep.category.shown and rep.category.confidence < threshold
    assert re.search(r"^no known issue matched — uncategorised \(leans [a-z-]+, 0\.\d\d\) — ", rep.verdict)
    assert rep.action is None and "action:" not in rep.verdict and rep.exit_code == 1
    assert "category: uncategorised (leans " in out and "too weak to name" in out
    assert row["category"] is None and row["category_from"] == "uncategorised" and row["leans"] == rep.category.name
    assert row["action"] is None and row["verdict"] == "unexplained"


def test_a_generic_exception_class_names_no_category_by_itself():
    # (the class words of the real logs carry no feature: what the message says decides)
    for name in ("sglang-28702-committed-kv-freed.log", "vllm-19461-cpu-image-v1-not-supported.log"):
        feats = set().union(*(finding_features(f)[0] for f in scan(real(name))["findings"]))
        assert not {"exc:assertionerror", "w:assertionerror", "exc:notimplementederror", "w:notimplementederror"} & feats
    for bare in ("AssertionError", "NotImplementedError", "ValueError", "ShardFailed"):
        rep, _, _ = diagnosed(f'Traceback (most recent call last):\n  File "/srv/app.py", line 3, in f\n    g()\n{bare}\n')
        assert rep.exit_code == 1 and "uncategorised" in rep.verdict, (bare, rep.verdict)


# -- 2. boilerplate weighs nothing --------------------------------------------------------------------

def test_cuda_and_hip_boilerplate_is_no_evidence_the_specific_error_decides():
    [f] = [f for f in scan(real("vllm-10416-mllama-stream-capture.log"))["findings"]][:1]
    assert "CUDA_LAUNCH_BLOCKING" not in evidence(f).text and "device-side assertions" not in evidence(f).text
    # a capture the stream refused is a graph-capture failure, not an illegal memory access
    assert named(real("vllm-10416-mllama-stream-capture.log")) == ["cuda-graph-capture-unsupported-op"]
    # HIP's "invalid device function" is ROCm's "no kernel image"
    for name in ("rocm-4386-hip-invalid-device-function-7900xt.log", "rocm-4447-vllm-v0-hip-invalid-device-function.log"):
        assert named(real(name))[:1] == ["cuda-no-kernel-image"], name


# -- 3. the first real error wins over a wrapper's epitaph -------------------------------------------

def test_a_warning_that_carries_a_missing_library_is_the_root_of_the_failure_after_it():
    rep, out, rows = diagnosed(real("rocm-5668-warning-libcudart-importerror.log"))
    assert rep.root == "ImportError: libcudart.so.12: cannot open shared object file: No such file or directory"
    assert rep.matched[0] == ("extension-built-for-another-torch", "install")
    assert "chain: ImportError -> (logged earlier, then)" in out or rows[0]["root_exception"] == rep.root


def test_a_ptxas_failure_is_the_root_though_the_executors_epitaph_is_printed_first():
    rep, _, _ = diagnosed(real("vllm-16336-b200-triton-ptxas-fatal-signal.log"))
    assert rep.root.startswith("subprocess.CalledProcessError: Command '['/opt/vllm_env/lib/python3.12/site-packages/"
                               "triton/backends/nvidia/bin/ptxas'")
    assert rep.matched[0] == ("cuda-toolchain-too-old", "arch-unsupported")


def test_the_wrappers_known_issue_is_named_as_then_of_the_real_error_before_it():
    # a router's own error (no known issue names it), then vLLM's engine-core wrapper: the error is
    # the root and its category, the wrapper's known issue its "then"
    text = real("tgi-1534-router-unable-to-parse-tokenizer-config.log") + real("vllm-19002-engine-core-failed-unprefixed.log")
    rep, out, rows = diagnosed(text)
    assert not rep.matched and rep.root.startswith("Unable to parse tokenizer config")
    assert rep.category.name == "model-load" and rep.category.shown
    assert "then: vllm-engine-core-died (engine-death): RuntimeError: Engine core initialization failed" in out
    assert rows[0]["then"][0].startswith("vllm-engine-core-died (engine-death): RuntimeError: Engine core")


# -- 4. failure signs without an exception word; advice is no failure ---------------------------------

def test_a_replica_the_health_check_gave_up_on_is_a_failure_though_the_log_goes_on_serving():
    rep, _, _ = diagnosed(real("ray-54070-serve-replica-health-check-unhealthy.log"))
    assert rep.matched == [("replica-health-check-failed", "engine-death")] and rep.exit_code == 1


@pytest.mark.parametrize("name,category", [("tgi-1534-router-unable-to-parse-tokenizer-config.log", "model-load"),
                                           ("sglang-18299-gateway-failed-to-load-tokenizer.log", "model-load"),
                                           ("comfy-wavespeed-33-lone-dynamo-hint.log", None)])
def test_a_router_that_cannot_read_the_tokenizer_or_a_lone_dynamo_hint_is_a_failure(name, category):
    rep, _, _ = diagnosed(real(name))
    assert rep.findings and rep.exit_code == 1
    if category:
        assert rep.category.name == category and rep.category.shown


def test_advice_is_no_failure():
    # vLLM's INFO at every capture ("If you are running out of memory, consider ..."): not the root
    # of the benchmark's traceback after it; the tokenizer's length warning alone: no failure at all
    rep, _, _ = diagnosed(real("vllm-pr3175-benchmark-advice-then-traceback.log"))
    assert "running out of memory" not in rep.root and rep.exit_code == 1
    rep, _, _ = diagnosed((REAL / "healthy" / "omnidrive-13-token-indices-warning.log").read_text())
    assert (rep.verdict, rep.exit_code) == ("no errors found", 0)


# -- 5. roots a terminal wrapped are joined -----------------------------------------------------------

def _wrapped(text: str, width: int) -> str:
    """The log as a terminal `width` columns wide shows it, copied: every longer line cut into rows
    of exactly that many characters."""
    return "".join("\n".join(line[k:k + width] for k in range(0, max(len(line), 1), width)) + "\n"
                   for line in text.splitlines())


SEED = FIXTURES.parent.parent / "bench" / "evidence" / "seed-sm90" / "server-flashinfer-patch-alone.log"  # the H100's own


@pytest.mark.parametrize("path,width", [(REAL / "rocm-5668-warning-libcudart-importerror.log", 80),
                                        (REAL / "rocm-5668-warning-libcudart-importerror.log", 120),
                                        (REAL / "vllm-16336-b200-triton-ptxas-fatal-signal.log", 80),
                                        (REAL / "vllm-16336-b200-triton-ptxas-fatal-signal.log", 120),
                                        (REAL / "vllm-16336-b200-triton-ptxas-fatal-signal.log", 160),
                                        (SEED, 80), (SEED, 120), (SEED, 160)],
                         ids=lambda v: v.name[:24] if isinstance(v, Path) else str(v))
def test_a_log_a_terminal_wrapped_reads_as_the_log(path, width):
    text = path.read_text()
    # (the log does wrap at that width: rows of exactly that many characters, more than one)
    assert sum(len(line) > width for line in text.splitlines()) >= 2
    found, wrapped = scan(text)["findings"], scan(_wrapped(text, width))["findings"]
    assert [f["root_exception"] for f in wrapped] == [f["root_exception"] for f in found]
    assert named(_wrapped(text, width)) == named(text)


# -- 5. a table cell its printer continued on the rows under it is joined ------------------------------

TRITON_129 = "trtllm-backend-129-triton-status-cell-cut-mid-word.log"  # the cell cut at its width, mid-word
TRITON_33 = "trtllm-backend-33-triton-status-cell-cut-at-space.log"    # cut after "Assertion failed: "
# the message as the same log's model_lifecycle.cc E line carries it whole (tensorrtllm_backend#129)
TRT_ASSERT = ("UNAVAILABLE: Internal: unexpected error when creating modelInstanceState: [TensorRT-LLM][ERROR] Assertion "
              "failed: mpiSize == tp * pp (/app/tensorrt_llm/cpp/tensorrt_llm/runtime/worldConfig.cpp:80)")


@pytest.mark.parametrize("name", [TRITON_129, TRITON_33])
def test_an_error_a_status_table_split_over_rows_is_read_whole(name):
    # tritonserver's model table: the status cell of the failed model printed over several rows,
    # the model and version cells of those rows blank
    rep, out, _ = diagnosed(real(name))
    assert rep.root == "tensorrt_llm | 1 | " + TRT_ASSERT
    assert rep.matched[0][0] == "mpi-world-size-mismatch" and rep.exit_code == 1
    assert "root cause: tensorrt_llm | 1 | " + TRT_ASSERT in out


def test_the_real_rows_of_a_table_stay_rows_and_a_cells_own_lines_stay_lines():
    # the READY rows are rows of their own (their other cells are not blank); the stack frame under
    # the message is a line of the cell's own text (its first word would have fitted on the row
    # above), read as a line of its own with its cut-off end joined to it
    lines = [ln.text for ln in normalise(real(TRITON_129))]
    assert "postprocessing | 1       | READY" in lines[4] and "preprocessing  | 1       | READY" in lines[5]
    assert lines[6] == "tensorrt_llm | 1 | " + TRT_ASSERT
    assert lines[7] == ("3       0x7f06d283e9e2 /opt/tritonserver/backends/tensorrtllm/libtriton_tensorrtllm.so(+0x569e2) "
                        "[0x7f06d283e9e2]")
    assert len(lines) == 8 and [ln.no for ln in normalise(real(TRITON_129))][6:] == [7, 10]


def _cell(text, width):
    """A cell as a table draws it between its borders: one space of padding each side."""
    return " " + text.ljust(width) + " "


def test_a_cell_continues_where_it_filled_its_column_or_the_next_word_could_not_fit():
    # cut at the column's width (Triton's printer): joined as it stands, mid-word or not
    assert continue_cell(_cell("modelInstanceState: [TensorRT-LLM][E", 36), _cell("RROR] Assertion", 36)) == \
        "modelInstanceState: [TensorRT-LLM][ERROR] Assertion"
    assert continue_cell(_cell("mpiSize == tp *", 15), _cell(" pp (x.cpp:80)", 15)) == "mpiSize == tp * pp (x.cpp:80)"
    # wrapped at a word (rich, textwrap): the next word did not fit, so a space between
    assert continue_cell(_cell("Assertion failed:", 20), _cell("mpiSize == tp * pp", 20)) == "Assertion failed: mpiSize == tp * pp"
    # the next row's first word would have fitted, or it is indented: a line of the cell's own text
    assert continue_cell(_cell("worldConfig.cpp:80)", 40), _cell("1       0x7f923a86a645 /opt/x.so", 40)) is None
    assert continue_cell(_cell("Traceback (most recent call last):", 40), _cell('  File "/x.py", line 1', 40)) is None
    # blank cells continue nothing
    assert continue_cell(_cell("", 10), _cell("text", 10)) is None and continue_cell(_cell("text", 4), _cell("", 4)) is None


def test_only_rows_whose_other_cells_are_blank_and_whose_borders_match_are_joined():
    table = ["+----+----------+",
             "| m1 | a long   |",
             "|    | error    |",   # "error" did not fit after "a long": one text
             "| m2 | READY    |",   # a row of its own
             "|    |          |",
             "|    | next     |",   # under a blank row: nothing to continue
             "| m3 | cut-off- |",
             "| x  | here     |",   # its other cell is not blank: a row of its own
             "| m4 | cut-off- |",
             "|      | here   |",   # its borders stand elsewhere: another table
             "+----+----------+"]
    lines, numbers = join_table_cells(table)
    assert lines == [table[0], "| m1 | a long error"] + table[3:]
    assert numbers == [1, 2] + list(range(4, 12))
    # a chain goes on over several rows, in the one column it started in; rich's box borders too
    box = ["\u2502" + _cell(a, 6) + "\u2502" + _cell(b, 19) + "\u2502"
           for a, b in [("worker", "RuntimeError: CUDA"), ("", "error: an illegal"), ("", "memory access"), ("w2", "ok")]]
    lines, numbers = join_table_cells(box)
    assert lines[0] == "\u2502 worker \u2502 RuntimeError: CUDA error: an illegal memory access" and numbers == [1, 4]
    assert [ln.text for ln in normalise("\n".join(box))][0] == "worker \u2502 RuntimeError: CUDA error: an illegal memory access"
    # a box of one cell (a rich panel, a traceback frame) is no table: nothing is joined
    panel = ["\u2502 RuntimeError: a message that goes \u2502", "\u2502 on here                           \u2502"]
    assert join_table_cells(panel)[0] == panel
    # a continuation in another column than the one the chain started in ends it
    two = ["| a | long text |  |", "|   | more      |  |", "|   |           | x |"]
    assert join_table_cells(two)[0][1:] == ["|   |           | x |"]


def test_a_cell_continued_without_end_is_joined_in_bounded_pieces():
    rows = ["| m | " + "x" * 20 + " |"] + ["|   | " + "y" * 20 + " |"] * 5000
    lines, _ = join_table_cells(rows)
    assert all(len(line) <= MAX_LINE + 200 for line in lines) and 5 <= len(lines) <= 10


def test_a_table_as_wide_as_the_terminal_that_wrapped_the_log_is_not_unwrapped_row_into_row():
    # a log wrapped at 120 columns and a table Triton drew 120 wide in it: the table's rows are
    # drawn rows, not wrapped ones; the status cell is joined
    width, status = 120, "UNAVAILABLE: Internal: " + "x" * 200 + " Assertion failed: mpiSize == tp * pp"
    share = width - 21  # the name cell 4 wide, the version's 7, each cell's padding and the four borders

    def row(a, b, c):
        return "| " + a.ljust(4) + " | " + b.ljust(7) + " | " + c.ljust(share) + " |"
    rule = "+" + "-" * 6 + "+" + "-" * 9 + "+" + "-" * (share + 2) + "+"
    table = [rule, row("Name", "Version", "Status"), rule, row("m", "1", status[:share])]
    table += [row("", "", status[k:k + share]) for k in range(share, len(status), share)] + [rule]
    long = "the server starts and says a great deal about its configuration: " + "abcdefgh " * 30
    log = "\n".join([long[k:k + width] for k in range(0, len(long), width)] * 3 + table) + "\n"
    assert {len(line) for line in table} == {width}
    lines = [ln.text.rstrip() for ln in normalise(log)]
    assert "m | 1 | " + status in lines and lines.count(long.rstrip()) == 3


# -- 7. actions follow the host's release ---------------------------------------------------------------

def test_the_issue_45_crash_is_a_dynamo_break_whose_step_is_the_audit():
    findings = scan(GCD_IMPORT.read_text())["findings"]
    f = shown_finding(findings, match_log(findings, ISSUES)[0])
    assert f["root_exception"] == "torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped"
    assert f["chain"][0]["skipped_call"] == "importlib._bootstrap._gcd_import"
    rep, _, _ = diagnosed(GCD_IMPORT.read_text())
    assert rep.matched[0] == ("dynamo-unsupported", "dynamo-trace")
    assert rep.action.startswith("run invoke audit --fix --variant <variant>; or change flag --cuda-graph-backend-prefill "
                                 "breakable (or disabled) on sglang >=0.5.14,<0.5.22;")


def test_on_a_host_with_sglang_the_step_names_its_release_and_the_failed_variant(lab, sglang_venvs):
    venv = sglang_venvs("0.5.21")["venv"]
    inv = lab.inventory(group_vars={"venv": str(venv)})
    release = lab.tmp / "deploy-lab1" / "releases" / "20261207T000000Z-piecewise-fp8"
    release.mkdir(parents=True)
    (release / "release.json").write_text(json.dumps({"status": "failed", "variant": "piecewise-fp8"}))
    (release / "server.log").write_text(GCD_IMPORT.read_text())
    res = run_invoke("diagnose", inventory=inv)
    assert res.returncode == 1, res.stderr
    assert res.stdout.strip().splitlines()[-1] == (
        "matched: dynamo-unsupported (dynamo-trace); action: run invoke audit --fix --variant piecewise-fp8; "
        "or change flag --cuda-graph-backend-prefill breakable (or disabled) (sglang 0.5.21)")
    # the frames resolve in the host's own sglang: the kernel selector's import is there
    assert "sglang/kernels/spec.py:260 in load  (sglang 0.5.21" in res.stdout
