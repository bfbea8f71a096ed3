"""The launch preflight, the version-aware variants and the double against REAL sglang releases.

Each release runs from a cached venv holding the real `sglang==X` wheel (servops/lab/venvs.py
build_sglang_venv). sglang 0.5.23's real parser imports there (on the base venv's CPU torch, plus
triton and a few small packages). 0.5.9 and 0.5.15 import torchvision at module level, and PyPI's
torchvision only loads beside its own CUDA torch (5.5 GB): by default THOSE TWO RELEASES ARE CHECKED
THROUGH THE STATIC PATH (their parser rebuilt from their own server_args source), which
test_static_parser_matches_the_real_one shows to give the same flags as the real parser wherever
that parser imports. SERVOPS_TEST_SGLANG_PARSER=real builds the CUDA torch layer and runs every
release through its real parser.
"""

import json
import re
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from servops.lab.sshd import free_port
from conftest import REPO, playbooks_with, run_invoke, wait_for

RELEASES = ["0.5.9", "0.5.15", "0.5.23"]
DOUBLE = REPO / "servops" / "lab" / "sglang_double.py"
PATCH = "cuda-version-no-subprocess"


def parser_word(env) -> str:
    return "real" if env["real"] else "static"


def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "GLM-5-NVFP4"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"]}))
    return d


def release_lab(lab, release, tmp_path, **extra):
    port = free_port()
    inv = lab.inventory(host_vars={"lab1": {"venv": str(release["venv"]), "server_port": port,
                                            "model_path": str(model_dir(tmp_path)), **extra}})
    return inv, port


def http(port: int, path: str):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
            body = r.read()
            return r.status, (json.loads(body) if body[:1] in (b"{", b"[") else body.decode())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return None, None


def server_pid(lab) -> int:
    return json.loads((lab.tmp / "deploy-lab1" / "server.pid").read_text())["pid"]


def check_json(variant: str, inv, env=None) -> dict:
    res = run_invoke("check", "--variant", variant, "--json", inventory=inv, env=env)
    assert res.stdout.strip(), res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("version", RELEASES)
def test_both_variants_validate_and_deploy_and_a_typo_is_refused(lab, sglang_release, tmp_path, version):
    env = sglang_release(version)
    inv, port = release_lab(lab, env, tmp_path)
    for variant in ("baseline", "piecewise"):
        res = run_invoke("check", "--variant", variant, inventory=inv)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"sglang  {version}: " in res.stdout.replace("│", " ") or f"{version}: " in res.stdout
        assert ("real parser" if env["real"] else "STATIC check of its source") in res.stdout
        assert f"lab1 : ok - launch ok on sglang {version}" in res.stdout
        assert "GLM-5-NVFP4: directory" in res.stdout
        if version != "0.5.9":
            assert "baseline.yml when sglang >=0.5.14" in res.stdout
    data = check_json("piecewise", inv)
    assert data["sglang_version"] == version and data["parser"] == parser_word(env) and data["ok"]
    if version == "0.5.23":
        assert "--cuda-graph-backend-prefill" in data["argv"] and "breakable" in data["argv"]
    print(f"check round trip on sglang {version} ({data['parser']}): {data['elapsed_s']:.2f}s "
          f"(host: {data['host_timings']})")

    # deploy resolves the shipped variants' `when:` rules against the host's sglang itself
    books = playbooks_with(tmp_path, typo="extends: baseline\nserver_args: {cuda-graph-max-bz: 256}\n")
    benv = {"SERVOPS_PLAYBOOKS": str(books)}
    try:
        res = run_invoke("deploy", "--variant", "baseline", inventory=inv, env=benv)
        assert res.returncode == 0, res.stdout + res.stderr
        log = (lab.tmp / "deploy-lab1" / "current" / "server.log").read_text()
        assert f"server_args (sglang {version}, {parser_word(env)} parser)" in log  # driven by the real release
        status, info = http(port, "/server_info")
        assert status == 200 and info["version"] == version and info["tp_size"] == 8
        assert ("launch_command" in info) == (version == "0.5.23")
        res = run_invoke("status", inventory=inv, env=benv)  # the server's own version and launch command
        assert res.returncode == 0 and f" {version} " in res.stdout.replace("│", " ")
        assert ("launched as:" in res.stdout and "--cuda-graph-max-bs-decode 256" in res.stdout) == (version == "0.5.23")
        res = run_invoke("deploy", "--variant", "piecewise", "--force", inventory=inv, env=benv)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"patches: apply {PATCH}" in res.stdout
        log = (lab.tmp / "deploy-lab1" / "current" / "server.log").read_text()
        torch_compile = version != "0.5.23"  # 0.5.9 opt-in / 0.5.15 tc_piecewise; 0.5.23: breakable graphs
        assert ("Capture piecewise cuda graph end." in log) == torch_compile
        status, info = http(port, "/model_info")
        assert status == 200 and info["piecewise_cuda_graph"] is torch_compile

        # a typo is refused in seconds, naming the flag, the version and the closest flags; the
        # running server is untouched
        pid = server_pid(lab)
        started = time.monotonic()
        res = run_invoke("check", "--variant", "typo", inventory=inv, env=benv)
        assert res.returncode == 2 and time.monotonic() - started < 60
        line = [l for l in res.stderr.splitlines() if l.startswith("lab1 : failed")]
        assert len(line) == 1 and f"--cuda-graph-max-bz: unrecognized on sglang {version}" in line[0]
        assert ("--cuda-graph-max-bs-decode" if version != "0.5.9" else "--cuda-graph-max-bs") in line[0]
        assert server_pid(lab) == pid and http(port, "/health")[0] == 200
    finally:
        run_invoke("stop", "--grace", "2", inventory=inv)


