"""A stand-in for `python -m sglang.launch_server` where no GPU exists (tests, the lab).

Accepts SGLang's flags, serves /health, /get_model_info, /metrics (SGLang's metric names, via
prometheus-client), /v1/completions (streaming or not; `stream_options.include_usage` adds sglang's
final usage chunk), /generate (`text` or `input_ids`, streaming or not) and /flush_cache (refused
with 400 while requests run, as sglang does). Behaviour knobs, from the environment:
SGLANG_DOUBLE_LOAD_TIME (seconds before healthy), SGLANG_DOUBLE_NEVER_HEALTHY=1 (serve /health 503 forever), SGLANG_DOUBLE_BROKEN_METRICS=1 (serve
text that is not Prometheus exposition), SGLANG_DOUBLE_EXIT_AFTER_REQUESTS=N (die, as a crashed
server does, once N requests have started).

Generation speed (see Pacer for the model; prompt tokens are input_ids, else words):
  SGLANG_DOUBLE_TTFT               seconds from admission to the first token (prefill), default 0
  SGLANG_DOUBLE_PREFILL_PER_TOKEN  extra prefill seconds per prompt token, default 0
  SGLANG_DOUBLE_TOKEN_DELAY        seconds per decode step (one token for every running request), default 0
  SGLANG_DOUBLE_STEP_PER_SEQ       extra seconds per decode step per running request, default 0
  SGLANG_DOUBLE_EAGER_FACTOR       step time multiplier above --cuda-graph-max-bs, default 1.5
  SGLANG_DOUBLE_GPU_TOKENS         KV tokens the whole GPU memory would hold, default 1000000
  SGLANG_DOUBLE_WEIGHTS_FRACTION   share of GPU memory the weights take, default 0.6
  SGLANG_DOUBLE_FIRST_USE_DELAY    seconds added to the first token of the first request at each
                                   new batch size or prompt length (power-of-two buckets), as a
                                   real server compiling kernels on first use; default 0
  SGLANG_DOUBLE_RUN_JITTER         J: each busy period (idle to idle: one bench run) decodes at a
                                   speed drawn uniformly within +-J of nominal, as run-to-run
                                   noise on real GPUs; default 0
  SGLANG_DOUBLE_SEED               seeds those draws: the same seed, server args and port give the
                                   same speeds, start after start (the Nth start of a setting draws
                                   the Nth stream: counted in $TMPDIR/sglang-double-starts/)
Start-up and crashes, as the server args make them:
  SGLANG_DOUBLE_CAPTURE_PER_BS     seconds per CUDA-graph batch size captured at start (sglang's
                                   sizes 1, 2, 4, 8, then every 8 up to --cuda-graph-max-bs; none
                                   with --disable-cuda-graph), logged as sglang logs it: "Capture
                                   cuda graph end. Time elapsed: X s"; default 0
  SGLANG_DOUBLE_JIT_TIME           seconds each JIT kernel module takes to build when its cache
                                   does not hold it (FlashInfer's attention module under
                                   FLASHINFER_WORKSPACE_BASE/.cache/flashinfer; with
                                   --fp8-gemm-backend flashinfer_deepgemm DeepGEMM's GEMM under
                                   SGLANG_DG_CACHE_DIR; defaults ~ as the real ones), logged as
                                   FlashInfer and sglang log them, then written there; default 0
  SGLANG_DOUBLE_SILENT_JIT=1       those builds print nothing, as sglang 0.5.17's own (tvm-ffi) and
                                   FlashInfer 0.6.15's do: only their files tell (a build.ninja
                                   written when a build starts, its .so when it ends)
  SGLANG_DOUBLE_COMPILE_TIME       seconds piecewise's torch.compile takes with an empty compile
                                   cache (sglang's SGLANG_CACHE_DIR/torch_compile_cache), a tenth
                                   of it once the cache holds the graph, logged as sglang 0.5.17's
                                   prefill capture logs it; default 0
  SGLANG_DOUBLE_LOG_LINES          lines written to the log as they are (no timestamp added), one
                                   per "|", before the weights: an engine log that lies (a phase
                                   line from another clock, a date no clock shows); default none
  SGLANG_DOUBLE_CRASH_IF           conditions on server args ("mem-fraction-static>0.88", several
                                   joined by ","; any one true): the capture runs out of GPU memory
                                   at start, with sglang's own traceback (sglang issue 5285)
  SGLANG_DOUBLE_CRASH_UNDER_LOAD_IF  the same, true: serves, then dies with torch's CUDA OOM as
                                   soon as 8 or more requests run at once
Server args the model reads: --cuda-graph-max-bs (256), --disable-cuda-graph,
--max-running-requests (no cap), --mem-fraction-static (0.9): KV cache = GPU_TOKENS x
(mem-fraction-static - WEIGHTS_FRACTION) tokens; a request holds prompt + max_tokens of it.
TOKEN_DELAY and STEP_PER_SEQ both 0: an instant server (every token at once after TTFT).

Driven by the host's sglang, like the server it stands in for: where the python running the double
has a real sglang installed, argv is parsed by THAT release's parser (sglang_args.py, shipped beside
the double: `ServerArgs.add_cli_args` as `sglang.launch_server` builds it, or the same parser read
from sglang's source when sglang cannot be imported), so a flag the real server rejects makes the
double exit with sglang's own usage error, exit 2. The endpoints follow that release's HTTP server
(read from its source): /health and /health_generate (503 while starting), /model_info and
/server_info (the parsed server args, `version`, and `launch_command` where the release has it),
the deprecated /get_model_info and /get_server_info, /metrics only with --enable-metrics. Without
sglang, the double's own small parser applies (unknown flags ignored) and every endpoint is served,
shaped like the newest release's, with `version` "double".
Startup as sglang's: weights load with the port closed (SGLANG_DOUBLE_LOAD_TIME, default 0.5 s),
then the HTTP server answers /health 503 while it warms up (SGLANG_DOUBLE_WARMUP_TIME, default
0.2 s, 0 when LOAD_TIME is 0), then 200. /model_info answers from the moment the port opens.
Metrics: scheduler gauges (running, queued, token usage, gen throughput, cache hit rate) carry
sglang's labels (model_name, engine_type, tp_rank, pp_rank, moe_ep_rank): one label set for TP
rank 0, or one per TP rank with --enable-metrics-for-all-schedulers (TP ranks run the same batch,
so they report the same values). Knobs for metric tests: SGLANG_DOUBLE_TOKEN_USAGE and
SGLANG_DOUBLE_CACHE_HIT_RATE (fixed values), SGLANG_DOUBLE_RANK_SKEW (rank r reports the ratio
gauges plus r x skew).

A process tree as sglang's: one scheduler process per TP rank of this node and a detokenizer,
children of the launcher (named sglang::sched_R and sglang::detoken), which exit when it
does. SGLANG_DOUBLE_SCHEDULERS_IGNORE_SIGTERM=1 makes them behave as TP schedulers stuck in an
NCCL call: SIGTERM is ignored and they outlive the launcher.

With --enable-piecewise-cuda-graph it really runs the dynamo trace SGLang's capture hits:
torch.compile(fullgraph=True) over flashinfer.jit.cpp_ext.is_cuda_version_at_least on the host's
own flashinfer file, so an unpatched venv crashes with the real torch._dynamo traceback. On a
block-FP8 model (its config.json's quantization_config) with --fp8-gemm-backend flashinfer_deepgemm,
where the venv holds the lab kernels (servops/lab/kernels_dist), it compiles its whole forward and
captures it at every prefill size the release would (--cuda-graph-bs-prefill, else sglang's
defaults), largest first, and serves /generate's input_token_logprobs from it
(servops/lab/piecewise_model.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import random
import sys
import time
import types
from collections import deque

from aiohttp import web

try:  # shipped beside the double in a release (a server file), else the servops tree
    import piecewise_model
except ImportError:
    from servops.lab import piecewise_model
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def log(msg: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", flush=True)


def _own_parser():
    p = argparse.ArgumentParser(prog="sglang_double")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1)
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true")
    p.add_argument("--fp8-gemm-backend", default="auto")
    p.add_argument("--cuda-graph-max-bs", type=int, default=160)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-metrics-for-all-schedulers", action="store_true")
    return p


def _load_sglang_args():
    """sglang_args.py: beside the double in a release (a server file), else in the servops tree."""
    try:
        import sglang_args  # noqa: shipped as a server file
        return sglang_args
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "remote", "sglang_args.py")
    if not os.path.isfile(path):
        return None
    import importlib.util
    spec = importlib.util.spec_from_file_location("sglang_args", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiles_piecewise(d: dict) -> bool:
    """Does this release, with these args, run the torch.compile (dynamo) piecewise capture?"""
    if "cuda_graph_backend_prefill" in d:  # 0.5.14+: per-phase backends
        backend = d.get("cuda_graph_backend_prefill")
        if d.get("disable_prefill_cuda_graph") and backend is None:
            backend = "disabled"
        cfg = piecewise_model.cuda_graph_config(d)
        if isinstance(cfg.get("prefill"), dict) and cfg["prefill"].get("backend"):
            backend = cfg["prefill"]["backend"]
        return backend == "tc_piecewise"
    if "disable_piecewise_cuda_graph" in d and "enforce_piecewise_cuda_graph" in d:
        return not d.get("disable_piecewise_cuda_graph")  # 0.5.10-0.5.13: on by default
    return bool(d.get("enable_piecewise_cuda_graph"))


def parse_args(argv):
    """(args, ignored flags). With a real sglang on this python, its own parser decides: a flag it
    rejects ends the double as it ends sglang (usage error, exit 2)."""
    sa = _load_sglang_args()
    pkg = sa.sglang_package() if sa else None
    if not pkg:
        if sa is None and importlib.util.find_spec("sglang") is not None:
            log("warning: sglang is installed but sglang_args.py is missing beside the double: "
                "using the double's own parser")
        args, rest = _own_parser().parse_known_args(argv)
        args.sglang_version, args.parser, args.sglang_package = None, "double", None
        args.launch_command = " ".join(argv)
        args.sglang_server_args = {k: v for k, v in vars(args).items()
                                   if k not in ("sglang_version", "parser", "sglang_package", "launch_command")}
        args.sglang_server_args["tp_size"] = args.tp  # sglang's field name
        return args, rest
    version = sa.sglang_version(pkg)
    parser, how, note = sa.build_parser(pkg)
    if note:
        log(f"sglang {version}: {note}; parsing with its parser read from source (static)")
    ns = parser.parse_args(argv)  # sglang's usage error and exit 2, as the real server
    d = sa.as_server_args(vars(ns))
    args = types.SimpleNamespace(**d)
    args.tp = d.get("tp_size") or 1
    args.nnodes = d.get("nnodes") or 1
    args.node_rank = d.get("node_rank") or 0
    args.dist_init_addr = d.get("dist_init_addr")
    args.enable_piecewise_cuda_graph = _compiles_piecewise(d)
    args.fp8_gemm_backend = d.get("fp8_gemm_runner_backend") or d.get("fp8_gemm_backend") or "auto"  # dest varies
    args.cuda_graph_max_bs = d.get("cuda_graph_max_bs") or d.get("cuda_graph_max_bs_decode")
    args.enable_metrics = bool(d.get("enable_metrics"))
    args.enable_metrics_for_all_schedulers = bool(d.get("enable_metrics_for_all_schedulers"))
    args.served_model_name = d.get("served_model_name")
    args.sglang_version, args.parser, args.sglang_package = version, how, pkg
    args.launch_command = " ".join(argv)
    args.sglang_server_args = d
    return args, []


def import_without_package_init(modname: str):
    """Import flashinfer.jit.cpp_ext alone: flashinfer/__init__ needs CUDA extensions."""
    import sysconfig
    parts = modname.split(".")
    site = sysconfig.get_paths()["purelib"]
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg not in sys.modules:
            shell = types.ModuleType(pkg)
            shell.__path__ = [os.path.join(site, *parts[:i])]
            sys.modules[pkg] = shell
    return importlib.import_module(modname)


def fp8_call_is_opaque(sglang_package: str | None) -> bool:
    """Does the host's sglang make FlashInfer's fp8_blockscale_gemm_sm90 an opaque custom op?
    Read from the host's own fp8_utils.py, as the real server would run it: the function is a
    decorated def (torch.library.custom_op or sglang's register_custom_op), not a bare import."""
    import ast
    if not sglang_package:
        return False
    path = os.path.join(sglang_package, "srt", "layers", "quantization", "fp8_utils.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == "fp8_blockscale_gemm_sm90" and node.decorator_list
               for node in ast.walk(tree))


def capture_fp8_linear(opaque: bool) -> None:
    """The FP8 block-scale linear sglang's piecewise capture compiles with --fp8-gemm-backend
    flashinfer_deepgemm (sglang 0.5.17's fp8_utils.py -> FlashInfer's fp8_blockscale_gemm_sm90),
    over the host's real FlashInfer files: kernel selection queries the CUDA version
    (is_cuda_version_at_least), then the JIT loader loads the kernel module (JitSpec.build_and_load
    of gen_fp8_blockscale_gemm_sm90_module), then the kernel runs. Bare, dynamo traces all of it and
    stops at the first builtin it cannot trace, as on the H100 (bench/evidence/seed-sm90/); made an
    opaque custom op by the host's sglang, dynamo never enters FlashInfer. This CPU stands in for the
    GPU's kernel with a matmul."""
    import torch

    cpp_ext = import_without_package_init("flashinfer.jit.cpp_ext")
    fp8_blockscale = import_without_package_init("flashinfer.jit.gemm.fp8_blockscale")

    def flashinfer_fp8_blockscale_gemm_sm90(x, w):
        if not cpp_ext.is_cuda_version_at_least("12.8"):
            raise RuntimeError("fp8_blockscale_gemm_sm90 needs CUDA 12.8")
        fp8_blockscale.gen_fp8_blockscale_gemm_sm90_module().build_and_load()  # the JIT loader
        return x @ w.T

    gemm = flashinfer_fp8_blockscale_gemm_sm90
    if opaque:
        @torch.library.custom_op("sglang_double::fp8_blockscale_gemm_sm90", mutates_args=(),
                                 schema="(Tensor x, Tensor w) -> Tensor")
        def gemm(x, w):
            return x @ w.T

        @gemm.register_fake
        def _(x, w):
            return x.new_empty((x.shape[0], w.shape[0]))

    def fp8_linear(x, w):  # sglang: flashinfer_deepgemm_w8a8_block_fp8_linear_with_fallback
        return gemm(x, w)

    log("Capture piecewise cuda graph begin. This can take up to several minutes.")
    compiled = torch.compile(fp8_linear, fullgraph=True, backend="eager")
    compiled(torch.ones(4, 128), torch.ones(64, 128))
    log("Capture piecewise cuda graph end.")


def capture_piecewise_cuda_graph() -> None:
    import torch

    cpp_ext = import_without_package_init("flashinfer.jit.cpp_ext")

    def piecewise_block(x):
        # What SGLang's piecewise capture reaches through FlashInfer's backend selection.
        if cpp_ext.is_cuda_version_at_least("12.8"):
            return x * 2
        return x

    log("Capture piecewise cuda graph begin. This can take up to several minutes.")
    compiled = torch.compile(piecewise_block, fullgraph=True, backend="eager")
    compiled(torch.ones(4))
    log("Capture piecewise cuda graph end.")


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def _model_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


ALL_ROUTES = {"/health": ["GET"], "/health_generate": ["GET"], "/model_info": ["GET"], "/get_model_info": ["GET"],
              "/server_info": ["GET"], "/get_server_info": ["GET"]}


def _shape(args) -> dict:
    """The release's routes and /server_info, /model_info keys; everything for the plain double."""
    if getattr(args, "sglang_package", None):
        sa = _load_sglang_args()
        try:
            return sa.http_server_shape(args.sglang_package)
        except Exception as exc:  # an unreadable http_server.py: serve everything
            log(f"warning: cannot read sglang's http_server.py ({exc}); serving every endpoint")
    return {"routes": dict(ALL_ROUTES), "server_info_keys": [], "model_info_keys": []}


class RankGauge:
    """A scheduler-side gauge as sglang exports it: one sample per reporting TP rank (rank 0, or every
    rank with --enable-metrics-for-all-schedulers), labels model_name, engine_type, tp_rank,
    pp_rank, moe_ep_rank. TP ranks run the same batch, so each reports the same value (plus
    rank x skew, a test knob). `.labels(model)` returns the gauge itself, so callers written for a
    plain model_name-labelled Gauge keep working."""

    LABELS = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]

    def __init__(self, name, doc, registry, model, ranks, skew=0.0):
        self.gauge = Gauge(name, doc, self.LABELS, registry=registry)
        self.children = [self.gauge.labels(model, "unified", str(r), "0", "0") for r in ranks]
        self.skew = skew
        self.value = 0.0
        self.pinned = None
        self.set(0.0)

    def labels(self, *_ignored):
        return self

    def pin(self, value):
        """A fixed value (test knob): later set/inc/dec calls no longer move it."""
        self.pinned = None
        self.set(value)
        self.pinned = value

    def set(self, value):
        if self.pinned is not None:
            return
        self.value = float(value)
        for r, child in enumerate(self.children):
            child.set(self.value + self.skew * r)

    def inc(self, amount=1.0):
        self.set(self.value + amount)

    def dec(self, amount=1.0):
        self.set(self.value - amount)


