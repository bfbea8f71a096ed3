"""diagnose on the shapes real logs take that once hid their failure (issue 22), each from a real
public log (tests/fixtures/real, sources in its README): an exception inside prose, a bare last
word, compiler output without a traceback, ptxas text in an exception's continuation, torch.compile's
own errors, IPython tracebacks, terminal-wrapped lines; a log that shows the server died is never
reported like a healthy one; knowledge-base entries that only name what died count last."""

from io import StringIO
from pathlib import Path

import yaml
from rich.console import Console

from servops.diagnose import evidence, known_issues, match, report, scan_local
from servops.remote.tracebacks import all_frames, scan

REAL = Path(__file__).resolve().parent / "fixtures" / "real"
HEALTHY = yaml.safe_load((REAL / "healthy" / "manifest.yml").read_text())
ISSUES = known_issues()


def real(name):
    return (REAL / name).read_text()


def findings(text):
    return scan(text)["findings"]


def ids(f):
    return [h["id"] for h in match(f, ISSUES)]


def verdict(name, text=None):
    """The verdict line and exit code `invoke diagnose --offline` gives for a log."""
    out = StringIO()
    rep = report(name, scan_local(real(name) if text is None else text, name), ISSUES,
                 con=Console(file=out, width=300, color_system=None))
    return rep.verdict, rep.exit_code, out.getvalue()


# -- 1. an exception written inside a sentence ---------------------------------------------------

def test_exceptions_inside_the_reporters_sentences_are_exceptions():
    # `switch to SGLANG to chat，show logs is importlib...Error: ...` (a full-width comma before it)
    first, second = findings(real("llamafactory-8544-prose-exceptions.log"))
    assert first["chain"][0]["type"] == "importlib.metadata.PackageNotFoundError"
    assert first["chain"][0]["context"] == "switch to SGLANG to chat，show logs is"
    assert second["root_exception"] == "RuntimeError: SGLang server initialization failed: name 'launch_server_cmd' is not defined."


def test_an_exception_quoted_or_in_bold_inside_a_sentence_loses_its_closing_mark():
    [f] = findings(real("vllm-6783-prose-quoted-engine-process-failed.log"))
    assert f["root_exception"] == "RuntimeError: Engine process failed to start. See stack trace for the root cause."
    [f] = findings(real("vllm-730-bold-markdown-bf16-v100.log"))
    assert f["root_exception"].endswith("has compute capability 7.0.") and ids(f) == ["kernel-arch-not-supported"]


def test_an_exception_after_a_message_on_its_line_keeps_the_message_as_context():
    [f] = findings(real("pytorch-174161-aoti-nvcc-ptxas-prose-inductorerror.log"))
    assert f["chain"][-1]["type"] == "InductorError" and f["chain"][-1]["context"] == "aot_compile failed:"


# -- 2. a bare last word, no exception class, no level --------------------------------------------

def test_a_shell_reporting_illegal_instruction_is_the_failure():
    [f] = findings(real("ipex-llm-12960-bare-illegal-instruction.log"))
    assert f["root_exception"] == "Illegal instruction" and ids(f) == ["cpu-illegal-instruction"]
    [f] = findings(real("ipex-llm-12922-illegal-instruction-script.log"))
    assert ids(f) == ["cpu-illegal-instruction"]
    # CUDA's own "illegal instruction" is the GPU's, not the CPU's: a kernel built for another
    # architecture variant (flashinfer#2065: FP4 MoE on GB10's SM121)
    [f] = findings("RuntimeError: CUDA error: an illegal instruction was encountered\n")
    assert ids(f) == ["kernel-arch-not-supported"]


def test_a_launchers_error_line_is_a_failure():
    [f] = findings('docker: Error response from daemon: could not select device driver "" with capabilities: [[gpu]].\n')
    assert f["errors"][0]["class"] == "message"
    assert findings("Error in sys.excepthook handled\nINFO: errors: 0\nINFO: Application startup complete.\n") == []


