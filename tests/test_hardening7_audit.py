"""Hardening round 7, the audit: what a hostile or careless host feeds it. The host's model
config.json (read by the real audit program, model_shrink), the break record the shim writes
and the probe's reply (the real fixtures of the lab's audit, each changed the way a hostile host
would: the synthesised patch is stored and deployed to every host of the release), and the probed
function itself (the real probe program and shim on the cached venv's torch).

Each attack failed before its fix: a RecursionError or an OverflowError out of the audit program,
a 10^9-layer config filling the host's memory, code from the host's message in the patch, a
patch file written outside the candidates' directory, a probe whose worker kept its pipe held
for the whole deadline."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servops import audit, remote, synth
from servops.remote.model_shrink import shrink_config

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
ENGINE_CODE = ("sglang", "sgl_kernel", "sglang_double", "piecewise_model", "sglang_args")
QUANT = "labkernels.ops.quantization:per_token_group_quant"


def audit_program(model_dir: Path, tmp: Path, timeout: float = 60) -> tuple[dict, float]:
    """The real audit program (audit_compile, op audit) on this machine's python, its TMPDIR
    `tmp` (where it makes its work directory); its reply and how long it took."""
    args = {"op": "audit", "launch": {"module": "nothing", "argv": []}, "model_path": str(model_dir),
            "device": "cpu", "patches": [], "shim": "", "server_files": {}, "timeout_s": 30}
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-"], input=remote.with_args("audit_compile", args), text=True,
                         capture_output=True, timeout=timeout, env=dict(os.environ, TMPDIR=str(tmp)))
    return json.loads(res.stdout.strip().splitlines()[-1]), time.monotonic() - started


def model_with(tmp_path: Path, text: str) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(text)
    return model


# ---- the host's config.json, through the real audit program ------------------------------------------

CONFIGS = {
    # a config nested 10^5 deep: json's RecursionError ended the program with a traceback
    "nested-1e5-deep": ("[" * 100000 + "]" * 100000, "nested too deep"),
    # 10^9 layers: a list of 10^9 layer kinds was being built (the host's memory, then the deadline)
    "layers-1e9": (json.dumps({"num_hidden_layers": 10 ** 9}), "not a layer count a model has"),
    # JSON's Infinity: int(inf) raised OverflowError out of the program
    "layers-infinity": ('{"num_hidden_layers": Infinity}', "not a whole number"),
    # a fractional count was cut to an int silently (32.7 -> 32): now said
    "layers-float": ('{"num_hidden_layers": 32.7}', "not a whole number"),
    "layers-negative": ('{"num_hidden_layers": -4}', "not a layer count a model has"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_hostile_model_config_is_not_audited_with_one_line_and_leaves_no_work_dir(tmp_path, name):
    text, why = CONFIGS[name]
    model = model_with(tmp_path, text)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    reply, took = audit_program(model, scratch)
    assert reply["state"] == "not-audited" and why in reply["why"] and "\n" not in reply["why"]
    assert took < 20
    assert list(scratch.iterdir()) == []  # no servops-audit- directory left behind


def test_config_fields_of_the_wrong_type_or_infinite_do_not_crash_the_shrink():
    # mlp_only_layers an int, experts and steps Infinity: TypeError / OverflowError before
    for config in ({"num_hidden_layers": 4, "num_experts": 8, "mlp_only_layers": 3},
                   {"num_hidden_layers": 4, "num_experts": 8, "mlp_only_layers": "0,1"},
                   {"num_hidden_layers": 4, "num_experts": float("inf"), "decoder_sparse_step": float("inf")},
                   {"num_hidden_layers": 4, "n_routed_experts": 8, "first_k_dense_replace": float("inf")},
                   {"num_hidden_layers": 4, "full_attention_interval": float("inf")}):
        shrunk, info = shrink_config(config)
        assert shrunk["num_hidden_layers"] == info["kept"] and 1 <= info["kept"] <= 4


# ---- the break record and the probe's reply: what becomes the stored patch ----------------------------

def lab_break() -> tuple[dict, dict, dict]:
    """The lab's real quant break, its frame to wrap and the probe's real reply (copies to change)."""
    data = json.loads((FIXTURES / "lab-kernel-loader.json").read_text())
    return data["record"], data["probes"][QUANT]["reply"], data


def synthesised_from(record: dict, probe: dict) -> synth.Synthesis:
    brk = audit.analyse(record, ENGINE_CODE)
    frame = next(f for f in brk["candidates"] if f"{f['module']}:{f['qualname']}" == QUANT)
    return synth.synthesise(brk, frame, probe, "h7")


def added_code(s: synth.Synthesis) -> str:
    return "\n".join(line[1:] for line in s.text.splitlines() if line.startswith("+") and not line.startswith("+++"))


def calls_in(code: str) -> set[str]:
    return {ast.unparse(n.func) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)}


@pytest.mark.parametrize("breaker", ["\n", "\r", "\u2028", "\x0c"])
def test_a_break_message_with_a_line_break_writes_no_code_into_the_patch(breaker):
    record, probe, _ = lab_break()
    payload = "__import__('os').system('touch /tmp/h7-pwned')"
    # dynamo's callee name, as the host's message gives it, runs over a line break into code
    record["message"] = record["message"].replace("function `import_module`",
                                                  f"function `import_module{breaker}{payload}{breaker}`", 1)
    s = synthesised_from(record, probe)
    code = added_code(s)
    assert not any("system" in c for c in calls_in(code))
    assert all(line.startswith("#") or "system" not in line for line in code.splitlines())
    assert "\n" not in s.meta["synthesised"]["break"] and "\r" not in s.meta["why"]


PROBE_ATTACKS = {
    # a distribution or version naming a path: the candidate patch was written outside its directory
    "dist-traversal": (lambda p: p.update(dist="../../../../tmp/h7-escape"), "dist"),
    "version-traversal": (lambda p: p.update(dist_version="1.0/../../../../x"), "dist_version"),
    "rel-absolute": (lambda p: p.update(rel="/etc/passwd"), "rel"),
    "rel-dotdot": (lambda p: p.update(rel="../../sitecustomize.py"), "rel"),
    # a context line holding a whole hunk of another file: the diff grew a second file
    "tail-newline": (lambda p: p["tail"].__setitem__(-1, "    )\n--- a/x.py\n+++ b/x.py"), "tail"),
    # a dtype that is code: it went into the fake implementation as written
    "dtype-code": (lambda p: [c["output"]["items"][0].update(dtype="torch.float8_e4m3fn); __import__('os').system('id'")
                              for c in p["cases"] if c.get("ok")], "dtype"),
    # a size that is text: a constant dim became that text in the fake
    "shape-text": (lambda p: [c["output"]["items"][1].update(shape=[64, "__import__('os').getcwd()"])
                              for c in p["cases"] if c.get("ok")], "shape"),
    "alias-not-a-parameter": (lambda p: [c["output"]["items"][0].update(alias="os.system")
                                         for c in p["cases"] if c.get("ok")], "alias"),
    "signature-not-a-list": (lambda p: p.update(signature="def f(): pass"), "signature"),
    "line-count-text": (lambda p: p.update(line_count="21"), "line_count"),
}


@pytest.mark.parametrize("name", sorted(PROBE_ATTACKS))
def test_a_probe_reply_that_would_write_a_path_or_code_cannot_be_wrapped(tmp_path, name):
    change, field = PROBE_ATTACKS[name]
    record, probe, _ = lab_break()
    change(probe)
    with pytest.raises(synth.CannotWrap, match=field):
        s = synthesised_from(record, probe)
        audit.candidate_patch(s, tmp_path / "candidates")  # (before: it wrote wherever the reply said)
    assert not Path("/tmp/h7-escape").exists()


def test_the_unchanged_probe_still_synthesises():
    record, probe, _ = lab_break()
    assert "input.shape[1] // group_size" in synthesised_from(record, probe).text


@pytest.mark.parametrize("chain", [5, "frames", [{"module": "sglang.x", "qualname": "f", "args": "abc",
                                                  "kwargs": [1], "called_from": "line 3"},
                                                 {"module": "labgemm.gemm", "qualname": "g",
                                                  "args": [{"kind": "tensor", "shape": 7}]}]])
def test_a_break_record_of_the_wrong_shape_is_read_not_a_crash(chain):
    # chain an int, args a string, called_from a string, a shape an int: TypeError/AttributeError before
    brk = audit.analyse({"type": "x", "message": "m", "chain": chain}, ENGINE_CODE)
    assert isinstance(brk["boundary_text"], str) and isinstance(brk["sizes"], list)


def test_the_rounds_captured_sizes_and_times_from_a_host_are_numbers():
    # "captured": ["x", 5, true] and "elapsed_s": "abc" raised ValueError/TypeError in the loop
    assert audit._sizes(["x", 5, True, -1, 5, 2.5, 64]) == [5, 64] and audit._sizes("64") == []
    assert audit._seconds("abc") == 0.0 and audit._seconds(float("inf")) == 0.0 and audit._seconds(3) == 3.0


# ---- the probed function: the real probe program and shim ---------------------------------------------

FLOODER = """
import sys
def f():
    return None