class Double:
    def __init__(self, args):
        self.args = args
        self.load_time = float(os.environ.get("SGLANG_DOUBLE_LOAD_TIME", "0.5"))
        self.warmup_time = float(os.environ.get("SGLANG_DOUBLE_WARMUP_TIME", "0.2" if self.load_time > 0 else "0"))
        self.token_delay = float(os.environ.get("SGLANG_DOUBLE_TOKEN_DELAY", "0.0"))
        self.ttft = float(os.environ.get("SGLANG_DOUBLE_TTFT", "0.0"))
        self.never_healthy = os.environ.get("SGLANG_DOUBLE_NEVER_HEALTHY") == "1"
        self.broken_metrics = os.environ.get("SGLANG_DOUBLE_BROKEN_METRICS") == "1"
        self.exit_after = int(os.environ.get("SGLANG_DOUBLE_EXIT_AFTER_REQUESTS", "0"))
        self.started_requests = 0
        self.ready_at = time.monotonic() + self.warmup_time  # the HTTP server is up: warmup starts
        self.started = time.time()
        self.shape = _shape(args)
        reg = self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model = os.path.basename(args.model_path.rstrip("/")) or args.model_path
        self.forward_model = None  # the piecewise model (piecewise_model.py), where the venv runs one
        tp = max(1, int(getattr(args, "tp", 1) or 1))
        ranks = range(tp) if getattr(args, "enable_metrics_for_all_schedulers", False) else range(1)
        skew = float(os.environ.get("SGLANG_DOUBLE_RANK_SKEW", "0") or 0)
        m = self.model
        self.running = RankGauge("sglang:num_running_reqs", "The number of running requests.", reg, m, ranks)
        self.queued = RankGauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", reg, m, ranks)
        self.token_usage = RankGauge("sglang:token_usage", "The token usage.", reg, m, ranks, skew)
        self.gen_tps = RankGauge("sglang:gen_throughput", "The generation throughput (token/s).", reg, m, ranks)
        self.hit_rate = RankGauge("sglang:cache_hit_rate", "The prefix cache hit rate.", reg, m, ranks, skew)
        for gauge, knob in ((self.token_usage, "SGLANG_DOUBLE_TOKEN_USAGE"), (self.hit_rate, "SGLANG_DOUBLE_CACHE_HIT_RATE")):
            if os.environ.get(knob):
                gauge.pin(float(os.environ[knob]))
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg)
        self.gen_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.", labels, registry=reg)
        self.requests = Counter("sglang:num_requests", "The number of processed requests.", labels, registry=reg)
        self.ttft_h = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                labels, buckets=LATENCY_BUCKETS, registry=reg)
        self.itl_h = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                               labels, buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e_h = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                               labels, buckets=LATENCY_BUCKETS, registry=reg)
        self._window: list[tuple[float, int]] = []

    def ready(self) -> bool:
        return not self.never_healthy and time.monotonic() >= self.ready_at

    # ---- sglang's native endpoints (shapes from the release's http_server.py) ----

    async def health(self, request):
        """/health and /health_generate: 503 while starting (warmup), then 200, empty bodies."""
        if not self.ready():
            return web.Response(status=503)
        return web.Response(status=200)

    def _model_info(self) -> dict:
        a, sargs = self.args, self.args.sglang_server_args
        config = _model_config(a.model_path)
        values = {
            "model_path": a.model_path, "served_model_name": sargs.get("served_model_name") or a.model_path,
            "tokenizer_path": sargs.get("tokenizer_path") or a.model_path, "is_generation": True,
            "preferred_sampling_params": sargs.get("preferred_sampling_params"),
            "weight_version": sargs.get("weight_version") or "default", "load_format": sargs.get("load_format") or "auto",
            "reasoning_parser": sargs.get("reasoning_parser"), "tool_call_parser": sargs.get("tool_call_parser"),
            "disaggregation_mode": sargs.get("disaggregation_mode") or "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": config.get("model_type"), "architectures": config.get("architectures"),
        }
        keys = self.shape["model_info_keys"] or list(values)
        out = {k: values.get(k) for k in keys}
        # The double's own additions (no sglang release has them): what it was started with.
        out.update(tp_size=a.tp, piecewise_cuda_graph=bool(a.enable_piecewise_cuda_graph))
        return out

    async def model_info(self, request):
        if request.path.startswith("/get_"):
            log("Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
                "Please use '/model_info' instead.")
        return web.json_response(self._model_info())

    async def server_info(self, request):
        """The server args as parsed, scheduler info, internal state per DP rank, the version, and
        (on releases that have them) launch_command, kv_events, startup_time, frontend."""
        if request.path.startswith("/get_"):
            log("Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
                "Please use '/server_info' instead.")
        a = self.args
        pacer = self._pacer()
        capacity = int(pacer.kv_capacity)
        info = {k: _jsonable(v) for k, v in a.sglang_server_args.items()}
        info.update({"status": "ready", "max_total_num_tokens": capacity, "max_req_input_len": max(capacity - 1, 0)})
        last = self.gen_tps.value
        info["internal_states"] = [{**{k: _jsonable(v) for k, v in a.sglang_server_args.items()},
                                    "last_gen_throughput": last,
                                    "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": capacity, "graph": 0.0},
                                    "effective_max_running_requests_per_dp": pacer.max_running or 4096}]
        info["version"] = a.sglang_version or "double"
        extra = {"launch_command": a.launch_command, "kv_events": None, "startup_time": self.started,
                 "frontend": "python"}
        for key in (self.shape["server_info_keys"] if a.sglang_package else list(extra)):
            if key in extra:
                info[key] = extra[key]
        return web.json_response(info)

    async def metrics(self, request):
        if self.broken_metrics:
            return web.Response(text='sglang:num_running_reqs{model_name="x" 3\n{{not prometheus', content_type="text/plain")
        now = time.monotonic()
        self._window = [(t, n) for t, n in self._window if now - t < 5]
        self.gen_tps.set(sum(n for _, n in self._window) / 5.0)
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    # ---- generation side: pacing, /v1/completions, /generate, /flush_cache ----

    def _pacer(self) -> "Pacer":
        pacer = getattr(self, "_pacer_obj", None)
        if pacer is None:
            pacer = self._pacer_obj = Pacer(self.args, self.ttft, self.token_delay)
            log(f"generation model: {pacer.describe()}")
        return pacer

    async def _tokens(self, n: int, prompt_tokens: int = 1):
        """Yield token texts at the pace of the generation model (see Pacer), recording SGLang's
        latency metrics and the running/queued/token-usage gauges."""
        m = self.model
        self.started_requests += 1
        if self.exit_after and self.started_requests > self.exit_after:
            log(f"simulated crash after {self.exit_after} requests")
            os._exit(1)
        pacer = self._pacer()
        start = time.monotonic()
        self.requests.labels(m).inc()
        pacer.busy()
        if pacer.crash_under_load and pacer.active >= 8:
            log(f"load crash: {pacer.crash_under_load} with {pacer.active} requests running")
            print(LOAD_OOM, flush=True)
            os._exit(1)
        seq = None
        try:
            if pacer.paced:
                seq = pacer.submit(n, prompt_tokens)
                self._gauges(pacer)
                nxt = seq.next_token
            else:
                self.running.labels(m).inc()
                nxt = None
            last = start
            for i in range(n):
                if nxt is not None:
                    await nxt()
                    if i == 0:
                        self._gauges(pacer)
                elif i == 0:
                    wait = pacer.ttft * pacer.speed + pacer.first_use_delay(pacer.active, prompt_tokens)
                    if wait:
                        await asyncio.sleep(wait)
                now = time.monotonic()
                if i == 0:
                    self.ttft_h.labels(m).observe(now - start)
                else:
                    self.itl_h.labels(m).observe(now - last)
                last = now
                self.gen_tokens.labels(m).inc()
                self._window.append((now, 1))
                yield f" tok{i}"
            self.e2e_h.labels(m).observe(time.monotonic() - start)
        finally:
            pacer.active -= 1
            if seq is not None:
                pacer.finish(seq)
                self._gauges(pacer)
            else:
                self.running.labels(m).dec()

    def _gauges(self, pacer: "Pacer") -> None:
        m = self.model
        self.running.labels(m).set(len(pacer.running))
        self.queued.labels(m).set(len(pacer.waiting))
        self.token_usage.labels(m).set(pacer.kv_used / pacer.kv_capacity if pacer.kv_capacity else 0.0)

    @staticmethod
    def _count_prompt(prompt) -> int:
        """Prompt tokens: the length of input_ids, else words (the double has no tokenizer)."""
        if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
            return max(1, len(prompt))
        if isinstance(prompt, list):
            return max(1, sum(len(str(p).split()) for p in prompt))
        return max(1, len(str(prompt).split()))

    async def completions(self, request):
        if not self.ready():
            return web.json_response({"error": "loading"}, status=503)
        body = await request.json()
        n = int(body.get("max_tokens", 16))
        prompt_tokens = self._count_prompt(body.get("prompt", ""))
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        created = int(time.time())
        rid = f"cmpl-{os.getpid()}-{self.started_requests}"
        model = body.get("model") or self.model
        if not body.get("stream"):
            text = "".join([t async for t in self._tokens(n, prompt_tokens)])
            return web.json_response({"id": rid, "object": "text_completion", "created": created, "model": model,
                                      "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                "total_tokens": prompt_tokens + n}})
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        i = 0
        async for tok in self._tokens(n, prompt_tokens):
            i += 1
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": 0, "text": tok, "logprobs": None,
                                  "finish_reason": "length" if i == n else None}]}
            if continuous:
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": i, "total_tokens": prompt_tokens + i}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if include_usage:  # as sglang: a last chunk with no choices and the usage
            final = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                     "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}}
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def generate(self, request):
        """SGLang's native API: `text` or `input_ids`; streamed chunks carry the cumulative text."""
        if not self.ready():
            return web.json_response({"error": "loading"}, status=503)
        body = await request.json()
        n = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text", "")
        prompt_tokens = self._count_prompt(prompt)
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        rid = f"gen-{os.getpid()}-{self.started_requests}"

        def meta(done: int, finished: bool) -> dict:
            return {"id": rid, "finish_reason": {"type": "length", "length": done} if finished else None,
                    "prompt_tokens": prompt_tokens, "completion_tokens": done, "cached_tokens": 0}

        if not body.get("stream"):
            text = "".join([t async for t in self._tokens(n, prompt_tokens)])
            info = meta(n, True)
            if body.get("return_logprob") and isinstance(prompt, list) and self.forward_model is not None:
                # the prefill's own numbers (sglang: [logprob, token id, text] per input token)
                info["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.forward_model.logprobs(prompt), prompt)]
            return web.json_response({"text": text, "output_ids": list(range(n)), "meta_info": info})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        text, i = "", 0
        async for tok in self._tokens(n, prompt_tokens):
            i += 1
            text += tok
            await resp.write(f"data: {json.dumps({'text': text, 'meta_info': meta(i, i == n)})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def flush_cache(self, request):
        """As sglang: 200 when idle; with ?timeout=S it waits up to S seconds for idle; else 400."""
        try:
            timeout = max(0.0, float(request.query.get("timeout", "0") or 0))
        except ValueError:
            return web.Response(status=422, text="timeout: expected a number")
        pacer = self._pacer()
        deadline = time.monotonic() + timeout
        while pacer.active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if pacer.active:
            log(f"Cache not flushed because there are pending requests. #queue-req: {len(pacer.waiting)}, "
                f"#running-req: {pacer.active - len(pacer.waiting)}")
            return web.Response(status=400, text="Flush cache failed.\n")
        log("Cache flushed successfully!")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")


def seed_text(args) -> str | None:
    """SGLANG_DOUBLE_SEED: the run-to-run draws' seed, from the seed, the server args and how
    many times this setting has started (None: unseeded)."""
    seed = os.environ.get("SGLANG_DOUBLE_SEED")
    if not seed:
        return None
    import hashlib
    import tempfile

    key = hashlib.sha256(f"{seed}\0{getattr(args, 'port', '')}\0{' '.join(sys.argv[1:])}".encode()).hexdigest()[:20]
    d = os.path.join(tempfile.gettempdir(), "sglang-double-starts")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, key)
    try:
        with open(path) as f:
            starts = int(f.read() or 0)
    except (OSError, ValueError):
        starts = 0
    with open(path, "w") as f:
        f.write(str(starts + 1))
    return f"{key}:{starts}"


def crash_region(args, conditions: str) -> str | None:
    """The first of `conditions` ("mem-fraction-static>0.88,cuda-graph-max-bs>=256") the server
    args meet, as written (None: none)."""
    import operator
    import re

    ops = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}
    arg = _server_args(args)
    for cond in filter(None, (c.strip() for c in conditions.split(","))):
        m = re.fullmatch(r"([a-z0-9-]+)\s*(>=|<=|==|>|<)\s*([0-9.]+)", cond)
        if not m:
            continue
        value = arg(m[1].replace("-", "_"), float)
        if value is not None and ops[m[2]](float(value), float(m[3])):
            return cond
    return None


