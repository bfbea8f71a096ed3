"""diagnose: the host program (run here, on this venv), the CLI (offline, JSON, exit codes,
redaction, markup, bad input) and the double's real dynamo crash diagnosed on a lab host."""

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from conftest import REPO, run_invoke
from servops import remote
from servops.diagnose import (HostReport, call_chain, diagnose_command, known_issues, make_redactor, match,
                              report, scan_local)
from servops.lab.sshd import free_port
from servops.redact import Redactor
from servops.remote.tracebacks import scan

FIXTURES = REPO / "tests" / "fixtures"
REAL = FIXTURES / "real"
CRASH = FIXTURES / "double_piecewise_crash.log"


def run_host_program(args: dict) -> dict:
    """The diagnose program exactly as the host runs it, on this machine's python."""
    res = subprocess.run([sys.executable, "-"], input=remote.with_args("diagnose_ctx", args),
                         capture_output=True, text=True, timeout=120)
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- parsing and matching (no host) ------------------------------------------------------------

def test_the_doubles_crash_is_parsed_and_matched():
    """The log the double wrote when dynamo crashed on the real, unpatched flashinfer file."""
    [f] = scan(CRASH.read_text())["findings"]
    [exc] = f["chain"]
    assert exc["type"] == "torch._dynamo.exc.Unsupported"
    assert exc["message"] == "Attempted to call function marked as skipped"
    assert exc["skipped_call"] == "_thread.allocate_lock"
    assert [fr["func"] for fr in exc["user_frames"]][:4] == ["piecewise_block", "is_cuda_version_at_least",
                                                             "getattr_and_trace", "get_cuda_version"]
    hit = match(f, known_issues())[0]
    assert hit["id"] == "dynamo-get-cuda-version-subprocess" and hit["suggest"]["patch"] == "cuda-version-no-subprocess"
    chain = call_chain(f, hit["entry"])
    assert chain[0].startswith("capture_piecewise_cuda_graph (sglang_double.py:")
    assert any(s.startswith("get_cuda_version (cpp_ext.py:73)") for s in chain)
    assert chain[-1].startswith("_thread.allocate_lock")
    assert "getattr_and_trace" not in " ".join(chain)  # dynamo's own frames are left out


def test_hand_written_tp8_log():
    found = scan((FIXTURES / "sglang_tp8_oom_and_nccl.log").read_text())["findings"]
    assert [f["chain"][0]["type"] for f in found] == ["torch.OutOfMemoryError", "torch.distributed.DistBackendError"]
    assert found[0]["chain"][0]["context"].endswith("Scheduler hit an exception:")
    assert found[0]["ranks"] == ["TP3"] and found[1]["ranks"] == ["TP5"]
    assert "Received sigquit from a child process" in found[0]["errors"][0]["text"]


def test_knowledge_base_rejects_bad_entries(tmp_path):
    from servops.diagnose import DiagnoseError
    bad = tmp_path / "kb.yml"
    bad.write_text(yaml.safe_dump([{"id": "x", "title": "t", "category": "misc", "explanation": "e",
                                    "match": {"message": "a"}}]))
    with pytest.raises(DiagnoseError, match="category 'misc' is not one of"):
        known_issues(bad)
    bad.write_text(yaml.safe_dump([{"id": "x", "title": "t", "category": "nccl", "explanation": "e",
                                    "match": {"message": "("}}]))
    with pytest.raises(DiagnoseError, match="bad regex"):
        known_issues(bad)