while True:
    sys.stdout.write("x" * (1 << 20))
"""
FORKER = """
import os, time
def f():
    return None
if os.fork() == 0:  # a worker that keeps the probe's stdout and stderr open
    time.sleep(300)
    os._exit(0)
with open(os.environ["H7_FORKED"], "w") as fh:
    fh.write("started")
"""


def probe_program(remote_env: dict, lib: Path, module: str, tmp: Path, timeout_s: int,
                  request: dict | None = None) -> tuple[dict, float]:
    request = request or {"module": module, "qualname": "f", "args": [], "kwargs": {}, "cases": [{"sizes": {}}]}
    args = {"op": "probe", "request": request, "shim": audit.SHIM.read_text(), "patches": [],
            "env": {"PYTHONPATH": str(lib), "H7_FORKED": str(tmp / "forked")}, "timeout_s": timeout_s}
    started = time.monotonic()
    res = subprocess.run([str(remote_env["venv"] / "bin" / "python"), "-"], input=remote.with_args("audit_compile", args),
                         text=True, capture_output=True, timeout=timeout_s + 60, env=dict(os.environ, TMPDIR=str(tmp)))
    return json.loads(res.stdout.strip().splitlines()[-1]), time.monotonic() - started


def test_a_probed_function_that_prints_without_end_is_ended_at_its_output_bound(tmp_path, remote_env):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "h7flood.py").write_text(FLOODER)
    reply, took = probe_program(remote_env, lib, "h7flood", tmp_path, timeout_s=120)
    # before: held in memory until the 120 s deadline (gigabytes)
    assert "printed more than" in reply["error"] and took < 90
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("servops-probe-")]


def test_a_probe_whose_worker_keeps_its_pipe_answers_when_it_ends_and_the_worker_is_ended(tmp_path, remote_env):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "h7fork.py").write_text(FORKER)
    reply, took = probe_program(remote_env, lib, "h7fork", tmp_path, timeout_s=90)
    # before: communicate() waited for the worker's end of the pipe: "did not end in 90 s"
    assert "error" not in reply and reply["signature"] == [] and took < 60
    assert (tmp_path / "forked").exists()
    leftover = subprocess.run(["pgrep", "-f", "h7fork"], capture_output=True, text=True).stdout.split()
    assert [p for p in leftover if int(p) != os.getpid()] == []


def test_a_probe_size_from_a_hostile_break_record_is_refused_before_anything_is_allocated(tmp_path, remote_env):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "h7ident.py").write_text("def f(x):\n    return x\n")
    tensor = {"kind": "tensor", "shape": [{"sym": "s0", "hint": 4}, 8], "dtype": "torch.float32", "device": "cpu"}
    request = {"module": "h7ident", "qualname": "f", "args": [tensor], "kwargs": {},
               "cases": [{"sizes": {"s0": 4}}, {"sizes": {"s0": 1 << 40}}, {"sizes": {"s0": 4}, "scale": {"8": 1 << 36}}]}
    reply, _ = probe_program(remote_env, lib, "h7ident", tmp_path, timeout_s=120, request=request)
    fits, huge, scaled = reply["cases"]
    # before: torch.rand([2**40, 8]) on the host (32 TiB asked of the serving machine's memory)
    assert fits["ok"] and fits["output"]["shape"] == [4, 8]
    for case in (huge, scaled):
        assert not case["ok"] and "past the probe's bound" in case["error"]


# ---- the proof over a capture list of 10^4 sizes: a host's engine, answering slowly -----------------

ENGINE = """
import http.server, json, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
for n in range(2, 10002):  # the capture of 10^4 prefill sizes, as sglang's tqdm line names each
    print("Capturing num tokens (num_tokens=%d avail_mem=1.0 GB)" % n, flush=True)