def kernel_tag(args, *names: str) -> str:
    """The digest of the server args that decide a kernel (a launch with other values builds
    other kernels, as a real engine's cache keys do)."""
    import hashlib

    arg = _server_args(args)
    values = [str(arg(n, str)) for n in ("model_path", "tp_size", *names)]
    return hashlib.sha256("|".join(values).encode()).hexdigest()[:12]


def jit_builds(args) -> None:
    """The JIT kernel builds of a first start, skipped where the cache already holds the module:
    FlashInfer's attention module (flashinfer/jit/core.py 0.7: "Building JIT module %s; this can
    take several minutes on first use.", its own logger's format) and, for the FP8 GEMM backend
    flashinfer_deepgemm, DeepGEMM's kernels (sglang's deep_gemm_wrapper/compile_utils.py: "Try
    DeepGEMM JIT Compiling for <...> N=..., K=..., num_groups=... with all Ms."), each taking
    SGLANG_DOUBLE_JIT_TIME and then written to its cache."""
    per_module = float(os.environ.get("SGLANG_DOUBLE_JIT_TIME", "0") or 0)
    if per_module <= 0:
        return
    home = os.path.expanduser("~")
    try:
        from importlib.metadata import version as dist_version
        fi_version = dist_version("flashinfer-python")
    except Exception:  # no FlashInfer on this python: its cache is still keyed by a version
        fi_version = "0"
    attention = f"batch_prefill_double_{kernel_tag(args, 'attention_backend', 'kv_cache_dtype', 'quantization')}"
    fi_dir = os.path.join(os.environ.get("FLASHINFER_WORKSPACE_BASE", home), ".cache", "flashinfer", fi_version,
                          "double", "cached_ops", attention)
    modules = [(fi_dir, attention, "flashinfer")]
    if getattr(args, "fp8_gemm_backend", "auto") == "flashinfer_deepgemm":
        tag = kernel_tag(args, "quantization", "fp8_gemm_backend")
        dg_dir = os.path.join(os.environ.get("SGLANG_DG_CACHE_DIR", os.path.join(home, ".cache", "deep_gemm")),
                              "cache", f"kernel.gemm_nt_f8f8bf16.{tag}")
        modules.append((dg_dir, tag, "deep_gemm"))
    silent = os.environ.get("SGLANG_DOUBLE_SILENT_JIT") == "1"
    for path, name, kind in modules:
        so = os.path.join(path, f"{name}.so")
        if os.path.isfile(so):
            continue
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "build.ninja"), "w") as fh:  # as ninja's build directory starts
            fh.write(f"# double build of {name}\n")
        if kind == "flashinfer" and not silent:
            now = time.time()
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))},{int(now % 1 * 1000):03d} - INFO - "
                  f"core.py:594 - flashinfer.jit: Building JIT module {name}; this can take several minutes on "
                  f"first use.", flush=True)
        elif not silent:
            log(f"Try DeepGEMM JIT Compiling for <GEMM_NT_F8F8BF16> N=4096, K=4096, num_groups=1 with all Ms. It only "
                f"takes a little time (typically 1 sec) if you have run `python3 -m sglang.compile_deep_gemm`. ")
        time.sleep(per_module)
        with open(so, "wb") as fh:
            fh.write(b"double kernel " + name.encode())