@pytest.mark.parametrize("version", RELEASES)
def test_deploy_refuses_a_bad_flag_before_anything_stops(lab, sglang_release, tmp_path, version):
    env = sglang_release(version)
    inv, port = release_lab(lab, env, tmp_path)
    books = playbooks_with(tmp_path, typo="extends: baseline\nserver_args: {cuda-graph-max-bz: 256}\n")
    benv = {"SERVOPS_PLAYBOOKS": str(books)}
    try:
        res = run_invoke("deploy", "--variant", "baseline", inventory=inv, env=benv)  # resolves when: itself
        assert res.returncode == 0, res.stdout + res.stderr
        pid = server_pid(lab)
        releases = sorted(p.name for p in (lab.tmp / "deploy-lab1" / "releases").iterdir())
        for args in (["--dry-run"], []):
            res = run_invoke("deploy", "--variant", "typo", "--force", *args, inventory=inv, env=benv)
            assert res.returncode == 2
            assert f"--cuda-graph-max-bz: unrecognized on sglang {version}" in res.stderr
            assert ("--cuda-graph-max-bs-decode" if version != "0.5.9" else "did you mean --cuda-graph-max-bs,") in res.stderr
        assert server_pid(lab) == pid and http(port, "/health")[0] == 200
        assert sorted(p.name for p in (lab.tmp / "deploy-lab1" / "releases").iterdir()) == releases
        assert not (lab.tmp / "deploy-lab1" / "deploy.lock").exists()
    finally:
        run_invoke("stop", "--grace", "2", inventory=inv)


def test_the_seed_flags_are_refused_on_0523_naming_the_version(lab, sglang_release, tmp_path):
    env = sglang_release("0.5.23")
    inv, _port = release_lab(lab, env, tmp_path)
    seed = {k: v for k, v in yaml.safe_load((REPO / "playbooks" / "baseline.yml").read_text()).items() if k != "when"}
    books = playbooks_with(tmp_path, seed=yaml.safe_dump(seed),
                           oldpw="extends: seed\nserver_args: {enable-piecewise-cuda-graph: true}\n")
    res = run_invoke("check", "--variant", "oldpw", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)})
    assert res.returncode == 2
    out = res.stdout + res.stderr
    assert "--enable-piecewise-cuda-graph: unrecognized on sglang 0.5.23" in out
    assert "--cuda-graph-max-bs: ambiguous on sglang 0.5.23" in out
    assert "it could be --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill" in out
    assert "lab1 : failed - refused by sglang's parser: --" in res.stderr and "(+1 more)" in res.stderr


