"""servops' load generator side by side with SGLang's real bench_serving, against the same double.

Builds (once, cached under ~/.cache/servops-tests) a venv with sglang 0.5.23's bench_serving
(servops.lab.venvs.build_bench_serving_venv), a word-level tokenizer saved as a Hugging Face
tokenizer directory, and a local ShareGPT-format file for bench_serving's --dataset-path (its
random dataset samples prompt text from it: without one it tries to download ShareGPT, and a
short file silently sends fewer prompts). Then:

1. Both tools against one SGLang double (TTFT 50 ms, 10 ms per token), 128 tokens in, 64 out,
   levels 1/10/256/1024 with 16/20/512/2048 requests, interleaved, twice (the second round in the
   other order). Both tools run on the same venv python (same aiohttp); bench_serving as
   `--backend sglang-oai --dataset-name random --random-range-ratio 1`, servops with the same
   tokenizer. Side by side: each tool's numbers (mean of the rounds), relative differences, the
   achieved concurrency, the client CPU per request, and the TCP connections each tool opened.
2. Client overhead: both against an instant server (another process): maximum request rate and
   client CPU per request at 256 concurrent streams.
3. bench_serving's JSONL key list, read from the installed serving.py, against servops' lines.

The last line is `max deviation at levels 1,10: X%` (goal: X <= 5).
Usage: python bench/parity_bench_serving.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LEVELS = ((1, 16), (10, 20), (256, 512), (1024, 2048))
INPUT_LEN, OUTPUT_LEN = 128, 64
TTFT_S, TOKEN_S = 0.05, 0.01
COMPARED = (("request_throughput", "req/s"), ("output_throughput", "output tok/s"), ("mean_ttft_ms", "TTFT mean ms"),
            ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"), ("median_tpot_ms", "TPOT p50 ms"),
            ("median_itl_ms", "ITL p50 ms"), ("p99_itl_ms", "ITL p99 ms"), ("median_e2e_latency_ms", "e2e p50 ms"))
# what "agree at levels 1 and 10" is judged on (p99 of 16-20 requests is one request: shown, not judged)
JUDGED = ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "median_tpot_ms",
          "median_itl_ms", "median_e2e_latency_ms")


# ------------------------------------------------------------------------------ drivers (run in the venv)

def driver_bench_serving(argv: list[str]) -> None:
    """Run bench_serving's CLI; report the CPU this process spent inside benchmark() (not imports,
    tokenizer loading or the dataset)."""
    import asyncio
    import warnings

    warnings.filterwarnings("ignore")
    import sglang.benchmark.serving as s

    orig = s.benchmark
    spent = {}

    async def timed(*a, **kw):
        t0, w0 = time.process_time(), time.perf_counter()
        try:
            return await orig(*a, **kw)
        finally:
            spent["cpu_s"], spent["wall_s"] = time.process_time() - t0, time.perf_counter() - w0

    s.benchmark = timed
    sys.argv = ["bench_serving"] + argv
    s.cli_main()
    del asyncio
    print("PARITY " + json.dumps(spent), flush=True)


def driver_servops(spec: dict) -> None:
    """servops' load generator (the code the host runs), one level; CPU inside the level run."""
    import asyncio

    from servops.remote import loadgen

    tok = loadgen.Tokenizer(spec["tokenizer"]) if spec.get("tokenizer") else None
    reqs = loadgen.make_requests({"kind": "random", "input_len": spec["input_len"], "output_len": spec["output_len"],
                                  "range_ratio": 1.0}, spec["requests"], spec["seed"], tok)
    t0, w0 = time.process_time(), time.perf_counter()
    records, duration, info = asyncio.run(loadgen.run_level(
        spec["base"], reqs, spec["level"], "default", "/v1/completions", None, 1.0, spec["seed"], warmup=1,
        flush=False, monitor=spec.get("monitor", True)))
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    line = loadgen.calculate(records, duration, {"request_rate": float("inf"), "max_concurrency": spec["level"],
                                                 "input_len": spec["input_len"], "output_len": spec["output_len"],
                                                 "range_ratio": 1.0})
    for k in ("itls", "ttfts", "generated_texts", "input_lens", "output_lens"):
        line.pop(k)
    line["errors"] = [e for e in line["errors"] if e][:5]
    print("PARITY " + json.dumps({"cpu_s": cpu, "wall_s": wall, "line": line}), flush=True)


# ------------------------------------------------------------------------------ set-up

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