def compile_phase(args) -> None:
    """Piecewise's torch.compile, as sglang 0.5.17 logs it inside its prefill capture: the
    graph compiled in SGLANG_DOUBLE_COMPILE_TIME with an empty compile cache, a tenth of that
    once sglang's torch_compile_cache (SGLANG_CACHE_DIR, compilation/backend.py) holds it."""
    full = float(os.environ.get("SGLANG_DOUBLE_COMPILE_TIME", "0") or 0)
    if full <= 0 or not args.enable_piecewise_cuda_graph:
        return
    base = os.environ.get("SGLANG_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "sglang"))
    graph = os.path.join(base, "torch_compile_cache", "rank_0_0", kernel_tag(args, "cuda_graph_max_bs",
                                                                             "cuda_graph_bs_prefill"), "graph.py")
    cached = os.path.isfile(graph)
    log("Capture target prefill CUDA graph begin. backend=tc_piecewise, num_tokens=[4, 8, 16], avail mem=12.25 GB")
    t0 = time.monotonic()
    took = full / 10 if cached else full
    time.sleep(took)
    log(f"Compiling a graph for dynamic shape takes {took:.2f} s")
    if not cached:
        os.makedirs(os.path.dirname(graph), exist_ok=True)
        with open(graph, "w") as fh:
            fh.write("# double's compiled graph\n")
    log(f"Capture target prefill CUDA graph end. elapsed={time.monotonic() - t0:.2f} s, mem usage=0.12 GB, "
        f"avail mem=12.13 GB.")


def capture_sizes(max_bs: int) -> list[int]:
    """The batch sizes sglang captures CUDA graphs for: 1, 2, 4, 8, then every 8 up to max_bs."""
    return [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))