@pytest.mark.parametrize("version", RELEASES)
def test_static_fallback_gives_the_same_verdicts(lab, sglang_release, tmp_path, version):
    env = sglang_release(version)
    if not env["real"]:
        pytest.skip(f"sglang {version}'s real parser needs CUDA torch here ({env['venv'].name}); "
                    f"its checks are static already: SERVOPS_TEST_SGLANG_PARSER=real to compare")
    broken = tmp_path / "broken"
    (broken / "orjson").mkdir(parents=True)
    (broken / "orjson" / "__init__.py").write_text("raise ImportError('orjson made to fail by the test')\n")
    seed = {k: v for k, v in yaml.safe_load((REPO / "playbooks" / "baseline.yml").read_text()).items() if k != "when"}
    books = playbooks_with(tmp_path, typo="extends: baseline\nserver_args: {cuda-graph-max-bz: 256}\n",
                           seed=yaml.safe_dump(seed), oldpw="extends: seed\nserver_args: {enable-piecewise-cuda-graph: true}\n",
                           badval="extends: baseline\nserver_args: {mem-fraction-static: lots, kv-cache-dtype: fp7}\n")
    benv = {"SERVOPS_PLAYBOOKS": str(books)}
    inv_real, _ = release_lab(lab, env, tmp_path)
    real = {v: check_json(v, inv_real, benv) for v in ("baseline", "piecewise", "typo", "oldpw", "badval")}
    inv_static, _ = release_lab(lab, env, tmp_path, env={"PYTHONPATH": str(broken), "CUDA_HOME": "/tmp"})
    static = {v: check_json(v, inv_static, benv) for v in real}
    for v in real:
        assert real[v]["parser"] == "real" and static[v]["parser"] == "static"
        assert "orjson made to fail by the test" in static[v]["note"]
        assert real[v]["ok"] == static[v]["ok"], v
        assert [p.replace(" (static check)", "") for p in static[v]["problems"]] == real[v]["problems"], v
    assert real["baseline"]["ok"] and real["piecewise"]["ok"] and not real["typo"]["ok"]
    assert real["oldpw"]["ok"] == (version == "0.5.9")  # the seed's own flags: fine on 0.5.9 only
    assert len(real["badval"]["problems"]) == 2