print("Capturing num tokens (num_tokens=123456789 avail_mem=1.0 GB)", flush=True)  # past the 7 digits a size has

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(0.2)  # each prefill: 10^4 of them took 2000 s
        out = json.dumps({"meta_info": {"input_token_logprobs": [[-1.0, i, None] for i in body["input_ids"]]}})
        self.send_response(200); self.end_headers(); self.wfile.write(out.encode())

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_the_proof_over_ten_thousand_captured_sizes_ends_at_its_deadline_each_size_left_unproven(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "h7engine.py").write_text(ENGINE)
    model = model_with(tmp_path, json.dumps({"num_hidden_layers": 2, "vocab_size": 1000}))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    args = {"op": "audit", "model_path": str(model), "device": "cpu", "patches": [], "shim": "", "server_files": {},
            "timeout_s": 60, "launch": {"module": "h7engine", "argv": ["--port", "{SERVOPS_AUDIT_PORT}"],
                                         "env": {"PYTHONPATH": str(lib)}, "health": "/health"},
            "compare": {"lengths": "captured", "timeout_s": 5, "deadline_s": 4}}
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-"], input=remote.with_args("audit_compile", args), text=True,
                         capture_output=True, timeout=300, env=dict(os.environ, TMPDIR=str(scratch)))
    reply = json.loads(res.stdout.strip().splitlines()[-1])
    assert reply["state"] == "healthy" and len(reply["captured"]) == 10000 and 1234567 not in reply["captured"]
    assert time.monotonic() - started < 120
    compared = [v for v in reply["logprobs"].values() if isinstance(v, list)]
    left = [v for v in reply["logprobs"].values() if isinstance(v, dict)]
    assert 1 <= len(compared) < 100 and len(compared) + len(left) == 10000
    assert "not compared" in left[-1]["error"]
    # the proof reads a size not compared as not equal: nothing is proven past the deadline
    eager = {k: v for k, v in reply["logprobs"].items() if isinstance(v, list)}
    assert not audit.compare_logprobs(reply["logprobs"], eager, 0.02)["ok"]
    assert list(scratch.iterdir()) == []