def test_verdicts_and_exit_codes():
    assert HostReport("h").verdict == "no errors found" and HostReport("h").exit_code == 0
    assert HostReport("h", 2).verdict == "no known issue matched — 2 error(s) found" and HostReport("h", 2).exit_code == 1
    # explained or not, a failure is exit 1: only a log without one is 0
    rep = HostReport("h", 3, [("port-in-use", "port-in-use")])
    assert rep.verdict == "matched: port-in-use (port-in-use)" and rep.exit_code == 1
    # a server that died is never "no errors found", even when nothing else was recognised
    died = HostReport("h", 0, ended={"line": 9, "text": "Killed", "how": "died"})
    assert died.verdict == "no known issue matched — the server ended abnormally: Killed" and died.exit_code == 1
    cut = HostReport("h", 1, ended={"line": 3, "text": 'File "/x.py", line 1, in f', "how": "mid-traceback"})
    assert cut.verdict.endswith("(the log stops inside a traceback)") and cut.exit_code == 1
    assert HostReport("h", 1, [("port-in-use", "port-in-use")], {"line": 1, "text": "Killed"}).exit_code == 1


def test_redaction_masks_inventory_secrets_and_obvious_tokens():
    redact = make_redactor(Redactor(["s3cr3t-value"]))
    line = ("token s3cr3t-value hf_abcdefghijklmnopqrstuvwxyz123 api_key='62224bfb-c832-4452' "
            "Authorization: Bearer abcdefghijklmnopqrstuvwxyz012345 api_key=None")
    assert redact(line) == "token *** *** api_key='***' Authorization: Bearer *** api_key=None"


def test_report_prints_log_text_verbatim_and_redacted():
    from io import StringIO

    from rich.console import Console
    log = textwrap.dedent('''\
        Traceback (most recent call last):
          File "/x/[bold]/mod.py", line 3, in run
            call("[/]")
        ValueError: bad [/] value [bold]x[/bold] token=hf_abcdefghijklmnopqrstuvwxyz12
        ''')
    buf = StringIO()
    con = Console(file=buf, width=400, force_terminal=False, color_system=None)
    rep = report("lab1", scan_local(log, "x.log"), known_issues(), redact=make_redactor(None), con=con)
    out = buf.getvalue()
    assert "ValueError: bad [/] value [bold]x[/bold] token=***" in out
    assert '/x/[bold]/mod.py:3 in run' in out and 'call("[/]")' in out
    # no known issue, and a bare ValueError names no category: uncategorised, with what it leans to and no action
    assert rep.verdict.startswith("no known issue matched — uncategorised (") and "; action: " not in rep.verdict
    assert rep.verdict.endswith(" — 1 error(s) found") and "category: uncategorised (" in out


def test_deploy_hint_command():
    assert diagnose_command("lab1") == "invoke diagnose -H lab1"
    assert diagnose_command("gpu 1", "20261202T101010Z-piecewise") == \
        "invoke diagnose -H 'gpu 1' --release 20261202T101010Z-piecewise"


# -- the host program, run here --------------------------------------------------------------------

def _release(root, name, status, log="all good\n"):
    d = root / "releases" / name
    d.mkdir(parents=True)
    (d / "release.json").write_text(json.dumps({"status": status}))
    (d / "server.log").write_text(log)


def test_after_a_rollback_the_failed_release_is_diagnosed(tmp_path):
    _release(tmp_path, "20261201T000000Z-baseline", "healthy")
    _release(tmp_path, "20261202T000000Z-piecewise", "failed", CRASH.read_text())
    (tmp_path / "current").symlink_to("releases/20261201T000000Z-baseline")
    out = run_host_program({"deploy_root": str(tmp_path), "context": 1})
    assert out["release"] == "20261202T000000Z-piecewise" and out["release_status"] == "failed"
    assert out["why"] == "most recent failed release (current is 20261201T000000Z-baseline)"
    assert out["scan"]["findings"][0]["chain"][0]["type"] == "torch._dynamo.exc.Unsupported"
    # a later healthy deploy: current again
    _release(tmp_path, "20261203T000000Z-piecewise", "healthy")
    (tmp_path / "current").unlink()
    (tmp_path / "current").symlink_to("releases/20261203T000000Z-piecewise")
    out = run_host_program({"deploy_root": str(tmp_path)})
    assert out["release"] == "20261203T000000Z-piecewise" and out["scan"]["findings"] == []
    out = run_host_program({"deploy_root": str(tmp_path), "release": "../../etc"})
    assert "not a path" in out["error"]