def test_bare_statements_of_the_hub_and_of_the_gpu_are_failures():
    [f] = findings(real("llm-vm-423-bare-gated-repo-line.log"))
    assert ids(f) == ["hub-access-denied"]
    [f] = findings(real("vllm-1284-p100-bare-line-then-runtimeerror.log"))
    assert f["root_exception"].startswith("Bfloat16 is only supported on GPUs with compute capability")
    assert ids(f) == ["kernel-arch-not-supported"]


def test_a_thread_limit_in_a_padded_glog_line_is_the_root_of_the_raylet_error():
    [f] = findings(real("vllm-6295-ray-pthread-create-glog-padding.log"))
    assert f["root_exception"] == "pthread_create failed: Resource temporarily unavailable"
    assert ids(f) == ["process-thread-limit"]


def test_an_extension_that_cannot_load_is_a_failure_even_logged_as_a_warning():
    [f] = findings(real("vllm-5501-warning-level-undefined-symbol.log"))
    assert ids(f) == ["extension-built-for-another-torch"]
    # other warnings stay quiet
    assert findings("WARNING 06-13 11:42:20 _custom_ops.py:11] Failed to import from vllm._C with "
                    "ImportError('libcudart.so.12: cannot open shared object file')\n"
                    "INFO 06-13 11:43:20 launcher.py:28] Available routes are:\n") == []


# -- 3. compiler output with no traceback ---------------------------------------------------------

def test_nvcc_error_count_alone_is_a_jit_build_failure():
    [f] = findings(real("ms-swift-8349-nvcc-errors-no-traceback.log"))
    assert f["kind"] == "errors" and f["errors"][0]["class"] == "build"
    assert ids(f) == ["jit-build-failed"]


# -- 7. pydantic validation of the server's config ------------------------------------------------

def test_pydantic_value_errors_are_matched_by_what_they_say():
    [f] = findings(real("vllm-22422-value-error-one-line-mxfp4.log"))
    assert f["errors"][0]["class"] == "invalid" and ids(f) == ["quantization-needs-newer-gpu"]
    [f] = findings(real("llm-scaler-65-validation-error-abort.log"))
    assert f["chain"][0]["type"] == "pydantic_core._pydantic_core.ValidationError"
    assert ids(f) == ["model-architecture-not-supported"]


# -- 4. ptxas's words only in an exception's continuation lines -----------------------------------

def test_ptxas_text_after_the_exception_line_is_evidence():
    for name in ("triton-8539-ptxas-error-continuation.log", "pytorch-148551-glog-ptxas-continuation.log"):
        [f] = findings(real(name))
        assert "is not defined for option 'gpu-name'" in "\n".join(f["chain"][0]["details"]), name
        assert ids(f) == ["cuda-toolchain-too-old"], name


def test_an_inductor_error_around_a_failed_nvcc_is_a_build_failure_not_dynamo():
    [f] = findings(real("pytorch-174161-aoti-nvcc-ptxas-prose-inductorerror.log"))
    assert f["root_exception"].startswith("ptxas fatal   : PTX with .target 'sm_120a'")
    assert ids(f) == ["jit-build-failed"]


# -- 5. torch.compile's own internal errors --------------------------------------------------------

def test_an_assertion_inside_inductor_is_a_compile_failure():
    [f] = findings(real("onetrainer-1126-inductor-assertion.log"))
    assert f["root_exception"] == "torch._inductor.exc.InductorError: AssertionError: -74705025545103/200000000000000"
    assert ids(f) == ["dynamo-unsupported"]


def test_dynamos_from_user_code_section_is_evidence_of_tracing():
    [f] = findings(real("vllm-13329-dynamo-observed-exception-worker.log"))
    assert any(e["user_frames"] for e in f["chain"]) and "\nfrom user code:" in evidence(f).text


# -- 8. IPython / Jupyter tracebacks ---------------------------------------------------------------

def test_ipython_frames_take_their_arrow_line_as_source_never_as_an_error():
    [f] = findings(real("vllm-16003-jupyter-ipython-frames.log"))
    frames = all_frames(f)
    assert [(fr["func"], fr["line"]) for fr in frames] == [("LLMEngine.__init__", 281), ("DistributedExecutorBase.__init__", 286)]
    assert frames[0]["path"] == "~/anaconda3/envs/vllm/lib/python3.12/site-packages/vllm/engine/llm_engine.py"
    assert frames[0]["code"] == "self.model_executor = executor_class(vllm_config=vllm_config, )"
    assert f["root_exception"] == "(exception line not in the log)"