# The capture's OOM at start, as sglang 0.4 printed it (github.com/sgl-project/sglang/issues/5285)
CAPTURE_OOM = """Traceback (most recent call last):
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2009, in run_scheduler_process
    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, dp_rank)
  File "/sgl-workspace/sglang/python/sglang/srt/model_executor/model_runner.py", line 216, in initialize
    self.init_cuda_graphs()
  File "/sgl-workspace/sglang/python/sglang/srt/model_executor/model_runner.py", line 934, in init_cuda_graphs
    self.cuda_graph_runner = CudaGraphRunner(self)
  File "/sgl-workspace/sglang/python/sglang/srt/model_executor/cuda_graph_runner.py", line 269, in __init__
    raise Exception(
Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 448.00 MiB. GPU 7 has a total capacity of 95.00 GiB of which 283.12 MiB is free.
Possible solutions:
1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)
2. set --cuda-graph-max-bs to a smaller value (e.g., 16)
3. disable torch compile by not using --enable-torch-compile
4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge performance loss)"""

# Running out of memory while serving, as torch says it (github.com/sgl-project/sglang/issues/23602)
LOAD_OOM = """Traceback (most recent call last):
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2952, in run_scheduler_process
    scheduler.event_loop_overlap()
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 1009, in event_loop_overlap
    batch_result = self.run_batch(batch)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of 95.07 GiB of which 298.69 MiB is free."""


