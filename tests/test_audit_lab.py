"""The audit of the compiled region over the real sshd lab (issue 45): the real sglang 0.5.21 parser,
the SGLang double compiling its block-FP8 forward at the variant's prefill sizes, largest first, over
the lab venv's FlashInfer-shaped GEMM (labgemm, fewer than 32 tokens) and sglang-shaped kernel
loader (labkernels, 32 and more): two breaks at different sizes. The audit finds them before anything
stops, --fix synthesises and proves a custom op for each, and the deploy takes the stored fixes."""

import json
import re
import shutil
from pathlib import Path

import yaml

from conftest import REPO, healthy, playbooks_with, run_invoke
from test_sglang_releases import release_lab

VERSION = "0.5.21"  # the lab's sglang (servops/lab/manage.py)
SIZES = "[4, 8, 16, 32, 64]"
FP8 = "  fp8-gemm-backend: flashinfer_deepgemm\n  cuda-graph-bs-prefill: " + SIZES + "\n"
TC = "when:\n  - sglang: '>=0.5.14,<0.5.22'\n    server_args: {cuda-graph-backend-prefill: tc_piecewise}\n"
VARIANTS = {
    # the shipped piecewise variant on a block-FP8 model: the release's whole fix set (the hand-written
    # FP8 GEMM custom op among it)
    "fp8pw": "extends: piecewise\nserver_args:\n" + FP8,
    # the FlashInfer version patch alone: no hand-written patch for either GEMM path
    "fp8pw-bare": "extends: baseline\nserver_args:\n" + FP8 + "patches: [cuda-version-no-subprocess]\n" + TC,
}
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
          "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}}


def fp8_model(tmp_path: Path) -> Path:
    d = tmp_path / "llama-fp8"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "tokenizer_config.json").write_text("{}")
    return d


def store_copy(tmp_path: Path, without: tuple[str, ...] = ()) -> Path:
    store = tmp_path / "patches"
    shutil.copytree(REPO / "patches", store)
    for name in without:
        for f in store.glob(f"*/{name}.*"):
            f.unlink()
    return store


def audit_json(inv, env, *extra) -> tuple[int, dict, str]:
    res = run_invoke("audit", "--variant", *extra, "--json", inventory=inv, env=env, timeout=900)
    text = res.stdout
    start = text.find("{")
    return res.returncode, (json.loads(text[start:text.rfind("}") + 1]) if start >= 0 else {}), text + res.stderr