TOKENIZER_SRC = r'''
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
words = json.loads(sys.argv[2])
vocab = {"[UNK]": 0}
for w in words:
    vocab.setdefault(w, len(vocab))
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
tok.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "model_max_length": 1000000,
    "clean_up_tokenization_spaces": False}))
(out / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
print(len(vocab))
'''


def make_inputs(py: str, work: Path) -> tuple[Path, Path]:
    """A word-level tokenizer directory and a ShareGPT-format file whose text it covers."""
    import random

    from servops.remote.loadgen import WORDS

    tok_dir, share = work / "tokenizer", work / "sharegpt.json"
    words = list(WORDS) + [f"w{i}" for i in range(4000)] + [f"tok{i}" for i in range(4096)]
    if not (tok_dir / "tokenizer.json").exists():
        subprocess.run([py, "-c", TOKENIZER_SRC, str(tok_dir), json.dumps(words)], check=True, stdout=subprocess.DEVNULL)
    if not share.exists():
        rnd = random.Random(0)
        rows = [{"id": str(i), "conversations": [
            {"from": "human", "value": " ".join(rnd.choice(words[:4019]) for _ in range(rnd.randint(40, 300)))},
            {"from": "gpt", "value": " ".join(rnd.choice(words[:4019]) for _ in range(rnd.randint(20, 200)))}]}
            for i in range(3000)]  # more rows than the largest level's requests
        share.write_text(json.dumps(rows))
    return tok_dir, share


def start_double(py: str, port: int, work: Path, **env) -> subprocess.Popen:
    full = dict(os.environ, SGLANG_DOUBLE_LOAD_TIME="0", **{f"SGLANG_DOUBLE_{k}": str(v) for k, v in env.items()})
    log = open(work / f"double-{port}.log", "w")
    proc = subprocess.Popen([py, str(REPO / "servops" / "lab" / "sglang_double.py"), "--model-path", str(work / "tokenizer"),
                             "--port", str(port)], env=full, stdout=log, stderr=subprocess.STDOUT)
    wait_port(port)
    return proc


INSTANT_SRC = r'''
# An instant /v1/completions: raw asyncio HTTP/1.1 (keep-alive), 4 streamed tokens and, when asked,
# the usage chunk. Cheap enough per request that the client, not the server, sets the pace.
import asyncio, re, sys
TOKENS = b'data: {"choices": [{"index": 0, "text": " x", "finish_reason": null}]}\n\n' * 4
USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": 4, "total_tokens": 20}}\n\n'
DONE = b"data: [DONE]\n\n"
CL = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")

def reply(body):
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

PLAIN, WITH_USAGE = reply(TOKENS + DONE), reply(TOKENS + USAGE + DONE)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"

class Http(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            m = CL.search(self.buf, 0, end + 2)
            n = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + n:
                return
            head, body = self.buf[:end], self.buf[end + 4:end + 4 + n]
            self.buf = self.buf[end + 4 + n:]
            if b" /v1/completions" in head[:40]:
                self.t.write(WITH_USAGE if b"include_usage" in body else PLAIN)
            else:
                self.t.write(NOT_FOUND)

async def main(port):
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Http, "127.0.0.1", port, backlog=4096)
    await server.serve_forever()

asyncio.run(main(int(sys.argv[1])))
'''


