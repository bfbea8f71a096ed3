"""A hostile inference server for servops' tests (issue 18, items 6 and 7).

The lab double's sglang (/health, /model_info, /metrics, /flush_cache, its flags), but
/v1/completions and /generate stream what a broken or malicious server could: impossible token
counts, NaN, values of the wrong type, a 20 MB token, a 64 MB event that never ends, and -- the
control -- an honest server batching several tokens per chunk as sglang's --stream-interval does.

Shipped to a lab host beside sglang_double.py through the inventory's `server_files`
(`server_module: hostile_server`). The mode is read per request from the file that
$HOSTILE_MODE_FILE names, so one deploy serves every mode; no file (or `honest`): the double.
"""

from __future__ import annotations

import itertools
import json
import os

from aiohttp import web

import sglang_double

# usage.completion_tokens as the server writes it (raw JSON text, so NaN stays NaN)
BAD_COUNTS = {"negative": "-1000000", "huge": "1" + "0" * 30, "nan": "NaN", "infinity": "Infinity",
              "string": '"twelve"', "list": "[4]", "too-few": "2"}
MB = 1 << 20


def mode() -> str:
    try:
        with open(os.environ["HOSTILE_MODE_FILE"]) as fh:
            return fh.read().strip() or "honest"
    except (KeyError, OSError):
        return "honest"


def event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(text: str) -> bytes:
    return event({"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]})


def usage(count: str) -> bytes:
    return event(('{"object": "text_completion", "choices": [], "usage": {"prompt_tokens": 3, '
                  '"completion_tokens": %s, "total_tokens": 7}}' % count).encode())


class Hostile(sglang_double.Double):
    def __init__(self, args):
        super().__init__(args)
        self.seen = itertools.count()

    async def _stream(self, request, parts) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for part in parts:
                await resp.write(part)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client gave up on the stream: as it should
            pass
        return resp

    async def completions(self, request):
        how, nth = mode(), next(self.seen)
        if how == "half-nan":  # every other request: one bad usage chunk among good ones
            how = "nan" if nth % 2 else "honest"
        if how == "honest":
            return await super().completions(request)
        n = int((await request.json()).get("max_tokens", 16))
        if how in BAD_COUNTS:
            return await self._stream(request, [chunk(f" tok{i}") for i in range(4)] + [usage(BAD_COUNTS[how])])
        if how == "usage-list":
            return await self._stream(request, [chunk(" a"), event(b'{"choices": [], "usage": [1, 2]}')])
        if how == "event-list":
            return await self._stream(request, [chunk(" a"), event(b"[1, 2]")])
        if how == "batched":  # honest: 4 tokens per chunk (sglang --stream-interval 4)
            return await self._stream(request, [chunk(" tok" * min(4, n - i)) for i in range(0, n, 4)]
                                      + [usage(str(n))])
        if how == "big-token":
            return await self._stream(request, [chunk(" " + "x" * (20 * MB)), usage("1")])
        if how == "no-separator":
            head = b'data: {"choices": [{"index": 0, "text": "'
            return await self._stream(request, [head] + [b"x" * MB] * 64)
        raise web.HTTPBadRequest(text=f"unknown hostile mode {how!r}")

    async def generate(self, request):
        how = mode()
        if how == "honest":
            return await super().generate(request)
        counts = {"gen-huge": [1, 2, 10 ** 30], "gen-back": [1, 3, 2]}[how]
        return await self._stream(request, [event({"text": " tok" * (i + 1), "meta_info": {
            "prompt_tokens": 3, "completion_tokens": c}}) for i, c in enumerate(counts)])


sglang_double.Double = Hostile  # main() builds the app around whichever Double this names

if __name__ == "__main__":
    sglang_double.main()