def test_two_breaks_found_before_the_restart_fixed_by_synthesised_patches_and_deployed(lab, sglang_release, tmp_path):
    env = sglang_release(VERSION)
    inv, port = release_lab(lab, env, tmp_path, model_path=str(fp8_model(tmp_path)))
    store = store_copy(tmp_path, without=("flashinfer-fp8-blockscale-custom-op",))
    benv = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, **VARIANTS)), "SERVOPS_PATCHES": str(store),
            "SERVOPS_RESULTS": str(tmp_path / "results")}
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv, env=benv).returncode == 0
    serving = (lab.tmp / "deploy-lab1" / "current").resolve()

    # the audit alone: the first break (the capture's largest sizes first), nothing covers it
    rc, report, text = audit_json(inv, benv, "fp8pw-bare")
    assert rc == 1, text
    first = report["rounds"][0]["breaks"][0]
    assert first["sizes"] == [64], first
    assert first["boundary_text"].endswith("-> labkernels.ops.quantization.per_token_group_quant"), first
    assert "marked as skipped" in first["reason_line"] and "import_module" in first["reason_line"], first
    assert report["verdict"] == "uncovered"
    assert "--cuda-graph-backend-prefill breakable" in report["workaround"]  # 0.5.21's own flag

    # the deploy refuses it before anything stops: the baseline still serves
    refused = run_invoke("deploy", "--variant", "fp8pw-bare", inventory=inv, env=benv, timeout=900)
    assert refused.returncode != 0 and "the audit refused the deploy" in refused.stderr, refused.stdout + refused.stderr
    assert (lab.tmp / "deploy-lab1" / "current").resolve() == serving and healthy(port)

    # --fix: both breaks, each at its own size, each wrapped, proven, stored
    rc, report, text = audit_json(inv, benv, "fp8pw-bare", "--fix")
    assert rc == 0, text
    assert report["verdict"] == "fixed", report
    boundaries = [b["boundary_text"] for r in report["rounds"] for b in r["breaks"]]
    assert any(b.endswith("labkernels.ops.quantization.per_token_group_quant") for b in boundaries), boundaries
    assert any(b.endswith("labgemm.gemm.fp8_blockscale_gemm") for b in boundaries), boundaries
    sizes = [b["sizes"] for r in report["rounds"] for b in r["breaks"]]
    assert [64] in sizes and any(s and s[0] < 32 for s in sizes), sizes
    written = sorted(report["written"])
    assert written == ["audit-fp8-blockscale-gemm-1.0.0", "audit-per-token-group-quant-1.0.0"], written
    for name in written:
        meta = yaml.safe_load((store / "servops-lab-kernels" / f"{name}.yml").read_text())
        assert meta["applies_to"] == "servops-lab-kernels==1.0.0"
        proof = meta["synthesised"]["proven"]
        assert proof["ok"] and proof["captured_sizes"] == [4, 8, 16, 32, 64], proof
        assert proof["max_abs_logprob_diff"] <= proof["tolerance"]
    gemm = (store / "servops-lab-kernels" / "audit-fp8-blockscale-gemm-1.0.0.patch").read_text()
    assert "torch.library.custom_op" in gemm and "register_fake" in gemm
    assert "weight.shape[0]" in gemm  # the output's columns follow the weight's rows, as probed

    # the deploy takes the stored fixes, is healthy; history holds each audit round
    deployed = run_invoke("deploy", "--variant", "fp8pw-bare", inventory=inv, env=benv, timeout=900)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "audit-per-token-group-quant-1.0.0" in deployed.stdout and healthy(port)
    # every round of the deploy's audit had run in `audit --fix` with the same launch, set and
    # installation: their verdicts stand, no audit server started (servops/remote/audit_verdicts.py)
    assert "its verdict stands, no audit server started" in deployed.stdout, deployed.stdout
    log = (lab.tmp / "deploy-lab1" / "current" / "server.log").read_text()
    assert "Capturing num tokens (num_tokens=4" in log and "Capture piecewise cuda graph end." in log
    history = run_invoke("history", "--json", inventory=inv, env=benv)
    audits = [e for e in map(json.loads, history.stdout.splitlines()) if e.get("action") == "audit"]
    assert len(audits) >= 4, audits  # the rounds of both audits, and the deploy's own

    # rollback reverts the synthesised patches with the rest of the set
    back = run_invoke("rollback", inventory=inv, env=benv)
    assert back.returncode == 0, back.stdout + back.stderr
    verify = run_invoke("inspect", "--verify", "servops-lab-kernels", inventory=inv, env=benv)
    assert "gemm.py" not in verify.stdout and "quantization/__init__.py" not in verify.stdout, verify.stdout

    # a campaign's trial of the variant: its report shows the set as deployed, the audit's patches
    # with the variant's own (on the H100 the table showed the variant's two and hid the third)
    camps = tmp_path / "camps"
    camps.mkdir()
    (camps / "pwcamp.yml").write_text("base: baseline\ncandidates: [{variant: fp8pw-bare}]\n"
                                      "bench: {levels: [1], requests: 4, input_len: 16, output_len: 8}\n"
                                      "objective: {maximize: output_tps@1}\nleave: base\n")
    tuned = run_invoke("tune", "pwcamp", inventory=inv, env=dict(benv, SERVOPS_CAMPAIGNS=str(camps)), timeout=900)
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    # where its deploy's time went before the old server stopped: the audit stage (its verdicts kept)
    line = next(l for l in tuned.stdout.splitlines() if "fp8pw-bare" in l and " deploy " in l)
    assert re.search(r"healthy in [\d.]+s \(audit [\d.]+s before the old server stopped\)", line), line
    table = tuned.stdout[tuned.stdout.index("campaign pwcamp"):]
    for name in written:
        assert f"+ patch {name} (the audit's)" in table, table
    assert "+ patch cuda-version-no-subprocess" in table and "cuda-version-no-subprocess (the audit's)" not in table
    trials = [json.loads(l) for l in (tmp_path / "results" / "lab1" / "campaigns" / "pwcamp" / "trials.jsonl")
              .read_text().splitlines()]
    done = next(e for e in trials if e.get("phase") == "done" and e.get("trial") == "fp8pw-bare")
    assert done["patches"][0] == "cuda-version-no-subprocess" and sorted(done["patches"][1:]) == written, done
    deployed_entries = {e["trial"]: e for e in trials if e.get("phase") == "deployed"}
    assert "audit_s" in deployed_entries["fp8pw-bare"] and "audit_s" not in deployed_entries["base"]