def test_a_frame_named_as_a_keyword_or_a_module_path_that_is_not_one_cannot_be_wrapped():
    record, probe, _ = lab_break()
    brk = audit.analyse(record, ENGINE_CODE)
    frame = dict(next(f for f in brk["candidates"] if f"{f['module']}:{f['qualname']}" == QUANT))
    # `def None(...)` appended to the module: a SyntaxError on import in every host it is deployed to
    with pytest.raises(synth.CannotWrap, match="not a module-level function"):
        synth.synthesise(brk, dict(frame, qualname="None"), probe, "h7")
    with pytest.raises(synth.CannotWrap, match="not a module name"):
        synth.synthesise(brk, dict(frame, module="labkernels.ops\n__import__('os')"), probe, "h7")


def test_escape_sequences_in_a_break_message_never_reach_a_report():
    record, _, _ = lab_break()
    record["message"] = "\x1b]0;owned\x07\x1b[2J" + record["message"]
    brk = audit.analyse(record, ENGINE_CODE)
    assert all(c.isprintable() for c in brk["reason_line"] + brk["boundary_text"])


# ---- two audits racing: their results and the patch store -----------------------------------------------

def test_two_audits_of_a_host_in_one_second_get_directories_of_their_own(tmp_path, monkeypatch):
    from servops import auditstage
    monkeypatch.setattr(auditstage, "RESULTS_ROOT", tmp_path)  # (where results go: the test's own)
    first, second = auditstage.results_dir("lab1"), auditstage.results_dir("lab1")
    # before: the same path, one audit's candidates and audit.json over the other's
    assert first != second and first.is_dir() and second.is_dir()


def test_a_deploy_reading_the_store_while_an_audit_writes_its_patch_never_reads_it_half_written(tmp_path):
    import threading

    from servops import patchstore
    record, probe, _ = lab_break()
    patch = audit.candidate_patch(synthesised_from(record, probe), tmp_path / "candidates")
    store = tmp_path / "store"
    audit.write_to_store([patch], root=store)
    stop, errors = threading.Event(), []

    def writer():
        while not stop.is_set():
            audit.write_to_store([audit.candidate_patch(synthesised_from(record, probe), tmp_path / "candidates")],
                                 root=store)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(400):
            try:
                patchstore.all_patches(store)
            except patchstore.PatchError as exc:  # before: "contains no file changes", a .yml read empty
                errors.append(str(exc))
    finally:
        stop.set()
        thread.join()
    assert errors == []


def test_a_model_path_under_home_is_read_as_the_launch_check_reads_it(tmp_path):
    home = tmp_path / "home"
    (home / "models" / "m").mkdir(parents=True)
    (home / "models" / "m" / "config.json").write_text(json.dumps({"num_hidden_layers": 10 ** 9}))
    args = {"op": "audit", "launch": {"module": "nothing", "argv": []}, "model_path": "~/models/m",
            "device": "cpu", "patches": [], "shim": "", "server_files": {}, "timeout_s": 30}
    res = subprocess.run([sys.executable, "-"], input=remote.with_args("audit_compile", args), text=True,
                         capture_output=True, timeout=60, env=dict(os.environ, HOME=str(home), TMPDIR=str(tmp_path)))
    reply = json.loads(res.stdout.strip().splitlines()[-1])
    # before: "cannot open ~/models/m/config.json": every host with a ~ model path went NOT audited
    assert "not a layer count" in reply["why"]