# -- 9. another writer's output inside a traceback -------------------------------------------------

def test_characters_another_writer_glued_to_source_lines_do_not_end_the_traceback():
    [f] = findings(real("openhands-680-interleaved-chars-bind.log"))
    assert [fr["func"] for fr in all_frames(f)] == ["_run_module_as_main", "_run_code", "<module>", "test", "__init__",
                                                   "server_bind"]
    assert all_frames(f)[3]["code"] == "w    with ServerClass(addr, HandlerClass) as httpd:"
    assert f["root_exception"] == "(exception line not in the log)"  # not the shell prompt before the header


def test_a_paste_that_lost_its_line_breaks_keeps_its_exception_line():
    [f] = findings(real("vllm-21661-flattened-lines-nccl-unhandled-cuda.log"))
    assert f["root_exception"].startswith("RuntimeError: NCCL error: unhandled cuda error")
    assert [fr["func"] for fr in all_frames(f)][-1] == "NCCL_CHECK"
    assert ids(f) == ["nccl-communicator-error"]


# -- 10. lines a terminal wrapped ------------------------------------------------------------------

def test_frame_lines_a_terminal_wrapped_stay_one_traceback():
    [f] = findings(real("vllm-16818-worker-frames-terminal-wrapped.log"))
    assert [(fr["func"], fr["line"]) for fr in all_frames(f)] == [
        ("compile_inner", 715), ("wrapper_function", 95), ("_compile", 750)]
    assert all_frames(f)[0]["path"] == "/usr/local/lib/python3.12/dist-packages/torch/_dynamo/convert_frame.py"
    assert f["ranks"] == ["rank3"]  # the wrapped pieces carry no prefix, yet stay with the worker's lines


# -- 11. a failure never looks like success --------------------------------------------------------

def test_a_death_nothing_explains_is_exit_1_with_the_line_that_shows_it():
    line, code, out = verdict("trtllm-1700-mpirun-rank-killed.log")
    assert code == 1 and line.startswith("no known issue matched — ")
    assert line.endswith(" — the server ended abnormally: mpirun noticed that process rank 6 with "
                         "PID 0 on node xxxxxxxx exited on signal 9 (Killed).")
    line, code, _ = verdict("sglang-10350-segfault-pd.log")
    assert code == 1 and line.endswith(" — the server ended abnormally: Fatal Python error: Segmentation fault")


def test_a_log_that_stops_inside_a_traceback_ended_abnormally():
    ended = scan(real("vllm-16818-worker-frames-terminal-wrapped.log"))["ended"]
    assert ended["how"] == "mid-traceback" and ended["text"].endswith("line 750, in _compile")
    line, code, _ = verdict("vllm-16818-worker-frames-terminal-wrapped.log")
    assert code == 1 and line.endswith("(the log stops inside a traceback)")


def test_healthy_logs_show_no_abnormal_end():
    for case in HEALTHY:
        assert scan((REAL / "healthy" / case["file"]).read_text())["ended"] is None, case["file"]
    line, code, _ = verdict("healthy/" + HEALTHY[0]["file"], real("healthy/" + HEALTHY[0]["file"]))
    assert (line, code) == ("no errors found", 0)
    # a server stopped on purpose (SIGTERM, exit 0) did not end abnormally
    stop = "INFO:     Shutting down\nreceived signal SIGTERM, shutting down\nProcess exited with code 0\n"
    assert scan(stop)["ended"] is None


# -- 12. entries that name what died, not why -------------------------------------------------------

def test_an_engine_wrapper_alone_names_the_dead_engine_core():
    [f] = findings(real("vllm-19415-engine-core-failed-proc-exit.log"))
    assert ids(f) == ["vllm-engine-core-died"]
    # a failure a known issue explains still exits 1: `diagnose && deploy` stops after a crash
    assert verdict("vllm-19415-engine-core-failed-proc-exit.log")[:2] == (
        "matched: vllm-engine-core-died (engine-death); action: restart", 1)