@pytest.mark.parametrize("version", RELEASES)
def test_static_parser_matches_the_real_one(sglang_release, version):
    """bench/sglang_static_fidelity.py in the release's venv: the same option strings and action
    count; per option the same dest, nargs, required, type, const, action class and choices
    (except choices sglang computes at run time, which the static check flags unchecked); the same
    verdict for every abbreviation; the same acceptance of sample values."""
    env = sglang_release(version)
    if not env["real"]:
        pytest.skip(f"sglang {version}'s real parser needs CUDA torch here: SERVOPS_TEST_SGLANG_PARSER=real")
    out = subprocess.run([str(env["venv"] / "bin" / "python"), str(REPO / "bench" / "sglang_static_fidelity.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in res, res
    assert res["version"] == version and res["skipped"] == []
    assert res["same"], {k: res[k] for k in ("actions", "only_real", "only_static", "fields",
                                             "abbreviation_mismatches", "value_mismatches")}
    print(f"sglang {version}: {res['actions'][0]} parser actions, {res['abbreviations']} abbreviations, "
          f"static == real ({len(res['unchecked'])} flags with run-time choices or types)")


@pytest.mark.parametrize("version", RELEASES)
def test_the_double_rejects_flags_as_sglang_does(sglang_release, tmp_path, version):
    env = sglang_release(version)
    py = str(env["venv"] / "bin" / "python")
    prog = "launch_server.py" if version == "0.5.9" else "sglang serve"
    res = subprocess.run([py, str(DOUBLE), "--model-path", str(tmp_path), "--cuda-graph-max-bz", "256"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    # (a real import may warn first, as it does before sglang's own usage message)
    assert any(line.startswith(f"usage: {prog} [-h]") for line in res.stderr.splitlines()), res.stderr[-3000:]
    assert f"{prog}: error: unrecognized arguments: --cuda-graph-max-bz 256" in res.stderr
    if version == "0.5.23":
        res = subprocess.run([py, str(DOUBLE), "--model-path", str(tmp_path), "--cuda-graph-max-bs", "256"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "error: ambiguous option: --cuda-graph-max-bs could match " \
                                       "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill" in res.stderr


@pytest.mark.parametrize("version", RELEASES)
def test_the_double_serves_the_release_endpoints(sglang_release, tmp_path, version):
    env = sglang_release(version)
    port = free_port()
    argv = ["--model-path", str(model_dir(tmp_path)), "--port", str(port), "--tp-size", "8"]
    proc = subprocess.Popen([str(env["venv"] / "bin" / "python"), str(DOUBLE), *argv],
                            # a warm-up long enough to be seen on a loaded machine
                            env=dict(os.environ, SGLANG_DOUBLE_LOAD_TIME="1.5", SGLANG_DOUBLE_WARMUP_TIME="8"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert http(port, "/health") == (None, None)  # weights loading: nothing listens yet
        wait_for(lambda: http(port, "/model_info")[0] is not None, what="the double listening", step=0.05)
        assert http(port, "/health")[0] == 503 and http(port, "/health_generate")[0] == 503  # warming up
        status, info = http(port, "/model_info")
        assert status == 200 and info["model_path"].endswith("GLM-5-NVFP4")
        assert info["model_type"] == "glm_moe_dsa" and info["architectures"] == ["GlmMoeDsaForCausalLM"]
        assert ("served_model_name" in info) == (version == "0.5.23")
        assert http(port, "/get_model_info")[1] == info
        wait_for(lambda: http(port, "/health")[0] == 200, what="the double warmed up", step=0.05)
        assert http(port, "/health_generate")[0] == 200
        status, info = http(port, "/server_info")
        assert status == 200 and info["version"] == version and info["tp_size"] == 8 and info["status"] == "ready"
        assert isinstance(info["internal_states"], list) and "max_total_num_tokens" in info
        assert info.get("launch_command") == (" ".join(argv) if version == "0.5.23" else None)
        assert ("kv_events" in info) == (version != "0.5.9")
        assert http(port, "/get_server_info")[1]["version"] == version
        assert http(port, "/metrics")[0] == 404  # sglang serves /metrics only with --enable-metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert "Endpoint '/get_model_info' is deprecated" in out


def test_host_sglang_version_is_one_quick_round_trip(lab, sglang_release, tmp_path):
    from servops.inventory import load_inventory
    from servops.launchcheck import host_sglang_version
    from servops.transport import Session

    env = sglang_release("0.5.23")
    release = load_inventory(release_lab(lab, env, tmp_path)[0])
    plain = load_inventory(lab.inventory(host_vars={"lab1": {"server_port": free_port()}}))  # same file, rewritten
    with Session(release) as s:
        hs = s.host(release.hosts["lab1"])
        assert host_sglang_version(hs) == "0.5.23" and hs.round_trips == 1
    with Session(plain) as s:
        assert host_sglang_version(s.host(plain.hosts["lab1"])) is None


def test_the_double_without_sglang_serves_the_newest_shapes(tmp_path):
    import sys

    port = free_port()
    argv = ["--model-path", str(model_dir(tmp_path)), "--port", str(port), "--tp", "8", "--quantization", "x"]
    proc = subprocess.Popen([sys.executable, str(DOUBLE), *argv], env=dict(os.environ, SGLANG_DOUBLE_LOAD_TIME="0.2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: http(port, "/health")[0] == 200, what="the double healthy", step=0.05)
        status, info = http(port, "/server_info")
        assert status == 200 and info["version"] == "double" and info["tp_size"] == 8
        assert info["launch_command"] == " ".join(argv) and "internal_states" in info
        assert http(port, "/model_info")[1]["served_model_name"].endswith("GLM-5-NVFP4")
        assert http(port, "/metrics")[0] == 200  # the plain double always serves /metrics
    finally:
        proc.terminate()
        proc.wait(10)


def test_deploy_shows_the_checks_warnings_before_anything_stops(lab, sglang_release, tmp_path):
    """A deprecated spelling passes the check with a warning: the deploy prints it as a phase
    line (the check's warnings are the deploy's too), in check mode as in a real run."""
    env = sglang_release("0.5.15")
    inv, _port = release_lab(lab, env, tmp_path)
    books = playbooks_with(tmp_path, oldspelling="extends: baseline\nserver_args: {stream-output: true}\n")
    res = run_invoke("deploy", "--variant", "oldspelling", "--dry-run", inventory=inv,
                     env={"SERVOPS_PLAYBOOKS": str(books)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"\] warning +lab1: --stream-output: deprecated; use --incremental-streaming-output "
                     r"\(sglang 0\.5\.15\)", res.stdout), res.stdout
    assert not (lab.tmp / "deploy-lab1" / "releases").exists() or not any((lab.tmp / "deploy-lab1" / "releases").iterdir())
