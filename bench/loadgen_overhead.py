"""The load generator's own cost, against an instant-response local server.

At 1024 concurrent streams: p99 of the time the client spends in its own code per request
(building the request, parsing the SSE stream, bookkeeping) -- goal < 1 ms -- and the maximum
request rate it sustains. The server runs in another process so it does not share the event loop.

bench/parity_bench_serving.py compares this with sglang's real bench_serving client.
Usage: python bench/loadgen_overhead.py [REQUESTS]
"""

import asyncio
import json
import multiprocessing
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from servops.remote.loadgen import calculate, pct, run_level  # noqa: E402


def serve(port: int) -> None:
    from aiohttp import web

    chunk = b'data: {"choices": [{"index": 0, "text": " x"}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}\n\n'

    async def completions(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        tail = usage if (body.get("stream_options") or {}).get("include_usage") else b""
        await resp.write(chunk * 4 + tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


def main(requests: int = 8192, concurrency: int = 1024):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.Process(target=serve, args=(port,), daemon=True)
    server.start()
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        req = lambda p: {"prompt": p, "prompt_len": 2, "output_len": 4}
        asyncio.run(run_level(base, [req("warm up")] * 256, 64, monitor=False))
        records, duration, _info = asyncio.run(run_level(base, [req("hello world")] * requests, concurrency,
                                                         monitor=False))
    finally:
        server.terminate()
    summary = calculate(records, duration, {"request_rate": float("inf"), "max_concurrency": concurrency})
    client_ms = [r["client_s"] * 1000 for r in records if r["ok"]]
    print(f"{summary['completed']}/{requests} requests at concurrency {concurrency} in {duration:.2f}s")
    print(f"max request rate: {summary['request_throughput']:.0f} req/s (instant server, both on this machine)")
    print(f"client overhead per request: p50 {pct(client_ms, 50):.3f} ms, p99 {pct(client_ms, 99):.3f} ms "
          f"(goal p99 < 1 ms: {'met' if pct(client_ms, 99) < 1.0 else 'NOT met'})")
    print(json.dumps({"p99_ms": pct(client_ms, 99), "request_rate": summary["request_throughput"]}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8192)