FLOODING_ENGINE = """
import sys
while True:  # an engine logging without end, never healthy: the host's disk is the serving server's too
    sys.stdout.write("x" * 65536 + "\\n")
"""


def test_an_audit_server_flooding_its_log_is_ended_at_the_bound_and_its_work_dir_removed(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "h7flooder.py").write_text(FLOODING_ENGINE)
    model = model_with(tmp_path, json.dumps({"num_hidden_layers": 2}))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    args = {"op": "audit", "model_path": str(model), "device": "cpu", "patches": [], "shim": "", "server_files": {},
            "timeout_s": 120, "max_log_bytes": 32 << 20,
            "launch": {"module": "h7flooder", "argv": [], "env": {"PYTHONPATH": str(lib)}, "health": "/health"}}
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-"], input=remote.with_args("audit_compile", args), text=True,
                         capture_output=True, timeout=300, env=dict(os.environ, TMPDIR=str(scratch)))
    reply = json.loads(res.stdout.strip().splitlines()[-1])
    # before: written on until the 120 s deadline (gigabytes on the serving host's disk)
    assert reply["state"] == "flooded its log" and reply["ended"] and time.monotonic() - started < 60
    assert list(scratch.iterdir()) == []
    assert subprocess.run(["pgrep", "-f", "h7flooder"], capture_output=True).returncode == 1


def test_a_config_of_150000_keys_and_4096_layers_is_shrunk_in_seconds():
    config = {f"k{i}": i for i in range(150000)}  # 2.6 MB: under the 4 MB read bound
    config.update(num_hidden_layers=4096, num_experts=8, mlp_only_layers=list(range(0, 4096, 2)))
    started = time.monotonic()
    shrunk, info = shrink_config(config)
    # before: every key walked once per layer, 186 s of the audit program's CPU on this machine
    assert info == {"layers": 4096, "kept": 2, "kinds": 2} and time.monotonic() - started < 10


def test_an_audit_whose_journal_cannot_be_written_still_answers(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "h7exits.py").write_text("raise SystemExit(4)\n")  # an engine that ends at once
    model = model_with(tmp_path, json.dumps({"num_hidden_layers": 2}))
    journal = tmp_path / "deploy" / "journal.jsonl"
    journal.mkdir(parents=True)  # its name taken by a directory (or a full disk): append fails
    args = {"op": "audit", "model_path": str(model), "device": "cpu", "patches": [], "shim": "", "server_files": {},
            "timeout_s": 60, "journal": str(journal), "journal_entry": {"action": "audit"},
            "launch": {"module": "h7exits", "argv": [], "env": {"PYTHONPATH": str(lib)}}}
    res = subprocess.run([sys.executable, "-"], input=remote.with_args("audit_compile", args), text=True,
                         capture_output=True, timeout=120, env=dict(os.environ, TMPDIR=str(tmp_path)))
    # before: IsADirectoryError after the whole audit, its answer lost ("remote audit_compile failed")
    reply = json.loads(res.stdout.strip().splitlines()[-1])
    assert reply["state"] == "exited" and reply["exit_code"] == 4 and "not written" in reply["journal_problem"]


@pytest.mark.parametrize("proven, outcome", [("yes", "refused"), ({"ok": "false"}, "unproven"), ({"ok": 1}, "unproven"),
                                              ({"ok": True}, "proven")])
def test_a_stored_patch_whose_proof_was_edited_by_hand_is_refused_or_unproven(tmp_path, proven, outcome):
    import yaml

    from servops import patchstore
    record, probe, _ = lab_break()
    patch = audit.candidate_patch(synthesised_from(record, probe), tmp_path / "candidates")
    patch.synthesised = dict(patch.synthesised, proven=proven)
    store = tmp_path / "store"
    audit.write_to_store([patch], root=store)
    meta = yaml.safe_load((store / patch.distribution / f"{patch.name}.yml").read_text())
    assert meta["synthesised"]["proven"] == proven
    # before: proven 'yes' raised AttributeError in every covering check; ok 'false' (quoted) counted as proven
    if outcome == "refused":
        with pytest.raises(patchstore.PatchError, match="synthesised.proven"):
            patchstore.all_patches(store)
    else:
        assert patchstore.all_patches(store)[0].proven() is (outcome == "proven")
