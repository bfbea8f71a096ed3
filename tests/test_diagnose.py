"""diagnose: tracebacks from logs, host source context, known issues, call chains."""


from harness.sshd import free_port
from conftest import REPO, run_invoke
from servops.diagnose import call_chain, known_issues, match
from servops.remote.tracebacks import extract_tracebacks

FIXTURES = REPO / "tests" / "fixtures"


def test_real_double_traceback_is_parsed_and_matched():
    """The log the double wrote when dynamo crashed on the real, unpatched flashinfer file."""
    [tb] = extract_tracebacks((FIXTURES / "double_piecewise_crash.log").read_text())
    assert tb["exc_type"] == "torch._dynamo.exc.Unsupported"
    assert tb["message"] == "Attempted to call function marked as skipped"
    assert tb["skipped_call"] == "_thread.allocate_lock"
    assert [f["func"] for f in tb["user_frames"]][:4] == ["piecewise_block", "is_cuda_version_at_least",
                                                          "getattr_and_trace", "get_cuda_version"]
    [hit] = match(tb, known_issues())
    assert hit["id"] == "dynamo-get-cuda-version-subprocess" and hit["suggest"]["patch"] == "cuda-version-no-subprocess"
    chain = call_chain(tb, hit["entry"])
    assert chain[0].startswith("capture_piecewise_cuda_graph (sglang_double.py:")
    assert any(s.startswith("get_cuda_version (cpp_ext.py:73)") for s in chain)
    assert chain[-1].startswith("_thread.allocate_lock")
    assert "getattr_and_trace" not in " ".join(chain)  # dynamo's own frames are left out


def test_sglang_format_log_oom_and_nccl():
    """A log in SGLang's TP-rank format (hand-written), with a capture OOM and an NCCL timeout."""
    tbs = extract_tracebacks((FIXTURES / "sglang_tp8_oom_and_nccl.log").read_text())
    assert [t["exc_type"] for t in tbs] == ["torch.OutOfMemoryError", "torch.distributed.DistBackendError"]
    assert tbs[0]["context"].endswith("Scheduler hit an exception:")
    issues = known_issues()
    assert [h["id"] for h in match(tbs[0], issues)] == ["cuda-oom-graph-capture"]
    assert [h["id"] for h in match(tbs[1], issues)] == ["nccl-timeout"]


def test_no_traceback():
    assert extract_tracebacks("all good\nserver started\n") == []




def test_diagnose_the_crash_on_the_host_then_see_the_patch(lab, remote_env):
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    try:
        res = run_invoke("deploy", "--variant", "piecewise", "--skip-patches", "--no-rollback", inventory=inv)
        assert res.returncode != 0 and "left as is" in res.stdout
        res = run_invoke("diagnose", "--explain", inventory=inv)
        assert res.returncode == 0, res.stderr
        out = res.stdout
        assert "torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped" in out
        assert "known issue dynamo-get-cuda-version-subprocess" in out
        assert "suggest patch: cuda-version-no-subprocess" in out
        # source context read from the host's own file, around the failing line
        assert "flashinfer/jit/cpp_ext.py:73 in get_cuda_version  (flashinfer-python 0.7.2.post1)" in out
        assert '>   73          txt = subprocess.check_output([nvcc, "--version"], text=True)' in out
        assert "-> _thread.allocate_lock" in out and "call chain" in out
        # after the patch, the same frames are marked as patched
        assert run_invoke("patch.apply", "cuda-version-no-subprocess", inventory=inv).returncode == 0
        res = run_invoke("diagnose", inventory=inv)
        assert "flashinfer/jit/cpp_ext.py:73 in get_cuda_version  (patched: cuda-version-no-subprocess" in res.stdout
    finally:
        run_invoke("stop", "--grace", "2", inventory=inv)


def test_diagnose_a_local_log_file(lab):
    res = run_invoke("diagnose", "--log", str(FIXTURES / "sglang_tp8_oom_and_nccl.log"), inventory=lab.inventory())
    assert res.returncode == 0, res.stderr
    assert "known issue cuda-oom-graph-capture" in res.stdout and "known issue nccl-timeout" in res.stdout
    assert "not on host" in res.stdout
    bad = run_invoke("diagnose", "--log", "/nonexistent.log", inventory=lab.inventory())
    assert bad.returncode == 2 and "no such local file" in bad.stderr
