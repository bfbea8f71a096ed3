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
Server args the model reads: --cuda-graph-max-bs (256), --disable-cuda-graph,
--max-running-requests (no cap), --mem-fraction-static (0.9): KV cache = GPU_TOKENS x
(mem-fraction-static - WEIGHTS_FRACTION) tokens; a request holds prompt + max_tokens of it.
TOKEN_DELAY and STEP_PER_SEQ both 0: an instant server (every token at once after TTFT).

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
from collections import deque

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
        pacer.active += 1
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
                elif i == 0 and pacer.ttft:
                    await asyncio.sleep(pacer.ttft)
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
            return web.json_response({"text": text, "output_ids": list(range(n)), "meta_info": meta(n, True)})
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
        if not self.paced:
            return f"instant (TTFT {self.ttft * 1000:g} ms)"
        cap = self.max_running if self.max_running else "none"
        return (f"batched: TTFT {self.ttft * 1000:g} ms + {self.prefill_per_token * 1000:g} ms/prompt token, decode step "
                f"{self.token_delay * 1000:g} ms + {self.step_per_seq * 1000:g} ms/seq (x{self.eager_factor:g} above "
                f"cuda-graph-max-bs {self.graph_max_bs}{', always: --disable-cuda-graph' if self.eager_always else ''}), "
                f"max running {cap}, KV cache {self.kv_capacity} tokens (mem-fraction-static {self.mem_fraction:g})")

    def step_time(self, batch: int) -> float:
        t = self.token_delay + self.step_per_seq * batch
        if self.eager_always or batch > self.graph_max_bs:
            t *= self.eager_factor
        return t

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
            loop.call_later(self.ttft + self.prefill_per_token * (seq.need - seq.n), self._prefilled, seq)

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
                    web.post("/generate", double.generate), web.route("*", "/flush_cache", double.flush_cache)])
    log(f"Uvicorn running on http://{args.host}:{args.port} (double)")
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, backlog=2048)


if __name__ == "__main__":
    main()