def _server_args(args):
    """arg(name, type): the server arg from the parsed namespace, else from the command line (a
    parser that leaves the flag unparsed), else None."""
    def arg(name: str, kind):
        value = getattr(args, name, None)
        if value is not None:
            return value
        flag = "--" + name.replace("_", "-")
        argv = sys.argv[1:]
        for i, a in enumerate(argv):
            if a == flag:
                if kind is bool:
                    return True
                if i + 1 < len(argv):
                    try:
                        return kind(argv[i + 1])
                    except ValueError:
                        return None
            elif a.startswith(flag + "=") and kind is not bool:
                try:
                    return kind(a.split("=", 1)[1])
                except ValueError:
                    return None
        return None
    return arg


class _Seq:
    __slots__ = ("n", "need", "emitted", "taken", "event", "done")

    def __init__(self, n: int, need: int):
        self.n, self.need = n, need
        self.emitted = 0          # tokens the model has produced for this sequence
        self.taken = 0            # tokens the request handler has sent
        self.event = asyncio.Event()
        self.done = False

    async def next_token(self) -> None:
        """Wait until the model has produced one more token than the handler has sent."""
        self.taken += 1
        while self.emitted < self.taken:
            self.event.clear()
            await self.event.wait()


class Pacer:
    """The double's generation model: deterministic, driven by the real server args.

    Without pacing knobs (SGLANG_DOUBLE_TOKEN_DELAY and SGLANG_DOUBLE_STEP_PER_SEQ both 0) every
    token is sent at once: an instant server. Otherwise a scheduler runs as SGLang's does:
      admission  a request waits in the queue (sglang:num_queue_reqs) until fewer than
                 --max-running-requests run (unset: no cap) and its prompt + max_tokens fit in
                 the KV cache: SGLANG_DOUBLE_GPU_TOKENS x (--mem-fraction-static (default 0.9)
                 - SGLANG_DOUBLE_WEIGHTS_FRACTION), at least one request's worth.
      prefill    first token SGLANG_DOUBLE_TTFT + SGLANG_DOUBLE_PREFILL_PER_TOKEN x prompt tokens
                 after admission (prefills overlap; they do not stall decoding).
      decode     all prefilled running requests advance one token per step together; a step of
                 batch size b takes SGLANG_DOUBLE_TOKEN_DELAY + SGLANG_DOUBLE_STEP_PER_SEQ x b,
                 times SGLANG_DOUBLE_EAGER_FACTOR when b exceeds --cuda-graph-max-bs (default
                 256) or with --disable-cuda-graph (no CUDA graph: eager kernels).
    So a larger --cuda-graph-max-bs, --max-running-requests or --mem-fraction-static raises
    throughput at high concurrency, and TTFT (queueing) and ITL (batch size) grow with load.
    """

    def __init__(self, args, ttft: float, token_delay: float):
        env = os.environ.get
        self.ttft = ttft
        self.token_delay = token_delay
        self.prefill_per_token = float(env("SGLANG_DOUBLE_PREFILL_PER_TOKEN", "0"))
        self.step_per_seq = float(env("SGLANG_DOUBLE_STEP_PER_SEQ", "0"))
        self.eager_factor = float(env("SGLANG_DOUBLE_EAGER_FACTOR", "1.5"))
        arg = _server_args(args)
        self.graph_max_bs = int(arg("cuda_graph_max_bs", int) or 256)
        self.eager_always = bool(arg("disable_cuda_graph", bool))
        mrr = arg("max_running_requests", int)
        self.max_running = int(mrr) if mrr else None
        mfs = arg("mem_fraction_static", float)
        self.mem_fraction = float(mfs) if mfs else 0.9
        gpu_tokens = float(env("SGLANG_DOUBLE_GPU_TOKENS", "1000000"))
        weights = float(env("SGLANG_DOUBLE_WEIGHTS_FRACTION", "0.6"))
        self.kv_capacity = max(0, int(gpu_tokens * (self.mem_fraction - weights)))
        self.first_use = float(env("SGLANG_DOUBLE_FIRST_USE_DELAY", "0"))
        self.compiled: set = set()
        self.jitter = float(env("SGLANG_DOUBLE_RUN_JITTER", "0"))
        self.speed = 1.0
        self._rng = random.Random(seed_text(args))
        self.crash_under_load = crash_region(args, env("SGLANG_DOUBLE_CRASH_UNDER_LOAD_IF", ""))
        self.paced = token_delay > 0 or self.step_per_seq > 0
        self.waiting: deque = deque()
        self.running: set = set()
        self.decoding: list = []
        self.kv_used = 0
        self.active = 0             # requests inside _tokens (queued, prefilling, decoding)
        self._wake: asyncio.Event | None = None
        self._loop_task = None
        self._last_step_end = 0.0

    def describe(self) -> str:
        extra = (f"; first use of a batch size or prompt length +{self.first_use * 1000:g} ms" if self.first_use else "") + \
                (f"; run-to-run speed +-{self.jitter * 100:g}%" if self.jitter else "")
        return self._describe() + extra

    def _describe(self) -> str:
        if not self.paced:
            return f"instant (TTFT {self.ttft * 1000:g} ms)"
        cap = self.max_running if self.max_running else "none"
        return (f"batched: TTFT {self.ttft * 1000:g} ms + {self.prefill_per_token * 1000:g} ms/prompt token, decode step "
                f"{self.token_delay * 1000:g} ms + {self.step_per_seq * 1000:g} ms/seq (x{self.eager_factor:g} above "
                f"cuda-graph-max-bs {self.graph_max_bs}{', always: --disable-cuda-graph' if self.eager_always else ''}), "
                f"max running {cap}, KV cache {self.kv_capacity} tokens (mem-fraction-static {self.mem_fraction:g})")

    def step_time(self, batch: int) -> float:
        t = (self.token_delay + self.step_per_seq * batch) * self.speed
        if self.eager_always or batch > self.graph_max_bs:
            t *= self.eager_factor
        return t

    def busy(self) -> None:
        """A request arrives: from idle, the busy period's speed is drawn (RUN_JITTER)."""
        if self.active == 0 and self.jitter:
            self.speed = 1.0 + self._rng.uniform(-self.jitter, self.jitter)
        self.active += 1

    def first_use_delay(self, batch: int, prompt_tokens: int) -> float:
        """FIRST_USE_DELAY for a request that brings a batch size or prompt length bucket (the
        power of two at or above it: captured CUDA graphs pad a batch up) the server has not
        run yet; 0 for the rest."""
        if not self.first_use:
            return 0.0
        keys = {("batch", 1 << max(0, batch - 1).bit_length()), ("prompt", 1 << max(0, prompt_tokens - 1).bit_length())}
        new = keys - self.compiled
        self.compiled |= keys
        return self.first_use if new else 0.0

    def submit(self, n: int, prompt_tokens: int) -> _Seq:
        seq = _Seq(n, prompt_tokens + n)
        self.waiting.append(seq)
        self._admit()
        return seq

    def finish(self, seq: _Seq) -> None:
        """The request ended (all tokens sent, or the client went away): free its slot."""
        if seq in self.running:
            self.running.discard(seq)
            self.kv_used -= seq.need
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.done = True
        if seq in self.decoding:
            self.decoding.remove(seq)
        self._admit()

    def _admit(self) -> None:
        loop = asyncio.get_event_loop()
        while self.waiting:
            seq = self.waiting[0]
            if self.max_running and len(self.running) >= self.max_running:
                break
            if self.running and self.kv_used + seq.need > self.kv_capacity:
                break
            self.waiting.popleft()
            self.running.add(seq)
            self.kv_used += seq.need
            prompt = seq.need - seq.n
            loop.call_later((self.ttft + self.prefill_per_token * prompt) * self.speed
                            + self.first_use_delay(len(self.running), prompt), self._prefilled, seq)

    def _prefilled(self, seq: _Seq) -> None:
        if seq.done:
            return
        self._emit(seq)
        if seq.emitted < seq.n:
            self.decoding.append(seq)
            if self._loop_task is None or self._loop_task.done():
                self._wake = asyncio.Event()
                self._loop_task = asyncio.ensure_future(self._decode_loop())
            self._wake.set()

    @staticmethod
    def _emit(seq: _Seq) -> None:
        seq.emitted += 1
        seq.event.set()

    async def _decode_loop(self) -> None:
        while True:
            if not self.decoding:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self.decoding)
            now = time.monotonic()
            step = self.step_time(len(batch))
            # back-to-back steps keep their cadence (sleep overshoot does not accumulate)
            begin = self._last_step_end if now - self._last_step_end < step else now
            end = begin + step
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            self._last_step_end = end
            for seq in batch:
                if seq.done or seq not in self.decoding:
                    continue
                self._emit(seq)
                if seq.emitted >= seq.n:
                    self.decoding.remove(seq)


