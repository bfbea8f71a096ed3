# The load generator: asyncio + aiohttp, streaming /v1/completions like sglang's bench_serving.
# Runs on the host (shipped over stdin), so 1024 streams don't squeeze through one SSH channel;
# bench/loadgen_overhead.py imports the same code locally. Needs aiohttp on that python
# (SGLang's environment has it).
import asyncio
import json
import sys
import random
import statistics
import time

WORDS = ("the quick brown fox jumps over a lazy dog while servers stream tokens at scale "
         "under load with many concurrent requests").split()


def make_prompts(n, input_len, dataset, seed=0):
    rnd = random.Random(seed)
    if dataset and dataset != "random":
        out = []
        for line in dataset.splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                obj = json.loads(line)
                line = obj.get("prompt") or obj.get("text") or ""
            out.append(line)
        if not out:
            raise ValueError("dataset has no prompts")
        return [out[i % len(out)] for i in range(n)]
    return [" ".join(rnd.choice(WORDS) for _ in range(input_len)) for _ in range(n)]


def pct(values, q):
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(session, url, prompt, output_len, model):
    # client_s: time spent in this function's own work (building, parsing, bookkeeping), which
    # is what the load generator adds to every latency it reports.
    t0 = time.perf_counter()
    rec = {"ok": False, "ttft": None, "itl": [], "e2e": None, "output_tokens": 0, "error": None, "client_s": 0.0}
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
               "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    rec["client_s"] += start - t0
    last = None
    usage_tokens = None
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                rec["error"] = "HTTP %d" % resp.status
                return rec
            buf = b""
            async for chunk in resp.content.iter_any():
                t_chunk = time.perf_counter()
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        obj = json.loads(data)
                        if obj.get("usage") and obj["usage"].get("completion_tokens"):
                            usage_tokens = obj["usage"]["completion_tokens"]
                        choices = obj.get("choices") or []
                        if choices and choices[0].get("text"):
                            now = time.perf_counter()
                            if last is None:
                                rec["ttft"] = now - start
                            else:
                                rec["itl"].append(now - last)
                            last = now
                            rec["output_tokens"] += 1
                rec["client_s"] += time.perf_counter() - t_chunk
        rec["e2e"] = time.perf_counter() - start
        if usage_tokens:
            rec["output_tokens"] = usage_tokens
        rec["ok"] = rec["output_tokens"] > 0
        if not rec["ok"]:
            rec["error"] = "no tokens streamed"
    except Exception as exc:  # connection refused/reset: the server went away
        rec["error"] = "%s: %s" % (type(exc).__name__, exc)
    return rec


def summarize(level, records, duration):
    ok = [r for r in records if r["ok"]]
    itl = [x for r in ok for x in r["itl"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2e = [r["e2e"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    errors = {}
    for r in records:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    ms = lambda v: None if v is None else v * 1000.0
    return {
        "concurrency": level, "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration, "request_rate": len(ok) / duration if duration else 0.0,
        "output_tps": out_tokens / duration if duration else 0.0, "output_tokens": out_tokens,
        "ttft_p50": ms(pct(ttft, 50)), "ttft_p99": ms(pct(ttft, 99)), "ttft_mean": ms(statistics.fmean(ttft)) if ttft else None,
        "itl_p50": ms(pct(itl, 50)), "itl_p99": ms(pct(itl, 99)), "itl_mean": ms(statistics.fmean(itl)) if itl else None,
        "e2e_p50": ms(pct(e2e, 50)), "e2e_p99": ms(pct(e2e, 99)), "errors": errors,
    }


async def run_level(url, prompts, output_len, level, model, progress=None):
    import aiohttp
    queue = list(enumerate(prompts))
    records = [None] * len(prompts)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    done = [0]
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def worker():
            while queue:
                i, prompt = queue.pop()
                records[i] = await one_request(session, url, prompt, output_len, model)
                done[0] += 1
                if progress:
                    progress(level, done[0], len(prompts))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(level, len(prompts)))))
        duration = time.perf_counter() - start
    return records, duration


def bench(url, levels, requests, input_len, output_len, dataset=None, model="default", progress=None):
    results = []
    for level in levels:
        n = requests or max(2 * level, 16)
        prompts = make_prompts(n, input_len, dataset, seed=level)
        records, duration = asyncio.run(run_level(url, prompts, output_len, level, model, progress))
        summary = summarize(level, records, duration)
        results.append(summary)
        if summary["completed"] == 0 or summary["failed"] * 2 > summary["requests"]:
            break  # the server is gone; keep what was measured
    return results


if __name__ == "__main__":
    last_report = [0.0]

    def report(level, done, total):
        now = time.time()
        if now - last_report[0] > 0.5 or done == total:
            last_report[0] = now
            sys.stdout.write(json.dumps({"progress": done, "total": total, "level": level}) + "\n")
            sys.stdout.flush()

    try:
        import aiohttp  # noqa: F401
    except ImportError:
        fail("the load generator needs aiohttp in the host's python (%s)" % sys.executable)
    url = "http://127.0.0.1:%d/v1/completions" % int(ARGS["port"])
    results = bench(url, ARGS["levels"], ARGS.get("requests", 0), ARGS.get("input_len", 128),
                    ARGS.get("output_len", 128), ARGS.get("dataset"), ARGS.get("model", "default"), report)
    reply({"site": [], "levels": results})