def test_the_hand_written_gemm_patch_leaves_one_break_and_a_host_without_the_model_is_not_audited(
        lab, sglang_release, tmp_path):
    env = sglang_release(VERSION)
    inv, _port = release_lab(lab, env, tmp_path, model_path=str(fp8_model(tmp_path)))
    benv = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, **VARIANTS)),
            "SERVOPS_PATCHES": str(store_copy(tmp_path)), "SERVOPS_RESULTS": str(tmp_path / "results")}
    rc, report, text = audit_json(inv, benv, "fp8pw")
    assert rc == 1, text
    breaks = [b for r in report["rounds"] for b in r["breaks"]]
    assert len(breaks) == 1 and breaks[0]["sizes"] == [64], breaks  # the FP8 GEMM is already an opaque op

    gone, _ = release_lab(lab, env, tmp_path, model_path=str(tmp_path / "no-such-model"))
    res = run_invoke("audit", "--variant", "fp8pw", inventory=gone, env=benv)
    assert res.returncode == 0 and "NOT audited" in res.stdout and "config.json" in res.stdout, res.stdout + res.stderr


def test_an_audit_killed_midway_leaves_no_audit_server_and_the_next_one_sweeps_its_directory(
        lab, sglang_release, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    env = sglang_release(VERSION)
    inv, _port = release_lab(lab, env, tmp_path, model_path=str(fp8_model(tmp_path)))
    benv = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, **VARIANTS)),
            "SERVOPS_PATCHES": str(store_copy(tmp_path)), "SERVOPS_RESULTS": str(tmp_path / "results"),
            "SGLANG_DOUBLE_LOAD_TIME": "120"}  # the audit server sits in its start until killed

    mark = f"CUDA_HOME={lab.tmp / 'cuda'}".encode()  # this lab's launch env, which the audit server gets

    def audit_servers() -> dict[int, str]:
        """pid -> work directory of each audit server process of this lab."""
        found = {}
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cwd = os.readlink(proc / "cwd")
                if cwd.startswith("/tmp/servops-audit-") and mark in (proc / "environ").read_bytes():
                    found[int(proc.name)] = cwd
            except OSError:
                continue
        return found

    controller = subprocess.Popen([sys.executable, "-m", "invoke", "audit", "--variant", "fp8pw", "-I", str(inv)],
                                  cwd=REPO, env=dict(os.environ, **benv), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and not audit_servers():
        time.sleep(0.5)
    work_dirs = set(audit_servers().values())
    assert work_dirs, "the audit server never started"
    os.killpg(controller.pid, signal.SIGKILL)  # the controller dies: its SSH connection drops
    controller.wait()
    deadline = time.time() + 60
    while time.time() < deadline and audit_servers():
        time.sleep(0.5)
    assert not audit_servers(), "an audit server outlived its audit"
    # the killed program could not clean up its work directory: the next audit on the host does (any
    # audit: another test's, running beside this one, may get there first)
    benv.pop("SGLANG_DOUBLE_LOAD_TIME")
    run_invoke("audit", "--variant", "fp8pw", inventory=inv, env=benv, timeout=600)
    assert not [d for d in work_dirs if Path(d).exists()]
