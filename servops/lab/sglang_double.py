"""A stand-in for `python -m sglang.launch_server` where no GPU exists (tests, the lab).

Accepts SGLang's flags, serves /health, /get_model_info, /metrics (SGLang's metric names, via
prometheus-client), /v1/completions (streaming or not) and /generate. Behaviour knobs, from the
environment: SGLANG_DOUBLE_LOAD_TIME (seconds before healthy), SGLANG_DOUBLE_TOKEN_DELAY (seconds
per generated token), SGLANG_DOUBLE_TTFT (seconds before the first token),
SGLANG_DOUBLE_NEVER_HEALTHY=1 (serve /health 503 forever), SGLANG_DOUBLE_BROKEN_METRICS=1 (serve
text that is not Prometheus exposition), SGLANG_DOUBLE_EXIT_AFTER_REQUESTS=N (die, as a crashed
server does, once N requests have started).

With --enable-piecewise-cuda-graph it really runs the dynamo trace SGLang's capture hits:
torch.compile(fullgraph=True) over flashinfer.jit.cpp_ext.is_cuda_version_at_least on the host's
own flashinfer file, so an unpatched venv crashes with the real torch._dynamo traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
import types

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def log(msg: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="sglang_double")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1)
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=160)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    # Every other SGLang flag is accepted and ignored: (--quantization, --attention-backend, ...)
    args, rest = p.parse_known_args(argv)
    return args, rest


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


class Double:
    def __init__(self, args):
        self.args = args
        self.load_time = float(os.environ.get("SGLANG_DOUBLE_LOAD_TIME", "0.5"))
        self.token_delay = float(os.environ.get("SGLANG_DOUBLE_TOKEN_DELAY", "0.0"))
        self.ttft = float(os.environ.get("SGLANG_DOUBLE_TTFT", "0.0"))
        self.never_healthy = os.environ.get("SGLANG_DOUBLE_NEVER_HEALTHY") == "1"
        self.broken_metrics = os.environ.get("SGLANG_DOUBLE_BROKEN_METRICS") == "1"
        self.exit_after = int(os.environ.get("SGLANG_DOUBLE_EXIT_AFTER_REQUESTS", "0"))
        self.started_requests = 0
        self.ready_at = time.monotonic() + self.load_time
        self.started = time.time()
        reg = self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.running = Gauge("sglang:num_running_reqs", "Running requests", labels, registry=reg)
        self.queued = Gauge("sglang:num_queue_reqs", "Queued requests", labels, registry=reg)
        self.token_usage = Gauge("sglang:token_usage", "KV cache token usage", labels, registry=reg)
        self.gen_tps = Gauge("sglang:gen_throughput", "Generation throughput (token/s)", labels, registry=reg)
        self.hit_rate = Gauge("sglang:cache_hit_rate", "Prefix cache hit rate", labels, registry=reg)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens", labels, registry=reg)
        self.gen_tokens = Counter("sglang:generation_tokens", "Generated tokens", labels, registry=reg)
        self.requests = Counter("sglang:num_requests", "Requests", labels, registry=reg)
        self.ttft_h = Histogram("sglang:time_to_first_token_seconds", "TTFT", labels, buckets=LATENCY_BUCKETS, registry=reg)
        self.itl_h = Histogram("sglang:inter_token_latency_seconds", "ITL", labels, buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e_h = Histogram("sglang:e2e_request_latency_seconds", "E2E", labels, buckets=LATENCY_BUCKETS, registry=reg)
        self.model = os.path.basename(args.model_path.rstrip("/")) or args.model_path
        self._window: list[tuple[float, int]] = []
        self.hit_rate.labels(self.model).set(0.0)

    def ready(self) -> bool:
        return not self.never_healthy and time.monotonic() >= self.ready_at

    async def health(self, request):
        if not self.ready():
            return web.Response(status=503, text="loading")
        return web.Response(text="ok")

    async def model_info(self, request):
        if not self.ready():
            return web.json_response({"error": "loading"}, status=503)
        return web.json_response({"model_path": self.args.model_path, "tokenizer_path": self.args.model_path,
                                  "is_generation": True, "tp_size": self.args.tp,
                                  "piecewise_cuda_graph": self.args.enable_piecewise_cuda_graph})

    async def metrics(self, request):
        if self.broken_metrics:
            return web.Response(text='sglang:num_running_reqs{model_name="x" 3\n{{not prometheus', content_type="text/plain")
        now = time.monotonic()
        self._window = [(t, n) for t, n in self._window if now - t < 5]
        self.gen_tps.labels(self.model).set(sum(n for _, n in self._window) / 5.0)
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _tokens(self, n: int):
        """Yield token texts at the configured pace, recording SGLang's latency metrics."""
        m = self.model
        self.started_requests += 1
        if self.exit_after and self.started_requests > self.exit_after:
            log(f"simulated crash after {self.exit_after} requests")
            os._exit(1)
        start = time.monotonic()
        self.running.labels(m).inc()
        self.requests.labels(m).inc()
        try:
            last = start
            for i in range(n):
                delay = self.ttft if i == 0 else self.token_delay
                if delay:
                    await asyncio.sleep(delay)
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
            self.running.labels(m).dec()

    async def completions(self, request):
        if not self.ready():
            return web.json_response({"error": "loading"}, status=503)
        body = await request.json()
        n = int(body.get("max_tokens", 16))
        prompt = body.get("prompt", "")
        self.prompt_tokens.labels(self.model).inc(max(1, len(str(prompt).split())))
        if not body.get("stream"):
            text = "".join([t async for t in self._tokens(n)])
            return web.json_response({"id": "cmpl-double", "object": "text_completion", "model": self.model,
                                      "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                      "usage": {"completion_tokens": n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for tok in self._tokens(n):
            chunk = {"id": "cmpl-double", "object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": tok, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def generate(self, request):
        if not self.ready():
            return web.json_response({"error": "loading"}, status=503)
        body = await request.json()
        n = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        text = "".join([t async for t in self._tokens(n)])
        return web.json_response({"text": text, "meta_info": {"completion_tokens": n}})


def main(argv=None):
    args, ignored = parse_args(sys.argv[1:] if argv is None else argv)
    log(f"server_args: {vars(args)} (ignored flags: {' '.join(ignored) or 'none'})")
    log(f"Load weight begin (double of {args.model_path}, tp={args.tp}, node_rank={args.node_rank}/{args.nnodes})")
    if args.enable_piecewise_cuda_graph:
        capture_piecewise_cuda_graph()  # raises, with the real traceback, on an unpatched flashinfer
    double = Double(args)
    app = web.Application()
    app.add_routes([web.get("/health", double.health), web.get("/get_model_info", double.model_info),
                    web.get("/metrics", double.metrics), web.post("/v1/completions", double.completions),
                    web.post("/generate", double.generate)])
    log(f"Uvicorn running on http://{args.host}:{args.port} (double)")
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, backlog=2048)


if __name__ == "__main__":
    main()