def test_frames_resolve_to_this_venv_with_code_comparison(tmp_path):
    import yaml as pkg
    site_file = pkg.__file__                      # .../site-packages/yaml/__init__.py
    lines = open(site_file).read().splitlines()
    n = next(i for i, line in enumerate(lines, 1) if line.startswith("def safe_load("))
    outside = tmp_path / "app.py"
    outside.write_text("def main():\n    raise SystemExit(3)\n")
    log = textwrap.dedent(f'''\
        Traceback (most recent call last):
          File "/sgl-workspace/yaml-src/lib/yaml/__init__.py", line {n}, in safe_load
            {lines[n - 1].strip()}
          File "/opt/conda/lib/python3.10/site-packages/yaml/__init__.py", line {n + 2}, in safe_load
            {lines[n - 1].strip()}
          File "{outside}", line 2, in main
            raise SystemExit(3)
          File "/nowhere/pkg/mod.py", line 1, in f
            pass
        RuntimeError: boom
        ''')
    out = run_host_program({"deploy_root": str(tmp_path), "log_text": log, "context": 1})
    frames = out["scan"]["findings"][0]["chain"][0]["frames"]
    same, moved, outside_fr, missing = frames
    assert same["rel"] == "yaml/__init__.py" and same["how"] == "package root" and same["same_code"] is True
    assert same["dist"] == "PyYAML" and same["version"]
    assert moved["same_code"] is False and moved["moved_to"] == n and moved["source"]["at"] == n
    assert outside_fr.get("outside") is True and "host_path" not in outside_fr
    assert "host_path" not in missing and not missing.get("outside")
    out = run_host_program({"deploy_root": str(tmp_path), "log_text": log, "allow_outside": True})
    assert out["scan"]["findings"][0]["chain"][0]["frames"][2]["host_path"] == str(outside.resolve())


# -- the CLI -------------------------------------------------------------------------------------

def test_offline_json_needs_no_host(tmp_path):
    env = {"SERVOPS_INVENTORY": str(tmp_path / "no-such-inventory.yml")}
    res = run_invoke("diagnose", "--offline", "--json", "--log", str(REAL / "vllm-26297-quant-scheme-capability-tp.log"),
                     env=env)
    assert res.returncode == 1, res.stderr  # a failure, explained: the JSON's verdict says so
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert rows[0]["category"] == "quantization" and rows[0]["entry"] == "quantization-needs-newer-gpu"
    assert rows[0]["verdict"] == "explained"
    assert rows[0]["ranks"] == ["TP0"] and rows[0]["frames"] == 1 and "root_exception" in rows[0]
    assert {"final_exception", "category", "entry", "frames", "ranks"} <= set(rows[1])
    assert res.stderr.strip().endswith("matched: quantization-needs-newer-gpu (quantization); action: change flag --quantization")
    assert rows[0]["action"] == "change flag --quantization" and rows[0]["category_from"] == "known issue"
    res = run_invoke("diagnose", "-o", "-l", str(REAL / "sglang-10350-segfault-pd.log"), env=env)
    assert res.returncode == 1
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("no known issue matched — ")
    assert last.endswith(" — the server ended abnormally: Fatal Python error: Segmentation fault")
    clean = tmp_path / "clean.log"
    clean.write_text("[2026-01-01 00:00:00] The server is fired up and ready to roll!\n")
    res = run_invoke("diagnose", "-o", "-l", str(clean), env=env)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "no errors found"


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    env = {"SERVOPS_INVENTORY": str(tmp_path / "no-such-inventory.yml")}
    for args, words in [(("--context", "abc"), "--context 'abc': expected an integer"),
                        (("--release", "../../etc/passwd"), "not a path"),
                        (("--release", "/abs/release"), "not a path"),
                        (("--offline",), "--offline diagnoses a local file"),
                        (("--offline", "--log", "/nonexistent.log"), "no such local file")]:
        res = run_invoke("diagnose", *args, env=env)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert words in res.stderr and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_offline_uses_the_hosts_redactor(lab):
    inv = lab.inventory(host_vars={"lab1": {"env": {"HF_TOKEN": "very-secret-hf-value"}}})
    log = lab.tmp / "leak.log"
    log.write_text("Traceback (most recent call last):\n  File \"/x.py\", line 1, in f\n"
                   "RuntimeError: NCCL error: unhandled system error; HF_TOKEN=very-secret-hf-value\n")
    res = run_invoke("diagnose", "-o", "-l", str(log), "-H", "lab1", inventory=inv)
    assert res.returncode == 1, res.stderr  # (a failure: the known issue explains it, the exit says it happened)
    assert "very-secret-hf-value" not in res.stdout and "HF_TOKEN=***" in res.stdout