def _child(name: str, stuck: bool) -> None:
    """A scheduler or detokenizer process: alive while the launcher is (sglang's children watch
    their parent); `stuck`, as a TP scheduler blocked in NCCL: deaf to SIGTERM, parent or not."""
    import signal

    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write(name[:15])
    except OSError:
        pass
    if stuck:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    while stuck or os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def spawn_children(tp: int, nnodes: int) -> list[int]:
    """One scheduler per TP rank on this node, and a detokenizer (forked before any thread or
    socket exists, so they hold neither the port nor the event loop)."""
    stuck = os.environ.get("SGLANG_DOUBLE_SCHEDULERS_IGNORE_SIGTERM") == "1"
    names = [f"sglang::sched_{r}" for r in range(max(1, int(tp) // max(1, int(nnodes))))] + ["sglang::detoken"]
    pids = []
    for name in names:
        pid = os.fork()
        if pid == 0:
            _child(name, stuck)
        pids.append(pid)
    return pids


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args, ignored = parse_args(argv)
    spawn_children(args.tp or 1, args.nnodes or 1)
    if args.parser == "double":
        log(f"server_args: {args.sglang_server_args} (ignored flags: {' '.join(ignored) or 'none'})")
    else:
        log(f"server_args (sglang {args.sglang_version}, {args.parser} parser): {args.launch_command}")
    for line in filter(None, os.environ.get("SGLANG_DOUBLE_LOG_LINES", "").split("|")):
        print(line, flush=True)
    log(f"Load weight begin (double of {args.model_path}, tp={args.tp}, node_rank={args.node_rank}/{args.nnodes})")
    weights_t0 = time.monotonic()
    load_time = float(os.environ.get("SGLANG_DOUBLE_LOAD_TIME", "0.5"))
    if load_time > 0:  # as sglang: no HTTP server until the weights are loaded
        time.sleep(load_time)
    log(f"Load weight end. elapsed={time.monotonic() - weights_t0:.2f} s, type=double, avail mem=12.25 GB, mem usage=0.00 GB.")
    jit_builds(args)
    compile_phase(args)
    # the piecewise capture, after the weights and the JIT builds as sglang's: the real dynamo trace
    model = None
    fp8 = getattr(args, "fp8_gemm_backend", "auto") == "flashinfer_deepgemm"
    config = _model_config(args.model_path)
    whole = fp8 and piecewise_model.block_fp8(config) and piecewise_model.lab_kernels_installed()
    if args.enable_piecewise_cuda_graph and whole:
        # a block-FP8 model, and the venv holds the lab's FlashInfer- and sglang-shaped kernels: the
        # whole forward is compiled and captured at the release's prefill sizes (piecewise_model.py)
        model = piecewise_model.PiecewiseModel(config, opaque_gemm=fp8_call_is_opaque(args.sglang_package))
        sizes = piecewise_model.prefill_sizes(getattr(args, "sglang_server_args", {}) or {})
        log("Capture piecewise cuda graph begin. This can take up to several minutes.")
        model.capture(sizes, log)  # raises as the real server does
        log("Capture piecewise cuda graph end.")
    elif args.enable_piecewise_cuda_graph and fp8:
        capture_fp8_linear(fp8_call_is_opaque(args.sglang_package))  # raises as the real server does
    elif args.enable_piecewise_cuda_graph:
        capture_piecewise_cuda_graph()  # raises, with the real traceback, on an unpatched flashinfer
    elif whole:
        model = piecewise_model.PiecewiseModel(config, opaque_gemm=False)  # eager
    arg = _server_args(args)
    crash = crash_region(args, os.environ.get("SGLANG_DOUBLE_CRASH_IF", ""))
    per_bs = float(os.environ.get("SGLANG_DOUBLE_CAPTURE_PER_BS", "0") or 0)
    if (per_bs or crash) and not arg("disable_cuda_graph", bool):
        log("Capture cuda graph begin. This can take up to several minutes. avail mem=12.25 GB")
        t0 = time.monotonic()
        time.sleep(per_bs * len(capture_sizes(int(arg("cuda_graph_max_bs", int) or 256))))
        if crash:
            log(f"capture crash: {crash}")
            print(CAPTURE_OOM, flush=True)
            sys.exit(1)
        log(f"Capture cuda graph end. Time elapsed: {time.monotonic() - t0:.2f} s. mem usage=0.75 GB. "
            "avail mem=11.49 GB.")
    elif crash:
        print(CAPTURE_OOM, flush=True)
        sys.exit(1)
    double = Double(args)
    double.forward_model = model
    app = web.Application()
    routes = double.shape["routes"]
    handlers = {"/health": double.health, "/health_generate": double.health, "/model_info": double.model_info,
                "/get_model_info": double.model_info, "/server_info": double.server_info,
                "/get_server_info": double.server_info}
    for path, handler in handlers.items():
        if path in routes:
            app.router.add_get(path, handler)
    if args.enable_metrics or args.parser == "double":
        app.router.add_get("/metrics", double.metrics)
    app.add_routes([web.post("/v1/completions", double.completions),
                    web.post("/generate", double.generate), web.route("*", "/flush_cache", double.flush_cache)])
    log(f"Uvicorn running on http://{args.host}:{args.port} (double)")
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, backlog=2048)


if __name__ == "__main__":
    main()
