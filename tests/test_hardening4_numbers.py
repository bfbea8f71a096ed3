"""Red team round 4 (issue 18), the numbers: hostile server output never becomes a result.

Items 6 and 7 run the bench against a hostile server (tests/hostile/hostile_server.py, shipped
to the lab host with the inventory's server_files), over the real sshd lab; the loadgen's
per-request accounting is also checked on crafted SSE bytes. Items 9, 12, 13 and 14 run the
real CLI against the lab; 10 and 16 are pure parsing, through the loaders and the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, one_line_error, playbooks_with, root_of, run_invoke
from servops.bench import load_result
from servops.errors import ServopsError
from servops.lab.sshd import free_port
from servops.output import json_text
from servops.remote import loadgen

HOSTILE_FILES = ["servops/lab/sglang_double.py", "servops/lab/piecewise_model.py", "servops/remote/sglang_args.py", "tests/hostile/hostile_server.py"]


def strict_json(text: str):
    """json.loads as jq and JSON.parse read: NaN and Infinity are errors."""
    def refuse(name):
        raise ValueError(f"bare {name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def strict_lines(path: Path) -> list[dict]:
    return [strict_json(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------ the loadgen's accounting (no host)

def sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs) \
        + b"data: [DONE]\n\n"


def text(t: str) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": None}]}


def usage(n) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3}}


def account(kind, body: bytes, max_tokens: int = 8, step: int = 7, keep_text: bool = False) -> dict:
    """Feed `body` to a fresh request's accounting in `step`-byte pieces (separators split
    across pieces), one piece per 10 ms; its record (failed: the StreamError's text)."""
    rec = loadgen.new_record({"prompt_len": 3})
    acct = kind(rec, max_tokens, keep_text)
    try:
        for i in range(0, len(body), step):
            acct.feed(1.0 + i // step * 0.01, body[i:i + step])
        return acct.finish()
    except loadgen.StreamError as exc:
        return dict(rec, ok=False, error=str(exc))


def test_completion_accounting_on_crafted_sse_bytes():
    """Honest streams count as the server says (one token per chunk, or several: batched); a
    count the chunks contradict, a negative, non-integer or absurd one, NaN, a non-object event
    or usage each fail the request with why; text is kept truncated unless asked."""
    C = loadgen.Completion
    ok = account(C, sse(*[text(f" t{i}") for i in range(8)], usage(8)))
    assert ok["ok"] and ok["output_len"] == 8 and ok["usage_source"] == "usage" and len(ok["itl"]) == 7
    assert ok["server_prompt_tokens"] == 3 and "".join(ok["text"]) == "".join(f" t{i}" for i in range(8))
    batched = account(C, sse(text(" a b c d"), text(" e f g h"), usage(8)))   # sglang --stream-interval 4
    assert batched["ok"] and batched["output_len"] == 8
    no_usage = account(C, sse(text(" a"), text(" b")))
    assert no_usage["ok"] and no_usage["output_len"] == 2 and no_usage["usage_source"] == "chunks"
    chunks4 = [text(f" t{i}") for i in range(4)]
    for count, why in ((-1_000_000, "usage.completion_tokens is -1000000: a count cannot be negative"),
                       (10 ** 30, "usage.completion_tokens is 1000000000000000000000000000000 for max_tokens 8"),
                       (2, "usage.completion_tokens is 2, but 4 chunks of text were streamed"),
                       ("12", "usage.completion_tokens is '12', not a token count"),
                       ([4], "usage.completion_tokens is [4], not a token count"),
                       (4.0, "usage.completion_tokens is 4.0, not a token count"),
                       (True, "usage.completion_tokens is True, not a token count")):
        rec = account(C, sse(*chunks4, usage(count)))
        assert not rec["ok"] and why in rec["error"], (count, rec["error"])
    for raw, why in ((b'{"choices": [], "usage": {"completion_tokens": NaN}}', "NaN is not JSON"),
                     (b'{"choices": [], "usage": {"completion_tokens": -Infinity}}', "-Infinity is not JSON"),
                     (b'{"choices": [], "usage": {"completion_tokens": 1e999}}', "inf, not a token count"),
                     (b'{"choices": [], "usage": [4]}', "usage is [4], not an object"),
                     (b'["a", "list"]', "an event that is a JSON list, not an object"),
                     (b'"a string"', "an event that is a JSON str, not an object"),
                     (b'{"choices": [{"text": 5}]}', "choices[0].text is 5, not text"),
                     (b'{"choices": "x"}', "choices is 'x', not a list of objects"),
                     (b"[" * 100_000, "not JSON"),
                     (b'{"choices": [], "usage": {"completion_tokens": ' + b"9" * 5000 + b"}}", "not JSON")):
        rec = account(C, sse(*chunks4) + sse(raw))
        assert not rec["ok"] and why in rec["error"], (raw[:60], rec["error"])
    # more chunks than max_tokens allows, a 20 MB token, an event that never ends
    many = account(C, sse(*[text(" x")] * 80), step=4096)
    assert not many["ok"] and "more than 72 chunks of text for max_tokens 8" in many["error"]
    big = account(C, sse(text(" " + "x" * (20 << 20)), usage(1)), step=1 << 16)
    assert not big["ok"] and "grew past" in big["error"] and "without ending" in big["error"]
    endless = account(C, b'data: {"choices": [{"text": "' + b"x" * (8 << 20), step=1 << 16)
    assert not endless["ok"] and "grew past 360448 bytes" in endless["error"]
    long_text = "y" * 5000
    kept = account(C, sse(text(long_text), usage(1)))
    assert kept["ok"] and "".join(kept["text"]) == long_text[:loadgen.KEPT_TEXT_CHARS]
    assert "".join(account(C, sse(text(long_text), usage(1)), keep_text=True)["text"]) == long_text


def test_generate_accounting_on_crafted_sse_bytes():
    """/generate streams cumulative text and counts: a count that falls back, or exceeds what
    max_new_tokens allows, fails the request; an honest one times every token."""
    G = loadgen.Generate

    def gen(*counts):
        return sse(*[{"text": " t" * (i + 1), "meta_info": {"prompt_tokens": 3, "completion_tokens": c}}
                     for i, c in enumerate(counts)])

    ok = account(G, gen(1, 2, 4, 8))
    assert ok["ok"] and ok["output_len"] == 8 and len(ok["itl"]) == 7 and ok["usage_source"] == "meta_info"
    for counts, why in (((1, 3, 2), "meta_info.completion_tokens went back from 3 to 2"),
                        ((1, 10 ** 30), "meta_info.completion_tokens is 1000000000000000000000000000000"),
                        ((1, -5), "a count cannot be negative"),
                        ((1, "2"), "not a token count")):
        rec = account(G, gen(*counts))
        assert not rec["ok"] and why in rec["error"], (counts, rec["error"])


def test_json_text_writes_null_for_nan_and_infinity():
    text = json_text({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": "NaN"}, sort_keys=True)
    assert strict_json(text) == {"a": None, "b": [None, None, 1.5], "c": "NaN"}


# ------------------------------------------------------------------ items 6 and 7: a hostile server

class Hostile:
    def __init__(self, lab, tmp_path):
        self.root = root_of(lab)
        self.mode = tmp_path / "hostile-mode"
        self.mode.write_text("honest")
        model = tmp_path / "model"
        model.mkdir()
        self.port = free_port()
        self.inv = lab.inventory(host_vars={"lab1": {
            "server_port": self.port, "server_module": "hostile_server", "model_path": str(model),
            "server_files": HOSTILE_FILES,
            "env": {"CUDA_HOME": str(lab.cuda_home()), "HOSTILE_MODE_FILE": str(self.mode)}}})
        self.results = tmp_path / "results"
        self.env = {"SERVOPS_RESULTS": str(self.results)}

    def run(self, *args, **kw):
        return run_invoke(*args, inventory=self.inv, env=self.env, **kw)

    def bench(self, mode: str, *args: str):
        """bench in `mode`: (the CLI's result, the saved file's lines read strictly, the saved result)."""
        self.mode.write_text(mode)
        before = set(self.results.glob("lab1/*/*.jsonl"))
        res = self.run("bench", "--levels", "2", "--requests", "4", "--output-len", "8", "--warmup", "0", *args)
        assert "Traceback" not in res.stdout + res.stderr, res.stderr[-3000:]
        [path] = set(self.results.glob("lab1/*/*.jsonl")) - before
        return res, strict_lines(path), load_result(path)


@pytest.fixture
def hostile(lab, tmp_path):
    h = Hostile(lab, tmp_path)
    res = h.run("deploy", "--variant", "baseline")
    assert res.returncode == 0, res.stdout + res.stderr
    yield h
    h.run("stop", "--grace", "2", "--break-lock")


IMPOSSIBLE = {
    "negative": "usage.completion_tokens is -1000000: a count cannot be negative",
    "huge": "usage.completion_tokens is 1000000000000000000000000000000 for max_tokens 8",
    "nan": "NaN is not JSON",
    "infinity": "Infinity is not JSON",
    "string": "usage.completion_tokens is 'twelve', not a token count",
    "list": "usage.completion_tokens is [4], not a token count",
    "too-few": "usage.completion_tokens is 2, but 4 chunks of text were streamed",
    "usage-list": "usage is [1, 2], not an object",
    "event-list": "an event that is a JSON list, not an object",
}


def test_impossible_token_counts_fail_their_requests_and_never_pass_a_gate(hostile):
    """Item 6. -1,000,000 or 10^30 completion tokens after 4 chunks, NaN, Infinity, a string or a
    list in the usage chunk: each request fails, saying why; the result is saved (no abort), its
    throughput counts no impossible tokens, and a gate on it fails (rolled back)."""
    for mode, why in IMPOSSIBLE.items():
        res, lines, result = hostile.bench(mode)
        assert res.returncode != 0 and "incomplete" in res.stdout + res.stderr, (mode, res.stdout + res.stderr)
        [line] = lines
        assert line["completed"] == 0 and line["output_throughput"] == 0 and line["total_output_tokens"] == 0
        assert all(e.startswith("refused the server's answer: ") and why in e for e in line["errors"]), \
            (mode, line["errors"])
        [level] = result["levels"]
        assert level["failed"] == 4 and level["output_tps"] == 0.0 and why in result["stopped"]
    # one bad usage chunk in every other request: the others are measured and saved
    res, [line], result = hostile.bench("half-nan")
    assert line["completed"] == 2 and line["output_lens"].count(8) == 2, line["errors"]
    assert sum("NaN is not JSON" in e for e in line["errors"]) == 2 and line["total_output_tokens"] == 16
    # an honest server streaming 4 tokens per chunk (--stream-interval 4) is not refused
    res, [line], result = hostile.bench("batched")
    assert res.returncode == 0 and line["completed"] == 4 and line["output_lens"] == [8] * 4, line["errors"]
    # sglang's native /generate (random-ids): counts that run back or past max_new_tokens
    for mode, why in (("gen-huge", "meta_info.completion_tokens is 1000000000000000000000000000000"),
                      ("gen-back", "meta_info.completion_tokens went back from 3 to 2")):
        _res, [line], _result = hostile.bench(mode, "--dataset", "random-ids")
        assert line["completed"] == 0 and all(why in e for e in line["errors"]), line["errors"]
    hostile.mode.write_text("huge")
    deployed = os.readlink(hostile.root / "current")
    res = hostile.run("deploy", "--variant", "baseline", "--gate", "output_tps@1 >= 1")
    assert res.returncode != 0 and "gate FAIL" in res.stdout, res.stdout + res.stderr
    assert "rolled back to" in res.stderr and os.readlink(hostile.root / "current") == deployed


def test_a_20mb_token_or_an_endless_event_fails_its_request_in_bounded_memory(hostile):
    """Item 7. A 20 MB token per request, or a 64 MB event with no separator: each request fails
    at the event bound (~352 KiB for 8 tokens), the load generator's memory stays bounded, and
    the saved text per request is bounded too."""
    for mode in ("big-token", "no-separator"):
        res, [line], _result = hostile.bench(mode)
        assert line["completed"] == 0, line["errors"]
        assert all("a server-sent event grew past 360448 bytes without ending" in e for e in line["errors"]), \
            line["errors"]
        # before: 622 MiB and 428 MiB for 8 such requests at concurrency 4; python itself is ~25 MiB
        assert line["servops"]["client_max_rss_mib"] < 100, line["servops"]["client_max_rss_mib"]
    _res, [line], _result = hostile.bench("honest")
    assert line["completed"] == 4 and line["servops"]["generated_texts_kept_chars"] == loadgen.KEPT_TEXT_CHARS


# ------------------------------------------------------------------ item 9: valid JSON everywhere

def test_json_output_and_results_hold_no_bare_nan(alab, tmp_path):
    """A server whose token usage is NaN and cache hit rate +Inf (valid Prometheus text), and a
    journal entry holding NaN: `metrics --json`, `history --json` and the saved bench lines are
    JSON strict parsers read, the values null."""
    lab, inv, _port = alab
    books = playbooks_with(tmp_path, nan="extends: baseline\nenv: {SGLANG_DOUBLE_TOKEN_USAGE: 'nan', "
                                         "SGLANG_DOUBLE_CACHE_HIT_RATE: 'inf'}\n")
    env = {"SERVOPS_PLAYBOOKS": str(books), "SERVOPS_RESULTS": str(tmp_path / "results")}
    assert run_invoke("deploy", "--variant", "nan", inventory=inv, env=env).returncode == 0
    res = run_invoke("metrics", "--json", inventory=inv, env=env)
    assert res.returncode == 0, res.stderr
    [row] = strict_json(res.stdout)
    assert row["token_usage"] is None and row["cache_hit_rate"] is None, row
    res = run_invoke("bench", "--levels", "1", "--requests", "2", "--output-len", "4", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    [path] = list((tmp_path / "results").glob("lab1/*/*.jsonl"))
    [line] = strict_lines(path)
    assert line["servops"]["server_metrics"]["max_token_usage"] is None
    with open(root_of(lab) / "journal.jsonl", "a") as fh:
        fh.write('{"action": "planted", "at": "2025-01-01T00:00:00Z", "detail": "nan-entry", "seconds": NaN}\n')
    res = run_invoke("history", "--json", inventory=inv)
    assert res.returncode == 0, res.stderr
    entries = [strict_json(line) for line in res.stdout.splitlines() if line.strip()]
    [planted] = [e for e in entries if e.get("detail") == "nan-entry"]
    assert planted["seconds"] is None


# ------------------------------------------------------------------ item 10: duplicate YAML keys

DUPLICATE_INVENTORY = """all:
  children:
    lab:
      hosts:
        lab1: {ssh_host: 127.0.0.2, ssh_port: 2222}
        lab2: {ssh_host: 127.0.0.3}
        lab1: {ssh_host: 127.0.0.2, ssh_port: 2223}
"""


def test_a_key_given_twice_in_any_yaml_is_an_error_naming_file_line_and_key(tmp_path):
    """The same host twice with different ports (the last silently won), and a key twice in a
    variant, a campaign, patch metadata and the knowledge base: one line naming file, line, key."""
    inv = tmp_path / "inv.yml"
    inv.write_text(DUPLICATE_INVENTORY)
    res = run_invoke("status", inventory=inv)
    one_line_error(res, str(inv), "line 7", "key 'lab1' is given twice", "first at line 5")
    from servops.campaign import load_campaign
    from servops.diagnose import known_issues
    from servops.patchstore import load_patch
    from servops.playbooks import load_variant

    books = tmp_path / "books"
    books.mkdir()
    (books / "dup.yml").write_text("extends: baseline\nserver_args:\n  tp-size: 4\n  tp-size: 8\n")
    camp = tmp_path / "camp.yml"
    camp.write_text("base: baseline\nbench: {levels: [1], levels: [2]}\nobjective: {maximize: output_tps@1}\n")
    patch_dir = tmp_path / "patches" / "flashinfer-python"
    patch_dir.mkdir(parents=True)
    src = REPO / "patches" / "flashinfer-python" / "cuda-version-no-subprocess"
    shutil.copy(src.with_suffix(".patch"), patch_dir / "p.patch")
    (patch_dir / "p.yml").write_text(src.with_suffix(".yml").read_text() + "strip: 1\nstrip: 2\n")
    kb = tmp_path / "known_issues.yml"
    kb.write_text("- id: a\n  title: t\n  category: nccl\n  explanation: e\n  id: b\n")
    for load, path, line, key in ((lambda: load_variant("dup", books), books / "dup.yml", 4, "tp-size"),
                                  (lambda: load_campaign(str(camp)), camp, 2, "levels"),
                                  (lambda: load_patch(patch_dir / "p.patch"), patch_dir / "p.yml", None, "strip"),
                                  (lambda: known_issues(kb), kb, 5, "id")):
        with pytest.raises(ServopsError) as err:
            load()
        msg = str(err.value)
        assert str(path) in msg and f"key '{key}' is given twice" in msg and "\n" not in msg, msg
        assert line is None or f"line {line}:" in msg, msg
    # YAML merge keys still override what they merge, as intended
    from servops.schema import load_yaml
    assert load_yaml("d: &d {a: 1, b: 2}\nx: {<<: *d, a: 5}\n", "f", ServopsError)["x"] == {"a": 5, "b": 2}


# ------------------------------------------------------------------ item 16 (part): bounds

def test_a_when_specifier_of_thousands_of_digits_and_absurd_bench_sizes_are_one_line(lab, tmp_path):
    """A `when:` version of 5,000 digits (was a raw ValueError), a YAML integer of 5,000 digits,
    and bench.requests 10**12 in a campaign or on the command line: one line naming the file
    and rule or key (or the flag), exit 2, before any connection."""
    inv = lab.inventory()
    books = playbooks_with(tmp_path, digits=f"extends: baseline\nwhen:\n  - sglang: '>={'1' * 5000}'\n"
                                            f"    note: x\n    server_args: {{tp-size: 4}}\n",
                           bigint=f"extends: baseline\nstop_grace: {'9' * 5000}\n")
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    res = run_invoke("deploy", "--variant", "digits", inventory=inv, env=env)
    one_line_error(res, str(books / "digits.yml"), "when[0].sglang", "a specifier of 5,002 characters")
    res = run_invoke("check", "--variant", "bigint", inventory=inv, env=env)
    one_line_error(res, str(books / "bigint.yml"), "line 2", "an integer of 5,000 characters")
    for key, value in (("requests", 10 ** 12), ("output_len", 10 ** 9), ("warmup", 10 ** 9), ("levels", [10 ** 7])):
        camp = tmp_path / f"big-{key}.yml"
        bench = {"levels": [1], key: value}
        camp.write_text(f"base: baseline\nbench: {json.dumps(bench)}\nobjective: {{maximize: output_tps@1}}\n")
        res = run_invoke("tune.run", str(camp), inventory=inv)
        one_line_error(res, str(camp), f"bench.{key}")
    res = run_invoke("bench", "--requests", str(10 ** 12), inventory=inv)
    one_line_error(res, "--requests 1000000000000: must be 0 to 1,000,000")
    res = run_invoke("bench", "--levels", "1,10000000", inventory=inv)
    one_line_error(res, "--levels '1,10000000': each level must be 100,000 or less")


# ------------------------------------------------------------------ item 12: private local files

def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_results_and_campaign_files_are_private_under_umask_000(alab, tmp_path):
    """Under umask 000, every directory servops creates under results/ is 0700 and every file
    (bench results, the compare plot, trials.jsonl, the tune report) 0600."""
    lab, inv, _port = alab
    results = tmp_path / "results"
    env = {"SERVOPS_RESULTS": str(results)}
    camp = tmp_path / "c.yml"
    camp.write_text("base: baseline\nbench: {levels: [1], requests: 2, output_len: 4}\n"
                    "objective: {maximize: output_tps@1}\n")
    old = os.umask(0)
    try:
        assert run_invoke("deploy", "--variant", "baseline", inventory=inv, env=env).returncode == 0
        res = run_invoke("bench", "--levels", "1", "--requests", "2", "--output-len", "4", inventory=inv, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        [saved] = list(results.glob("lab1/*-baseline/*.jsonl"))
        other = saved.with_name("20200101T000000Z.jsonl")  # a second variant to compare with
        other.write_text(saved.read_text().replace('"variant": "baseline"', '"variant": "other"'))
        res = run_invoke("compare", "baseline", "other", inventory=inv, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        res = run_invoke("tune.run", str(camp), inventory=inv, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        res = run_invoke("tune.report", str(camp), inventory=inv, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        os.umask(old)
    made = [p for p in results.rglob("*") if p != other]
    dirs = [p for p in made if p.is_dir()]
    files = [p for p in made if p.is_file()]
    assert _mode(results) == 0o700 and all(_mode(d) == 0o700 for d in dirs), [(d, oct(_mode(d))) for d in dirs]
    assert all(_mode(f) == 0o600 for f in files), [(f, oct(_mode(f))) for f in files]
    names = {f.name for f in files}
    assert {"compare-baseline-vs-other.png", "trials.jsonl", "report.md", "report.html"} <= names, names
    assert results / "lab1" / "campaigns" / "c" in dirs


# ------------------------------------------------------------------ item 13: non-UTF-8 terminals

LOG_TAIL = ("[2025-01-01 00:00:00] NCCL WARN — 显存不足 ✗\n"
            "Traceback (most recent call last):\n"
            '  File "/venv/sglang/srt/managers/scheduler.py", line 10, in event_loop\n'
            "    raise RuntimeError('CUDA out of memory — ✗')\n"
            "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB — 显存 ✗\n").encode() + b"bad byte \xff\n"


@pytest.mark.parametrize("env", [{"PYTHONIOENCODING": "ascii"},
                                 {"LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}],
                         ids=["PYTHONIOENCODING=ascii", "LC_ALL=C"])
def test_logs_and_diagnose_escape_what_an_ascii_terminal_cannot_show(alab, env):
    """Item 13. A server log with an em dash, CJK text, a symbol and an undecodable byte: `logs`
    and `diagnose` print it escaped (\\u2014) on an ASCII-only stdout, never UnicodeEncodeError."""
    lab, inv, _port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    with open(root_of(lab) / "current" / "server.log", "ab") as fh:
        fh.write(LOG_TAIL)
    for verb in (["logs", "--lines", "20"], ["diagnose"]):
        res = run_invoke(*verb, inventory=inv, env=env)
        out = res.stdout + res.stderr
        assert "UnicodeEncodeError" not in out and "unexpected data" not in out, (verb, out[-3000:])
        assert res.returncode in (0, 1), (verb, res.returncode, out[-3000:])
        assert "\\u2014" in res.stdout and "\\u663e" in res.stdout, (verb, res.stdout[-3000:])


# ------------------------------------------------------------------ item 14: a full local disk

def _mount_ns_works(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=16k tmpfs {probe}"],
                          capture_output=True).returncode == 0


def test_a_full_results_disk_names_the_path_and_prints_the_numbers(alab, tmp_path):
    """Item 14. results/ on a full filesystem (a 64 KiB tmpfs, filled, in a private mount
    namespace): the bench still runs, its numbers are printed, and the failure names the local
    file and ENOSPC -- not "SSH connection lost"."""
    if not shutil.which("unshare") or not _mount_ns_works(tmp_path):
        pytest.skip("needs unshare(1) with user and mount namespaces to mount a small tmpfs")
    lab, inv, _port = alab
    results = tmp_path / "results"
    results.mkdir()
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    script = 'mount -t tmpfs -o size=64k tmpfs "$1" && (head -c 1000000 /dev/zero > "$1/fill" 2>/dev/null; true)' \
             ' && shift && exec "$@"'
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", NO_COLOR="1", SERVOPS_INVENTORY=str(inv),
               SERVOPS_RESULTS=str(results))
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(results), sys.executable, "-m", "invoke",
                          "bench", "--levels", "1,2", "--requests", "4", "--output-len", "4"],
                         cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in out, out
    assert "SSH connection lost" not in out, out
    assert "No space left on device" in res.stderr and str(results / "lab1") in res.stderr, res.stderr
    assert "the numbers above were measured but not saved" in res.stderr
    assert "output tok/s" in res.stdout and "4/0" in res.stdout and "saved " not in res.stdout, res.stdout
