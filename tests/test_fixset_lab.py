"""The seed's story as the GPU showed it (bench/evidence/seed-sm90/), in the lab: the real sglang 0.5.21
parser on this CPU, the SGLang double serving, the block-FP8 linear of --fp8-gemm-backend
flashinfer_deepgemm under the piecewise (tc_piecewise) capture traced over the venv's real FlashInfer
files. Without patches the capture crashes in FlashInfer's version query; with the flashinfer patch
alone it crashes again, now in FlashInfer's JIT loader, and diagnose names that; with the complete fix
set (piecewise resolves it for the release) it is healthy; rollback reverts the whole set."""

import json

from conftest import playbooks_with, run_invoke
from test_sglang_releases import release_lab

VERSION = "0.5.21"  # the lab's sglang (servops/lab/manage.py)
FP8 = "  fp8-gemm-backend: flashinfer_deepgemm\n"
VARIANTS = {
    # the shipped piecewise variant on a block-FP8 model: its `when:` rules give the release's fix set
    "fp8pw": "extends: piecewise\nserver_args:\n" + FP8,
    # the flashinfer patch alone (what servops shipped before): the version query only
    "fp8pw-fi": "extends: baseline\nserver_args:\n" + FP8 + "patches: [cuda-version-no-subprocess]\n"
                "when:\n  - sglang: '>=0.5.14,<0.5.22'\n    server_args: {cuda-graph-backend-prefill: tc_piecewise}\n",
}


def diagnosis(inv, env) -> dict:
    res = run_invoke("diagnose", "--json", inventory=inv, env=env)
    return json.loads(res.stdout)


def known_ids(report) -> list[str]:
    text = json.dumps(report)
    return [i for i in ("dynamo-get-cuda-version-subprocess", "dynamo-flashinfer-jit-loader", "dynamo-unsupported")
            if f'"{i}"' in text]


def test_the_version_patch_alone_crashes_in_the_jit_loader_and_the_complete_set_is_healthy(lab, sglang_release, tmp_path):
    env = sglang_release(VERSION)
    inv, port = release_lab(lab, env, tmp_path)
    benv = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, **VARIANTS))}
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv, env=benv).returncode == 0

    crash = run_invoke("deploy", "--variant", "fp8pw", "--skip-patches", inventory=inv, env=benv)
    assert crash.returncode == 4, crash.stdout + crash.stderr
    assert known_ids(diagnosis(inv, benv))[0] == "dynamo-get-cuda-version-subprocess"

    partial = run_invoke("deploy", "--variant", "fp8pw-fi", inventory=inv, env=benv)
    assert partial.returncode == 4, partial.stdout + partial.stderr
    report = diagnosis(inv, benv)
    assert known_ids(report)[0] == "dynamo-flashinfer-jit-loader", json.dumps(report)[:3000]
    assert "flashinfer-fp8-blockscale-custom-op" in json.dumps(report)  # the fix it names

    full = run_invoke("deploy", "--variant", "fp8pw", inventory=inv, env=benv)
    assert full.returncode == 0, full.stdout + full.stderr
    assert "flashinfer-fp8-blockscale-custom-op" in full.stdout
    # the launch compiles: the deploy audits its compiled region first; this host's model has no config with
    # layers to shrink, and the deploy says the audit did not happen, never a pass
    assert "NOT audited" in full.stdout and "num_hidden_layers" in full.stdout, full.stdout
    log = (lab.tmp / "deploy-lab1" / "current" / "server.log").read_text()
    assert "Capture piecewise cuda graph end." in log
    status = run_invoke("patch.status", inventory=inv, env=benv)
    assert status.stdout.count("applied") >= 2, status.stdout

    back = run_invoke("rollback", inventory=inv, env=benv)
    assert back.returncode == 0, back.stdout + back.stderr
    verify = run_invoke("inspect", "--verify", "sglang,flashinfer-python", inventory=inv, env=benv)
    assert "fp8_utils.py" not in verify.stdout and "cpp_ext.py" not in verify.stdout, verify.stdout