# -- on a real host --------------------------------------------------------------------------------

def test_diagnose_the_crash_on_the_host_then_see_the_patch(lab, remote_env):
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    try:
        res = run_invoke("deploy", "--variant", "piecewise", "--skip-patches", "--no-rollback", inventory=inv)
        assert res.returncode != 0 and "left as is" in res.stdout + res.stderr
        res = run_invoke("diagnose", "--explain", inventory=inv)
        assert res.returncode == 1, res.stderr
        out = res.stdout
        assert "root cause: torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped" in out
        assert "known issue dynamo-get-cuda-version-subprocess (dynamo-trace)" in out
        assert "suggest patch: cuda-version-no-subprocess" in out
        # source context read from the host's own file, around the failing line: the same code
        assert "flashinfer/jit/cpp_ext.py:73 in get_cuda_version  (flashinfer-python 0.7.2.post1, same code)" in out
        assert '>   73          txt = subprocess.check_output([nvcc, "--version"], text=True)' in out
        assert "-> _thread.allocate_lock" in out and "call chain" in out
        # the failed release's variant carries the fix set (the lab's venv has no sglang to name its release by)
        assert out.strip().splitlines()[-1] == ("matched: dynamo-get-cuda-version-subprocess (dynamo-trace); "
                                                  "action: apply patch cuda-version-no-subprocess; the whole fix set of "
                                                  "the host's release: deploy --variant piecewise")
        # after the patch, the same frames are marked as patched, and the logged line is no longer the host's
        assert run_invoke("patch.apply", "cuda-version-no-subprocess", inventory=inv).returncode == 0
        res = run_invoke("diagnose", inventory=inv)
        assert "flashinfer/jit/cpp_ext.py:73 in get_cuda_version  (patched: cuda-version-no-subprocess" in res.stdout
        assert "host file differs (host flashinfer-python 0.7.2.post1)" in res.stdout
        assert "warning: " in res.stdout and "the log came from another version" in res.stdout
    finally:
        run_invoke("stop", "--grace", "2", inventory=inv)


def test_diagnose_a_local_log_on_the_host(lab):
    inv = lab.inventory()
    res = run_invoke("diagnose", "--log", str(REAL / "sglang-23386-dynamo-get-cuda-version.log"), inventory=inv)
    assert res.returncode == 1, res.stderr
    # the log's /usr/local/lib/python3.12/dist-packages/flashinfer frames resolve in the host's venv
    assert "flashinfer/jit/cpp_ext.py:73 in get_cuda_version  (flashinfer-python 0.7.2.post1, same code)" in res.stdout
    assert "/usr/lib/python3.12/subprocess.py:828 in __init__" in res.stdout
    assert res.stdout.strip().splitlines()[-1] == ("matched: dynamo-get-cuda-version-subprocess (dynamo-trace); "
                                                  "action: apply patch cuda-version-no-subprocess; the whole fix set of "
                                                  "the host's release: deploy --variant piecewise")
    res = run_invoke("diagnose", "--json", "--log", str(FIXTURES / "sglang_tp8_oom_and_nccl.log"), inventory=inv)
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["entry"] for r in rows] == ["cuda-oom-graph-capture", "nccl-watchdog-timeout"]
    assert rows[0]["host"] == "lab1" and rows[0]["ranks"] == ["TP3"]
