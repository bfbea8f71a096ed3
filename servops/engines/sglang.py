"""SGLang: the engine servops was built around. Its facts, as the engine-neutral code asks them
(the host programs, stdlib-only and shipped alone, servops.remote.loadgen and launch_check, keep
their own copies of the names they read on the host)."""

from .base import Engine

ENGINE = Engine(
    name="sglang",
    launch_module="sglang.launch_server",
    template="launch_sglang.sh.j2",
    check_program="launch_check",
    dists=("sglang",),
    # /model_info, with /get_model_info (deprecated) as the gate's fallback
    health={"endpoint": "/health", "model_info": "/model_info", "interval": 2},
    gauges={"running": "sglang:num_running_reqs", "queued": "sglang:num_queue_reqs",
            "token_usage": "sglang:token_usage", "gen_throughput": "sglang:gen_throughput",
            "cache_hit_rate": "sglang:cache_hit_rate", "used_tokens": "sglang:num_used_tokens"},
    histograms={"ttft": "sglang:time_to_first_token_seconds", "itl": "sglang:inter_token_latency_seconds",
                "e2e": "sglang:e2e_request_latency_seconds"},
    counters={"requests": "sglang:num_requests", "prompt_tokens": "sglang:prompt_tokens",
              "generation_tokens": "sglang:generation_tokens"},
    # /v1/completions (OpenAI) by default; /generate with input_ids for the random-ids dataset
    request={"endpoint": "/v1/completions", "model": "default", "flush": "/flush_cache",
             "server_info": "/server_info"},
    process_names=("sglang::scheduler", "sglang::detokenizer"),
    files_var="server_files",  # the lab's double ships its own server module with the release
    packages=("sglang", "sgl_kernel"),
    # torch.compile at start: the piecewise prefill (tc_piecewise; before 0.5.14 its own flags) and
    # --enable-torch-compile; 0.5.10-0.5.13 run piecewise by default
    compile_flags=(("enable-torch-compile", True), ("enable-piecewise-cuda-graph", True),
                   ("enforce-piecewise-cuda-graph", True), ("cuda-graph-backend-prefill", "tc_piecewise"),
                   ("cuda-graph-backend-decode", "tc_piecewise"), ("cuda-graph-config", "tc_piecewise")),
    compiles_by_default=((">=0.5.10,<0.5.14", "disable-piecewise-cuda-graph"),),
    # the release's own launch, kept small and apart: a shrunk model with dummy weights, a small
    # static memory fraction, its own port on loopback, one node, no warm-up request
    audit_overrides={"model-path": "{model}", "port": "{port}", "host": "127.0.0.1", "load-format": "dummy",
                     "mem-fraction-static": "{mem}", "skip-server-warmup": True, "nnodes": None, "node-rank": None,
                     "dist-init-addr": None},
    # --mem-fraction-static is a share of the memory free when the server starts (0.5.17's
    # kv_cache_configurator: the KV pool is what is free after the weights less (1 - fraction) x the
    # free memory before them): beside a serving server a fixed 0.05 leaves the weights no room
    audit_mem_of="free",
    # the prefill graph off, per release (playbooks/piecewise.yml names where each rule comes from)
    prefill_eager=((">=0.5.14", {"enable-piecewise-cuda-graph": None, "enforce-piecewise-cuda-graph": None,
                                 "cuda-graph-backend-prefill": "disabled"}),
                   (">=0.5.10,<0.5.14", {"enable-piecewise-cuda-graph": None, "enforce-piecewise-cuda-graph": None,
                                         "disable-piecewise-cuda-graph": True}),
                   ("<0.5.10", {"enable-piecewise-cuda-graph": None})),
    # the action that keeps the prefill out of dynamo, as each release's own parser spells it
    workarounds=((">=0.5.14,<0.5.22", "change flag --cuda-graph-backend-prefill breakable (or disabled)"),
                 (">=0.5.22", "change flag --cuda-graph-backend-prefill disabled"),
                 (">=0.5.10,<0.5.14", "change flag --disable-piecewise-cuda-graph"),
                 ("<0.5.10", "drop flag --enable-piecewise-cuda-graph")),
    # where its JIT builds and compiled graphs go: FlashInfer's workspace (flashinfer/jit/env.py),
    # DeepGEMM's (sglang's deep_gemm_wrapper/compile_utils.py sets DG_JIT_CACHE_DIR from it),
    # triton's, sglang's own JIT kernels (sglang/kernels/jit/utils/compile.py builds them through
    # apache-tvm-ffi into TVM_FFI_CACHE_DIR, default ~/.cache/tvm-ffi: on the H100 a deploy onto an
    # empty jit_cache_dir started in 25 s with no JIT phase, its kernels found outside it), inductor's,
    # and sglang's own torch_compile_cache (compilation/backend.py, the piecewise graphs: it points
    # inductor and triton there itself)
    jit_caches=(("flashinfer", "FLASHINFER_WORKSPACE_BASE", "jit_s"), ("deep_gemm", "SGLANG_DG_CACHE_DIR", "jit_s"),
                ("triton", "TRITON_CACHE_DIR", "jit_s"), ("tvm_ffi", "TVM_FFI_CACHE_DIR", "jit_s"),
                ("torch_compile", "SGLANG_CACHE_DIR", "compile_s"),
                ("inductor", "TORCHINDUCTOR_CACHE_DIR", "compile_s")),
)
