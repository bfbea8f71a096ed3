"""Start-up phases and the JIT/compile cache plan without a host (issue #46.3, #46.4): the phases
read from real engine logs (tests/fixtures/real, and real lines quoted below with their source),
their text, what counts as a phase grown beyond its noise, the caches' keys and plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from servops import engines, jitcache, startup
from servops.deploystages import Plan
from servops.inventory import Host
from servops.remote.startlog import start_phases

REAL = Path(__file__).resolve().parent / "fixtures" / "real"


def lines(name: str) -> list[str]:
    return (REAL / name).read_text(errors="replace").splitlines()


@pytest.mark.parametrize("log, total, want", [
    # sglang 0.5.17 on an H200, piecewise + decode graphs (the kit's): weights' own elapsed, both captures
    ("healthy/sglang-0.5.17-h200-responses-api-disabled.log", 18.0,
     {"weights_s": 0.11, "capture_s": 5.45, "start_s": 18.0, "other_s": 12.44}),
    # sglang before 0.5.14: "Capture cuda graph end. Time elapsed: X s"
    ("healthy/sglang-19718-healthy-gptoss-startup.log", None, {"capture_s": 69.83}),
    # two TP ranks, each its decode capture and its piecewise compile: the slower rank, compile taken out of capture
    ("healthy/sglang-pr20758-musa-piecewise-capture.log", None, {"compile_s": 3.38, "capture_s": 27.4}),
    # vLLM: torch.compile and capture as it reports them
    ("healthy/glm-v-204-vllm-capture-startup.log", None, {"compile_s": 7.14, "capture_s": 7.0}),
    # its "torch.compile takes 19.69 s in total" holds the dynamo transform (6.07) and the graph (13.62)
    ("healthy/vllm-pr29335-compile-capture-bars.log", None, {"weights_s": 27.2, "compile_s": 19.69}),
    # a TP/EP worker's capture line ("(Worker_TP3_EP3 pid=..)")
    ("healthy/vllm-25848-worker-tp-ep-capture.log", None, {"capture_s": 38.0}),
    # batch startup-1207, collected for these phases (manifest.yml says from where):
    # 2026's vLLM: "compile range" and "took"; its total holds dynamo (4.62) and the graph (16.14)
    ("healthy/club-3090-612-single-5090-compile-range-took.log", None, {"compile_s": 23.5}),
    # a draft model compiled after the target: the total is cumulative (5.71, then 6.25), never summed
    ("healthy/speculators-pr166-eagle3-two-compile-totals.log", None, {"compile_s": 6.25}),
    # "Model loading took .. 2.195456 seconds" holds "Loading weights took 1.27"; a cache load (5.92)
    # its total (3.70, dynamo's only) left out, so the parts are larger and taken
    ("healthy/amd-strix-halo-vllm-toolboxes-pr5-loading-weights-compile-cache.log", None,
     {"weights_s": 2.2, "compile_s": 9.62}),
    ("healthy/vllm-pr27521-openpangu-tp8-compile-totals.log", None, {"compile_s": 94.2}),  # the slowest worker
    ("healthy/vllm-13144-v0-spec-decode-general-shape.log", None, {"compile_s": 5.97}),  # 0.7: "general shape"
    ("healthy/vllm-pr29137-gguf-graph-capture-init-engine.log", None, {"capture_s": 3.0}),
    # sglang printing vLLM's loader line (2.69 s) inside its own "Load weight end. elapsed=6.21 s"
    ("healthy/sglang-pr17985-pp-tp-load-weight-elapsed.log", None, {"weights_s": 6.21}),
    ("healthy/sglang-pr11716-tp8-capture-cuda-graph-end.log", None, {"capture_s": 9.23}),  # TP8: the slowest rank
])
def test_phases_are_read_from_real_logs(log, total, want):
    assert start_phases(lines(log), total) == want


# FlashInfer 0.2's JIT lines inside sglang's log, verbatim from sgl-project/sglang#6891 (each module
# loaded, then "Finished"); the builds are paired by module, per log clock (milliseconds)
FLASHINFER_02 = """\
2025-06-05 08:20:07,822 - INFO - flashinfer.jit: Finished loading JIT ops: batch_mla_attention_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512_head_dim_kpe_64_profiler_False_sm90
2025-06-05 08:20:07,883 - INFO - flashinfer.jit: Loading JIT ops: batch_mla_attention_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512_head_dim_kpe_64_profiler_False_sm90
2025-06-05 08:20:07,893 - INFO - flashinfer.jit: Finished loading JIT ops: batch_mla_attention_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512_head_dim_kpe_64_profiler_False_sm90"""


def test_flashinfer_jit_pairs_are_timed_by_module():
    assert start_phases(FLASHINFER_02.splitlines()) == {"jit_s": 0.01}


def test_a_one_line_jit_build_lasts_until_the_next_record():
    # FlashInfer 0.6+'s cold build (flashinfer/jit/core.py: logger.info_once("Building JIT module %s; this
    # can take several minutes on first use.")), then sglang's next record
    log = ["[2026-12-04 00:49:21] Load weight end. elapsed=0.11 s, type=LlamaForCausalLM, avail mem=139.12 GB, "
           "mem usage=0.00 GB.",
           "2026-12-04 00:49:21,500 - INFO - core.py:594 - flashinfer.jit: Building JIT module fp8_blockscale_gemm_sm90; "
           "this can take several minutes on first use.",
           "[2026-12-04 00:51:02] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, bs=[1], "
           "avail mem=124.26 GB",
           "[2026-12-04 00:51:03] Capture target decode CUDA graph end. elapsed=1.42 s, mem usage=0.04 GB, "
           "avail mem=124.22 GB."]
    assert start_phases(log, 110.0) == {"weights_s": 0.11, "jit_s": 100.5, "capture_s": 1.42, "start_s": 110.0,
                                        "other_s": 7.97}


# vLLM states some phases twice, as parts and as the whole that holds them; verbatim lines
# (2026's vLLM, vllm-project/vllm#44106): the loader's weights inside the runner's model loading
VLLM_44106 = """\
(EngineCore pid=1265223) INFO 06-02 00:51:39 [default_loader.py:397] Loading weights took 26.93 seconds
(EngineCore pid=1265223) INFO 06-02 00:51:40 [model_runner.py:295] Model loading took 7.64 GiB and 32.969258 seconds"""


def test_a_whole_that_holds_its_parts_is_taken_once():
    # before: parts and wholes were summed (59.9 s of weights here; 14.43 s of compile for speculators#166)
    assert start_phases(VLLM_44106.splitlines()) == {"weights_s": 32.97}
    # with no total line (the log cut before it), the parts: dynamo's transform and the graph
    parts = [line for line in lines("healthy/vllm-13144-v0-spec-decode-general-shape.log") if "in total" not in line]
    assert start_phases(parts) == {"compile_s": 5.97}


def test_only_sglangs_compile_lines_are_taken_out_of_its_capture():
    # vLLM compiles before it captures: its capture stays whole (glm-v-204's own lines, with a
    # "Compiling a graph" line of vllm-project/vllm#27815 before them)
    vllm = ["(EngineCore_DP0 pid=23579) INFO 10-15 23:09:23 [backends.py:274] Compiling a graph for dynamic shape "
            "takes 41.40 s",
            "(EngineCore_DP0 pid=23579) INFO 10-15 23:17:21 [monitor.py:33] torch.compile takes 47.72 s in total"]
    capture = [line for line in lines("healthy/glm-v-204-vllm-capture-startup.log") if "Graph capturing" in line]
    assert start_phases(vllm + capture) == {"compile_s": 47.72, "capture_s": 7.0}


def test_sglangs_speculative_draft_captures_are_capture_too():
    # the formats of sglang 0.5.17's own logger calls (speculative/eagle_worker_v2.py,
    # multi_layer_eagle_draft_extend_cuda_graph_runner.py: each step timed on its own)
    log = ["[2026-12-07 10:00:00 TP0] Capture target decode CUDA graph end. elapsed=3.20 s, mem usage=0.40 GB, "
           "avail mem=60.00 GB.",
           "[2026-12-07 10:00:02 TP0] Capture draft decode CUDA graph end. elapsed=1.50 s, mem usage=0.10 GB, "
           "avail mem=59.90 GB.",
           "[2026-12-07 10:00:03 TP0] Capture draft extend CUDA graph end. step=1, elapsed=0.70 s, mem usage=0.05 GB, "
           "avail mem=59.85 GB.",
           "[2026-12-07 10:00:04 TP0] Capture draft extend CUDA graph end. step=0, elapsed=0.60 s, mem usage=0.05 GB, "
           "avail mem=59.80 GB.",
           "[2026-12-07 10:00:05 TP0] Capture single-CG draft extend end. elapsed=0.50 s, mem usage=0.05 GB, "
           "avail mem=59.75 GB.",
           "[2026-12-07 10:00:05 TP0] Init torch distributed ends. elapsed=0.90 s, mem usage=0.00 GB",
           # an older release's, verbatim from sgl-project/sglang#10088
           "[2025-09-05 20:50:29 TP6] Capture draft cuda graph end. Time elapsed: 62.67 s. mem usage=0.21 GB. "
           "avail mem=15.31 GB."]
    assert start_phases(log) == {"capture_s": 62.67}  # the slowest rank: TP6 (TP0 6.5)
    assert start_phases([line.replace("TP6", "TP0") for line in log]) == {"capture_s": 69.17}


def test_text_names_every_phase_the_log_did_not_show():
    start = {"start_s": 35.24, "weights_s": 3.0, "capture_s": 12.1, "other_s": 20.14}
    assert startup.text(start) == ("start to healthy 35.2s (weights 3.0s, capture 12.1s, other 20.1s; "
                                   "not in the log: JIT, compile)")
    assert startup.text({"start_s": 35.24, "capture_s": 12.1}) == "start to healthy 35.2s (capture 12.1s)"
    assert startup.clean({"jit_s": "12", "weights_s": True, "capture_s": float("nan"), "other_s": 1}) == {"other_s": 1.0}


def test_a_phase_grown_beyond_its_noise_is_named():
    previous = {"start_s": 31.0, "weights_s": 10.4, "capture_s": 5.2, "other_s": 15.4}
    # within noise (1 s, or 10% of what it took before): nothing named
    assert startup.grown({"start_s": 32.5, "weights_s": 11.4, "capture_s": 6.1, "other_s": 15.0}, previous) == []
    # JIT, which the previous start's log never showed, counts from 0
    grew = startup.grown({"start_s": 140.0, "weights_s": 10.2, "jit_s": 100.0, "capture_s": 9.0, "other_s": 20.8},
                         previous)
    assert grew == ["JIT 0.0s -> 100.0s (+100.0s; noise 1.0s)", "capture 5.2s -> 9.0s (+3.8s; noise 1.0s)",
                    "other 15.4s -> 20.8s (+5.4s; noise 1.5s)"]
    assert startup.grown({"jit_s": 5.0}, {"weights_s": 1.0}) == []  # no total before: JIT unknown, not 0
    assert startup.grown({"jit_s": 5.0}, None) == []
    starts = [{"start_s": 30.0}, previous]
    assert startup.compared({"release": "r1", "starts": starts}, "r1") == (previous, starts, "its previous start")
    assert startup.compared({"release": "r0", "starts": starts}, "r1") == (previous, [], "r0's last start")
    assert startup.compared(None, "r1") == (None, [], "")
    assert len(startup.kept([{"start_s": float(i)} for i in range(12)], {"start_s": 99.0})) == startup.KEEP


SGLANG = engines.get("sglang")
ARGV = ["--model-path", "/m", "--port", "30000", "--attention-backend", "flashinfer", "--mem-fraction-static", "0.8"]
VERSIONS = {"sglang": "0.5.17", "flashinfer-python": "0.6.15.post1", "torch": "2.11.0"}


def test_keys_ignore_flags_that_build_no_kernel():
    base = jitcache.keys("sglang", ARGV, VERSIONS)
    assert jitcache.keys("sglang", [a.replace("30000", "31000").replace("0.8", "0.5") for a in ARGV], VERSIONS) == base
    piecewise = jitcache.keys("sglang", ARGV + ["--cuda-graph-backend-prefill", "tc_piecewise"], VERSIONS)
    assert piecewise["jit_s"] == base["jit_s"] and piecewise["compile_s"] != base["compile_s"]
    newer = jitcache.keys("sglang", ARGV, dict(VERSIONS, **{"flashinfer-python": "0.6.16"}))
    assert newer["jit_s"] != base["jit_s"] and newer["compile_s"] != base["compile_s"]


def test_the_plan_reuses_what_the_ledger_holds_and_times_the_rest_from_history():
    k = jitcache.keys("sglang", ARGV, VERSIONS)
    ledger = {"kinds": {"jit_s": {k["jit_s"]: {"release": "r1", "at": "2026-12-07T00:00:00Z", "seconds": 95.0,
                                               "warm_s": 0.4}},
                        "compile_s": {"other1": {"release": "r0", "seconds": 40.0}, "other2": {"seconds": 60.0},
                                      "other3": {"release": "r2"}}}}
    plan = jitcache.plan(SGLANG, ARGV, {"dir": "/c", "ledger": ledger, "versions": VERSIONS})
    assert [(p.kind, p.reuse, p.expected_s) for p in plan.kinds] == [("jit_s", True, 0.4), ("compile_s", False, 50.0)]
    assert plan.lines() == [
        "caches in /c: JIT kernels (flashinfer, deep_gemm, triton, tvm_ffi): reuse, built by r1 at 2026-12-07T00:00:00Z; its "
        "latest start spent 0.4s there",
        "caches in /c: torch.compile (torch_compile, inductor): rebuild, expected ~50s (the median of this host's 2 "
        "earlier builds)"]
    assert plan.record_spec() == {"dir": "/c", "keys": k, "jit_dirs": ["flashinfer", "deep_gemm", "triton", "tvm_ffi"]}
    host = Host("h", {"server_port": 30000})
    assert jitcache.warmup_wanted(plan, host) == "torch.compile to build"
    assert jitcache.warmup_wanted(plan, Host("h", {"jit_warmup": False})) is None
    assert jitcache.warmup_wanted(plan, host, nodes=2) is None
    text = Plan(current="r1", unchanged=None, caches=plan, prebuild="torch.compile to build").text("pw")
    assert text == ("would deploy pw (replacing r1); caches: JIT kernels reuse; torch.compile rebuild (~50s); "
                    "built before the old server stops (check mode)")
    damaged = jitcache.plan(SGLANG, ARGV, {"dir": "/c", "ledger": {"kinds": {}, "damaged": "/c/l: bad"}})
    assert damaged.lines()[-1] == "cache ledger not read (/c/l: bad): every cache counts as rebuilt"


def test_cache_env_points_each_engine_variable_under_the_host_dir():
    env = jitcache.cache_env(SGLANG, Host("h", {"jit_cache_dir": "/var/cache/jit/"}))
    assert env == {"FLASHINFER_WORKSPACE_BASE": "/var/cache/jit/flashinfer", "SGLANG_DG_CACHE_DIR": "/var/cache/jit/deep_gemm",
                   "TRITON_CACHE_DIR": "/var/cache/jit/triton",
                   "TVM_FFI_CACHE_DIR": "/var/cache/jit/tvm_ffi", "SGLANG_CACHE_DIR": "/var/cache/jit/torch_compile",
                   "TORCHINDUCTOR_CACHE_DIR": "/var/cache/jit/inductor"}
    assert jitcache.cache_env(engines.get("vllm"), Host("h", {"jit_cache_dir": "/c"}))["VLLM_CACHE_ROOT"] == "/c/torch_compile"
    assert jitcache.cache_env(SGLANG, Host("h", {})) == {}
