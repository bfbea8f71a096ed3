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
    # where its JIT builds and compiled graphs go: FlashInfer's workspace (flashinfer/jit/env.py),
    # DeepGEMM's (sglang's deep_gemm_wrapper/compile_utils.py sets DG_JIT_CACHE_DIR from it),
    # triton's, inductor's, and sglang's own torch_compile_cache (compilation/backend.py, the
    # piecewise graphs: it points inductor and triton there itself)
    jit_caches=(("flashinfer", "FLASHINFER_WORKSPACE_BASE", "jit_s"), ("deep_gemm", "SGLANG_DG_CACHE_DIR", "jit_s"),
                ("triton", "TRITON_CACHE_DIR", "jit_s"), ("torch_compile", "SGLANG_CACHE_DIR", "compile_s"),
                ("inductor", "TORCHINDUCTOR_CACHE_DIR", "compile_s")),
)