def test_the_engine_wrapper_after_the_engines_own_error_is_its_consequence():
    # the engine core's OOM, then the front end's wrapper: one failure, the OOM, the wrapper "then"
    text = real("vllm-12529-enginecore-oom-no-frames.log") + real("vllm-19002-engine-core-failed-unprefixed.log")
    [f] = findings(text)
    assert f["root_exception"].startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert ids(f) == ["cuda-out-of-memory"]  # the fallback entry is not named beside a cause
    assert [c["text"] for c in f["consequences"]] == [
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    assert "then: RuntimeError: Engine core initialization failed" in verdict("x", text)[2]


def test_extension_built_for_another_torch():
    for name in ("vllm-9377-registry-flash-attn-undefined-symbol.log", "sglang-8373-sgl-kernel-undefined-symbol-prose.log",
                 "sglang-pr13948-sgl-kernel-critical-multiline.log"):
        assert [ids(f)[:1] for f in findings(real(name)) if ids(f)][0] == ["extension-built-for-another-torch"], name


def test_a_thread_limit_is_named():
    [f] = findings(real("vllm-878-ray-boost-thread-unhandled.log"))
    assert ids(f) == ["process-thread-limit"]


def test_a_fallback_entry_must_say_true_or_false(tmp_path):
    from servops.diagnose import DiagnoseError
    kb = tmp_path / "kb.yml"
    kb.write_text(yaml.safe_dump([{"id": "x", "title": "t", "category": "engine-death", "explanation": "e",
                                   "fallback": "yes", "match": {"message": "a"}}]))
    try:
        known_issues(kb)
    except DiagnoseError as exc:
        assert "'fallback' must be true or false" in str(exc)
    else:
        raise AssertionError("a non-boolean fallback was accepted")


# -- 13. blind batch of 2026-12-06 ---------------------------------------------------------------------

def test_a_traceback_pasted_with_a_blank_line_after_every_line_keeps_its_frames_and_exception():
    # a CI console quoted line by line (sglang#12031): source lines and carets each one blank line down
    [f] = findings(real("sglang-12031-deepseek-ocr-lm-head-keyerror.log"))
    assert f["root_exception"] == "KeyError: 'lm_head.weight'"
    [frame] = all_frames(f)
    assert frame["func"] == "load_weights" and frame["code"] == "param = params_dict[name]"
    assert ids(f) == ["checkpoint-weight-name-mismatch"]
    spaced = "\n\n".join(['Traceback (most recent call last):', '  File "/srv/app.py", line 3, in <module>',
                           '    main()', '  File "/srv/app.py", line 2, in main', '    raise ValueError("no")',
                           'ValueError: no'])
    [f] = findings(spaced)
    assert [fr["code"] for fr in all_frames(f)] == ["main()", 'raise ValueError("no")'] and f["root_exception"] == "ValueError: no"


def test_what_vllm_logs_quietly_or_bare_before_it_fails_is_evidence():
    # the memory profile left the KV cache less than nothing (INFO), then the engine core failed
    [f] = findings(real("vllm-23278-gpt-oss-negative-kv-cache.log"))
    assert ids(f) == ["kv-cache-no-room"]
    assert findings("INFO 08-20 18:04:22 [gpu_worker.py:276] Available KV cache memory: 12.14 GiB\n") == []
    # the capability check's message alone, pasted without its ValueError
    [f] = findings(real("vllm-1488-awq-on-v100.log"))
    assert f["errors"][0]["class"] == "quantization" and ids(f) == ["quantization-needs-newer-gpu"]
    # vLLM V0's front end after its engine loop died: an abnormal end, the engine-death entry
    result = scan(real("vllm-13939-mqllmengine-already-dead.log"))
    assert result["ended"]["how"] == "died"
    assert [ids(f) for f in result["findings"]] == [["vllm-engine-core-died"]]


def test_a_traceback_cut_before_its_exception_is_read_by_its_last_raise():
    # vllm#27508: the engine core's traceback stops at `raise ValueError("No available memory ...`
    [f] = findings(real("vllm-27508-no-kv-cache-memory.log"))
    assert f["root_exception"] == "(exception line not in the log)"
    assert ids(f) == ["kv-cache-no-room"]


def test_a_wrappers_tag_in_front_of_a_rust_panic_is_a_prefix():
    # the SGLang router's lines under its launcher's `[SGLang LOG] ` tag (arbor#48)
    [f] = findings(real("arbor-48-sglang-router-too-many-open-files.log"))
    assert f["root_exception"].startswith("thread 'actix-rt|system:0|arbiter:242' panicked at ")
    assert ids(f) == ["process-thread-limit"]


def test_a_log_listed_newest_first_is_read_oldest_first():
    # Google Cloud's log viewer (sglang#5095): the KeyError is the cause, the shell's "Killed" the end
    result = scan(real("sglang-5095-modelopt-fp8-input-scale.log"))
    [f] = result["findings"]
    assert result["newest_first"] and f["root_exception"] == "KeyError: 'model.layers.55.mlp.gate_up_proj.input_scale'"
    assert ids(f) == ["checkpoint-weight-name-mismatch"] and "Killed" in result["ended"]["text"]
    out = StringIO()
    report("h", {"scan": result, "source": "log", "offline": True}, ISSUES, con=Console(file=out, width=200))
    assert "the log lists its newest line first" in out.getvalue()
    # time stamps that rise (or one out of order) are a log as written
    rising = "".join(f"2025-04-07T19:13:5{k}.0Z line {k}\n" for k in range(6))
    assert "newest_first" not in scan(rising)


def test_an_exception_whose_message_starts_on_the_next_line_is_read_with_it():
    # sgl_kernel raises ImportError("\n[sgl_kernel] CRITICAL: ...") (sglang#17460)
    [f] = findings(real("sglang-17460-cpu-kernel-torch-abi.log"))
    assert f["root_exception"] == "ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library!"
    assert ids(f) == ["extension-built-for-another-torch"]


def test_sglangs_capture_advice_alone_is_a_failure_it_names_no_cause_for():
    [f] = findings(real("sglang-6218-deepep-normal-cudagraph.log"))
    assert f["errors"][0]["class"] == "hint" and ids(f) == []


# -- seen on the real H200 (gpu-sglang kit): a server that carries on, and servops' own stop -------

def test_an_optional_part_disabled_for_an_exception_is_no_failure_but_a_real_one_is():
    """sglang 0.5.17 logs "OpenAI Responses API (/v1/responses) disabled: ... init failed
    (ModuleNotFoundError: ...)" and serves on: no finding. The same exception as a failure is one."""
    carry_on = [
        "[2026-12-04 00:49:27] OpenAI Responses API (/v1/responses) disabled: OpenAIServingResponses init failed "
        "(ModuleNotFoundError: No module named 'openai_harmony')",
        "[2026-12-04 00:49:27] Grammar backend unavailable, falling back to none (ImportError: cannot import name 'x')",
        "Skipping custom all-reduce: RuntimeError: peer access is not supported between these GPUs",
    ]
    for line in carry_on:
        assert findings(line + "\n[2026-12-04 00:49:28] The server is fired up and ready to roll!\n") == [], line
    failing = "[2026-12-04 00:49:27] Scheduler init failed (ModuleNotFoundError: No module named 'openai_harmony')\n"
    assert [f["root_exception"] for f in findings(failing)] == ["ModuleNotFoundError: No module named 'openai_harmony'"]


def test_children_ended_by_a_requested_stop_are_no_crash_but_an_unasked_kill_is():
    stopped = ("[t] SIGTERM received. signum=None frame=None. Draining requests and shutting down...\n"
               "[t] Subprocess scheduler_0 (pid=2199) crashed with exit code -15. Triggering SIGQUIT for cleanup...\n")
    assert findings(stopped) == [] and scan(stopped)["ended"] is None
    unasked = "[t] Subprocess scheduler_0 (pid=2199) crashed with exit code -15. Triggering SIGQUIT for cleanup...\n"
    assert findings(unasked) and scan(unasked)["ended"]["how"] == "died"
    killed = stopped.replace("exit code -15", "exit code -9")  # SIGKILL: not the stop that was asked for
    assert findings(killed) and scan(killed)["ended"] is not None
