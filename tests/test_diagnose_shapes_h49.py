"""diagnose on the shapes the blind batch blind8-h49 (lmdeploy/TurboMind, TensorRT-LLM
and tritonserver, ROCm, multi-node NCCL, crashes while serving) showed it reading wrong, each from
its real public log (tests/fixtures/real, sources in its README): an optional import's failure
logged as a warning, NCCL's own WARN lines above a cut traceback, an exception logged as its whole
repr, a C++ engine's CUDA out of memory, a quantized kernel that names the one architecture it
supports, a TensorRT engine built by another version, TensorRT-LLM's fused-attention assertion,
and a GPU runtime's "invalid argument" read as a settings error."""

from io import StringIO
from pathlib import Path

from rich.console import Console

from servops.categorize import cues_of
from servops.diagnose import known_issues, match_log, report, scan_local, shown_finding
from servops.remote.tracebacks import scan

REAL = Path(__file__).resolve().parent / "fixtures" / "real"
ISSUES = known_issues()


def real(name):
    return (REAL / name).read_text()


def named(text):
    """The known issue each finding of a log names first (None where it names none)."""
    hits = match_log(scan(text)["findings"], ISSUES)[0]
    return [h[0]["id"] if h else None for h in hits]


def shown_root(text):
    found = scan(text)["findings"]
    return shown_finding(found, match_log(found, ISSUES)[0])["root_exception"]


def exit_code(name, text):
    rep = report(name, scan_local(text, name), ISSUES, con=Console(file=StringIO(), width=300, color_system=None))
    return rep.exit_code


# -- an optional part's import failure, logged as a warning -----------------------------------------

def test_an_optional_import_failure_logged_as_a_warning_is_no_failure():
    # vLLM probes for ROCm's amdsmi (and vllm._rocm_C) and warns with the ModuleNotFoundError's repr
    # when it is absent; the server goes on (a CUDA host, or ROCm under WSL after the PR's fix)
    for name in ("healthy/vllm-pr38434-rocm-wsl-amdsmi-modulenotfound-warning.log",
                 "healthy/vllm-pr22765-enginecore-rocm-import-warnings-on-cuda.log"):
        result = scan(real(name))
        assert result["findings"] == [] and result["ended"] is None, name
        assert exit_code(name, real(name)) == 0


def test_an_import_warning_is_still_the_root_of_a_failure_that_shows_none():
    # (the same kind of warning above a traceback cut before its exception line is its cause)
    assert named(real("rocm-5668-warning-libcudart-importerror.log")) == ["extension-built-for-another-torch"]


# -- NCCL's WARN lines above a traceback cut before its exception -----------------------------------

def test_nccls_own_warning_is_the_root_of_the_cut_traceback_below_it():
    for name, said in (("sglang-3820-multinode-nccl-no-route-to-host.log", "returned 113(No route to host)"),
                       ("sglang-5594-multinode-nccl-connection-abort.log", "failed : Software caused connection abort")):
        text = real(name)
        # one failure: the warnings joined the scheduler's traceback, they are not a failure apart
        assert len(scan(text)["findings"]) == 1, name
        root = shown_root(text)
        assert "NCCL WARN socket" in root and said in root, root
        assert named(text) == ["nccl-communicator-error"]


def test_a_traceback_with_its_own_exception_keeps_it_as_root_whatever_nccl_warned():
    # (only a failure that shows no cause takes the warning: an NCCL error line of its own stays)
    assert shown_root(real("sglang-4289-nccl-system-error.log")).startswith("RuntimeError: NCCL error")


# -- an exception logged as its whole repr ------------------------------------------------------------

def test_an_error_record_that_is_an_exceptions_repr_is_that_exception():
    # vLLM V0's client: `ERROR ... client.py:282] RuntimeError('Engine process (pid 76) died.')`,
    # then logging's `NoneType: None`, then the launcher's epitaph
    text = real("vllm-10812-v0-engine-process-died-while-serving.log")
    assert shown_root(text) == "RuntimeError: Engine process (pid 76) died."
    # it only reports the engine process's death: the wrapper's entry, not a cause
    assert named(text) == ["vllm-engine-core-died"]


def test_a_repr_right_above_a_traceback_header_stays_that_tracebacks_message():
    text = real("vllm-11044-xgrammar-special-token.log")
    assert len(scan(text)["findings"]) == 1
    assert shown_root(text).startswith("RuntimeError('Error in model execution: ")


# -- a C++ engine's CUDA out of memory ----------------------------------------------------------------

def test_a_cxx_engines_cuda_runtime_out_of_memory_is_cuda_out_of_memory():
    # TurboMind (and FasterTransformer) print cudaErrorMemoryAllocation's string:
    # `[TM][ERROR] CUDA runtime error: out of memory <file>:<line>`, as a line or as what()
    for name in ("lmdeploy-3557-tm-oom-allocator-serving.log", "lmdeploy-3971-jetson-chat-tm-oom-cut.log",
                 "lmdeploy-2236-swift-deploy-terminate-what-tm-oom.log"):
        assert named(real(name)) == ["cuda-out-of-memory"], name


# -- a quantized kernel that supports one architecture only -------------------------------------------

def test_a_quantized_gemm_that_only_supports_another_architecture_is_a_quantization_gap():
    # `fp8 blockscale gemm only support Hopper` on a B200: the quantization's kernel, not the server
    assert named(real("trtllm-5064-b200-fp8-blockscale-hopper-only.log")) == ["quantization-kernel-unavailable"]


# -- a TensorRT engine built by another version -------------------------------------------------------

def test_an_engine_tensorrt_cannot_deserialize_is_one_built_by_another_version():
    # tritonserver's model table: the status cell continued over the rows under it
    text = real("trtllm-backend-424-triton-table-deserialize-engine.log")
    assert named(text) == ["trt-engine-built-by-another-version"]
    assert "Assertion failed: Failed to deserialize cuda engine" in shown_root(text)


# -- TensorRT-LLM's fused attention that has no kernel for the model's heads ---------------------------

def test_trtllms_fmha_assertion_is_an_attention_kernel_gap_not_a_setting():
    text = real("trtllm-pr1758-quoted-deepseek-fmha-sm86-abort.log")
    assert named(text) == ["attention-backend-unsupported-head-dim"]
    assert shown_root(text).startswith("tensorrt_llm::common::TllmException: [TensorRT-LLM][ERROR] Assertion failed: "
                                       "Deepseek should be supported by fmha")


# -- a GPU runtime's "invalid argument" ---------------------------------------------------------------

def test_a_gpu_runtimes_invalid_argument_is_no_settings_cue():
    # cudaErrorInvalidValue's string is a kernel launch's or an allocation's bad value, not a
    # command-line argument: the lexicon's config cue must not read it as one
    lines = [ln for name in ("trtllm-4277-b200-dsr1-cuda-invalid-argument-repeated.log",
                             "lmdeploy-130-turbomind-tp-invalid-argument.log",
                             "flashinfer-1929-cuda-error-glued-to-traceback.log")
             for ln in real(name).splitlines() if "invalid argument" in ln]
    assert len(lines) >= 3 and any("executing 'cudaLaunchKernelEx" in ln for ln in lines)
    for ln in lines:
        assert ("config", 3) not in cues_of(ln), ln