def start_instant(py: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([py, "-c", INSTANT_SRC, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc


def active_opens() -> int:
    """The kernel's count of TCP connections this machine opened (/proc/net/snmp Tcp ActiveOpens)."""
    lines = [l.split() for l in Path("/proc/net/snmp").read_text().splitlines() if l.startswith("Tcp:")]
    return int(lines[1][lines[0].index("ActiveOpens")])


def connections_during(port: int, fn):
    """fn()'s result and the TCP connections opened while it ran (the client's, on an idle machine;
    the driver's own start-up opens none)."""
    before = active_opens()
    res = fn()
    return res, active_opens() - before


def run_driver(py: str, args: list[str], timeout: int = 900) -> dict:
    res = subprocess.run([py, "-W", "ignore", str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=str(REPO))
    for line in res.stdout.splitlines()[::-1]:
        if line.startswith("PARITY "):
            return json.loads(line[7:])
    raise SystemExit(f"driver failed ({args[:2]}): {res.stderr[-3000:]}{res.stdout[-1500:]}")


def run_bench_serving(py: str, port: int, level: int, n: int, tok: Path, share: Path, work: Path,
                      input_len: int = INPUT_LEN, output_len: int = OUTPUT_LEN) -> dict:
    out = work / f"bs-{level}-{n}-{time.time_ns()}.jsonl"
    argv = ["--backend", "sglang-oai", "--host", "127.0.0.1", "--port", str(port), "--model", str(tok),
            "--tokenizer", str(tok), "--dataset-name", "random", "--dataset-path", str(share),
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--random-range-ratio", "1.0",
            "--num-prompts", str(n), "--max-concurrency", str(level), "--request-rate", "inf",
            "--warmup-requests", "1", "--output-file", str(out), "--disable-tqdm", "--ready-check-timeout-sec", "0",
            "--seed", "42"]
    spent = run_driver(py, ["--driver", "bench_serving", *argv])
    line = json.loads(out.read_text().splitlines()[-1])
    return {"cpu_s": spent["cpu_s"], "wall_s": spent["wall_s"], "line": line}


def run_servops(py: str, port: int, level: int, n: int, tok: Path | None, input_len: int = INPUT_LEN,
                output_len: int = OUTPUT_LEN, monitor: bool = True) -> dict:
    spec = {"base": f"http://127.0.0.1:{port}", "level": level, "requests": n, "input_len": input_len,
            "output_len": output_len, "seed": 42, "tokenizer": str(tok) if tok else None, "monitor": monitor}
    return run_driver(py, ["--driver", "servops", json.dumps(spec)])


def bench_serving_keys(py: str) -> list[str]:
    """bench_serving's result keys in order, read from the installed sglang's serving.py."""
    src = subprocess.run([py, "-c", "import sglang.benchmark.serving as s; print(s.__file__)"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONWARNINGS="ignore")).stdout.strip().splitlines()[-1]
    tree = ast.parse(Path(src).read_text())
    bench = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "benchmark")
    keys = {}
    for node in ast.walk(bench):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if names and names[0] in ("result", "result_details"):
                keys[names[0]] = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    return keys["result"] + keys["result_details"]


# ------------------------------------------------------------------------------ report

def rel(a: float | None, b: float | None) -> float | None:
    if a in (None, 0) or b is None:
        return None
    return (b - a) / a * 100.0


def fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def mean_of(runs: list[dict], key: str) -> float | None:
    vals = [r["line"].get(key) for r in runs if r["line"].get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="levels 1 and 10 only")
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    opts, rest = ap.parse_known_args()
    if opts.driver == "bench_serving":
        return driver_bench_serving(rest)
    if opts.driver == "servops":
        return driver_servops(json.loads(rest[0]))

    from servops.lab.venvs import CACHE, build_bench_serving_venv

    venv = build_bench_serving_venv(log=lambda m: print(m, flush=True))
    py = str(venv / "bin" / "python")
    work = CACHE / "parity"
    work.mkdir(parents=True, exist_ok=True)
    tok, share = make_inputs(py, work)
    runs_dir = Path(tempfile.mkdtemp(prefix="parity-", dir=work))
    levels = LEVELS[:2] if opts.quick else LEVELS
    print(f"bench_serving venv: {venv}\ntokenizer: {tok}\nShareGPT file: {share}\n", flush=True)

    # 1. both tools, same double, same levels, interleaved, twice
    port = free_port()
    double = start_double(py, port, runs_dir, TTFT=TTFT_S, TOKEN_DELAY=TOKEN_S)
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        for rnd in range(opts.rounds):
            for level, n in levels:
                order = ("bench_serving", "servops") if rnd % 2 == 0 else ("servops", "bench_serving")
                for tool in order:
                    time.sleep(1.0)
                    if tool == "bench_serving":
                        r, conns = connections_during(port, lambda: run_bench_serving(py, port, level, n, tok, share, runs_dir))
                    else:
                        r, conns = connections_during(port, lambda: run_servops(py, port, level, n, tok))
                    r["connections"] = conns
                    results.setdefault((tool, level), []).append(r)
                    ln = r["line"]
                    print(f"round {rnd + 1} level {level:>4} {tool:>13}: {ln['completed']}/{n} ok, "
                          f"{ln['output_throughput']:.1f} tok/s, TTFT p50 {ln['median_ttft_ms']:.1f} ms, "
                          f"{r['cpu_s'] / n * 1000:.2f} ms CPU/request, {conns} connections", flush=True)
    finally:
        double.terminate()
        double.wait(10)

    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    t = Table(title=f"side by side: the double at TTFT {TTFT_S * 1000:g} ms, {TOKEN_S * 1000:g} ms/token; "
                    f"{INPUT_LEN} in, {OUTPUT_LEN} out; mean of {opts.rounds} rounds", title_justify="left")
    for c in ("level", "metric", "bench_serving", "servops", "Δ servops"):
        t.add_column(c)
    max_dev = 0.0
    max_at = ""
    for level, n in levels:
        bs, so = results[("bench_serving", level)], results[("servops", level)]
        for key, label in COMPARED:
            a, b = mean_of(bs, key), mean_of(so, key)
            d = rel(a, b)
            if level in (1, 10) and key in JUDGED and d is not None and abs(d) > max_dev:
                max_dev, max_at = abs(d), f"{label} at level {level}"
            t.add_row(str(level), label, fmt(a), fmt(b), "-" if d is None else f"{d:+.1f}%")
        a, b = mean_of(bs, "concurrency"), mean_of(so, "concurrency")
        t.add_row(str(level), "achieved concurrency", fmt(a), fmt(b), "-" if rel(a, b) is None else f"{rel(a, b):+.1f}%")
        ca = sum(r["cpu_s"] for r in bs) / (n * len(bs)) * 1000
        cb = sum(r["cpu_s"] for r in so) / (n * len(so)) * 1000
        t.add_row(str(level), "client CPU ms/request", fmt(ca, 3), fmt(cb, 3), f"{rel(ca, cb):+.1f}%")
        ka = sum(r["connections"] for r in bs) / len(bs)
        kb = sum(r["connections"] for r in so) / len(so)
        t.add_row(str(level), "TCP connections opened", f"{ka:.0f}", f"{kb:.0f}", "-", end_section=True)
    con.print(t)

    print("\nwhy 256 and 1024 differ (measured above, per level):")
    for level, n in levels:
        if level < 256:
            continue
        bs, so = results[("bench_serving", level)], results[("servops", level)]
        wall_a = sum(r["wall_s"] for r in bs) / len(bs)
        cpu_a = sum(r["cpu_s"] for r in bs) / len(bs)
        wall_b = sum(r["wall_s"] for r in so) / len(so)
        cpu_b = sum(r["cpu_s"] for r in so) / len(so)
        print(f"  level {level}: bench_serving opened {sum(r['connections'] for r in bs) / len(bs):.0f} TCP connections "
              f"for {n} requests (a new aiohttp session per request), servops "
              f"{sum(r['connections'] for r in so) / len(so):.0f} (pooled keep-alive); client CPU "
              f"{cpu_a:.1f} s of {wall_a:.1f} s wall ({cpu_a / wall_a * 100:.0f}% of a core) vs {cpu_b:.1f} s of "
              f"{wall_b:.1f} s ({cpu_b / wall_b * 100:.0f}%), on {os.cpu_count()} cores shared with the double; "
              f"achieved concurrency {mean_of(bs, 'concurrency'):.0f} vs {mean_of(so, 'concurrency'):.0f} of {level}")

    # 2. client overhead against an instant server
    print("\nclient overhead: both tools against an instant server (another process), 256 streams, "
          "2048 requests of 16 tokens in / 4 out", flush=True)
    iport = free_port()
    instant = start_instant(py, iport)
    try:
        time.sleep(0.5)
        bs = run_bench_serving(py, iport, 256, 2048, tok, share, runs_dir, input_len=16, output_len=4)
        so = run_servops(py, iport, 256, 2048, tok, input_len=16, output_len=4, monitor=False)
    finally:
        instant.terminate()
        instant.wait(10)
    ra, rb = bs["line"]["request_throughput"], so["line"]["request_throughput"]
    print(f"  bench_serving: {ra:.0f} req/s, {bs['cpu_s'] / 2048 * 1000:.3f} ms CPU per request")
    print(f"  servops:       {rb:.0f} req/s, {so['cpu_s'] / 2048 * 1000:.3f} ms CPU per request")
    print(f"  servops' maximum request rate = {rb / ra:.2f}x bench_serving's (goal >= 4x: "
          f"{'met' if rb >= 4 * ra else 'NOT met'})")

    # 3. key set
    keys = bench_serving_keys(py)
    ours = [k for k in json.loads((REPO / "tests" / "fixtures" / "bench_serving_keys_0.5.23.json").read_text())["result"]]
    print(f"\nbench_serving JSONL keys read from the installed serving.py: {len(keys)}; "
          f"servops' fixture agrees: {keys[:len(ours)] == ours}")
    print(f"(largest judged difference: {max_at or 'none'})")
    print(f"max deviation at levels 1,10: {max_dev:.1f}%")


if __name__ == "__main__":
    main()
