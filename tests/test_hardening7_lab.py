"""Hardening round 7 over the real sshd lab, on the SGLang double: a server whose log lies about
its start-up (a phase line from another clock, a date no clock shows) is deployed and kept
healthy, its phases the honest ones; a jit_cache_dir anyone can write to, or that is a file, is
refused by check and deploy before anything changes on the host.

Before: the health gate of the healthy server raised ValueError reading the lying line (the
deploy failed and rolled back), and the deploy pointed the engine's kernel caches at the shared
directory (code another user planted there runs in the server)."""

from __future__ import annotations

import json

import pytest

from conftest import current, playbooks_with, root_of, run_invoke

LIES = "|".join([
    "[2026-02-30 10:00:00] Load weight begin",                       # February 30th: strptime's ValueError
    "[2026-12-07 10:00:00] Load weight end. elapsed=1.2.3 s",         # float('1.2.3')
    "[2026-12-07 10:00:00] Capture cuda graph end. Time elapsed: 99999999999999999999 s",
])
VARIANTS = {"liar": "extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: '0.5', SGLANG_DOUBLE_LOG_LINES: '%s'}\n" % LIES,
            "plain": "extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: '0.5'}\n"}


def invoke(inv, env, *args):
    res = run_invoke(*args, inventory=inv, env=env, merged=True)
    return res.returncode, res.stdout


def test_a_server_whose_log_lies_about_its_start_up_is_deployed_healthy_with_its_honest_phases(lab, tmp_path):
    inv = lab.inventory(host_vars={"lab1": {"env": {"CUDA_HOME": str(lab.cuda_home())}}})
    env = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, **VARIANTS))}
    code, out = invoke(inv, env, "deploy", "--variant", "liar", "-H", "lab1")
    assert code == 0, out
    release = current(lab)
    assert release and release.endswith("-liar") and "rolled back" not in out
    starts = json.loads((root_of(lab) / "releases" / release / "release.json").read_text())["starts"]
    assert starts[-1]["weights_s"] == pytest.approx(0.5, abs=1.1)  # the double's own begin/end pair, not the lies
    assert "capture_s" not in starts[-1] and all(0 <= v < 1000 for v in starts[-1].values())


@pytest.mark.parametrize("make, why", [
    (lambda d: (d.mkdir(), d.chmod(0o1777)), "writable by anyone"),
    (lambda d: d.write_text("not a directory"), "is not a directory"),
])
def test_a_jit_cache_dir_that_is_unsafe_or_a_file_is_refused_before_anything_changes(lab, tmp_path, make, why):
    cache = tmp_path / "jit"
    make(cache)
    inv = lab.inventory(host_vars={"lab1": {"env": {"CUDA_HOME": str(lab.cuda_home())}, "jit_cache_dir": str(cache)}})
    env = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, **VARIANTS))}
    code, out = invoke(inv, env, "check", "--variant", "plain", "-H", "lab1")
    assert code != 0 and why in out and "jit_cache_dir" in out, out
    code, out = invoke(inv, env, "deploy", "--variant", "plain", "-H", "lab1")
    assert code != 0 and why in out, out
    assert current(lab) is None and not (root_of(lab) / "deploy.lock").exists()
    releases = root_of(lab) / "releases"
    assert not releases.exists() or list(releases.iterdir()) == []
    assert not (cache.is_dir() and any(cache.iterdir()))  # no kernel cache, no ledger made there


def test_a_jit_cache_dir_with_spaces_and_a_command_substitution_is_one_literal_directory(lab, tmp_path):
    pwned = tmp_path / "pwned"
    cache = tmp_path / f"jit cache $(touch {pwned})"
    inv = lab.inventory(host_vars={"lab1": {"env": {"CUDA_HOME": str(lab.cuda_home()), "SGLANG_DOUBLE_JIT_TIME": "0.1"},
                                            "jit_cache_dir": str(cache)}})
    env = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, **VARIANTS))}
    code, out = invoke(inv, env, "deploy", "--variant", "plain", "-H", "lab1")
    assert code == 0, out
    assert not pwned.exists()  # quoted in the launch script's exports: never run by the shell
    assert (cache / "servops-ledger.json").is_file() and oct((cache / "servops-ledger.json").stat().st_mode)[-3:] == "600"


# ---- the audit of a host whose model config lies, end to end -------------------------------------------

def test_a_compiling_deploy_onto_a_host_whose_model_config_lies_is_not_audited_and_goes_on(lab, sglang_release,
                                                                                           tmp_path):
    from test_audit_lab import CONFIG, VARIANTS as AUDIT_VARIANTS
    from test_sglang_releases import release_lab
    model = tmp_path / "model"
    model.mkdir()
    # JSON's Infinity as the layer count: an OverflowError out of the host's audit program before
    (model / "config.json").write_text(json.dumps(dict(CONFIG, num_hidden_layers=float("inf"))))
    inv, _port = release_lab(lab, sglang_release("0.5.21"), tmp_path, model_path=str(model), audit_device="cpu")
    env = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, **AUDIT_VARIANTS)), "SERVOPS_RESULTS": str(tmp_path / "r")}
    res = run_invoke("audit", "--variant", "fp8pw", "-H", "lab1", inventory=inv, env=env, timeout=600)
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "NOT audited" in text and "num_hidden_layers: inf is not a whole number" in text, text
    assert "Traceback" not in text and "OverflowError" not in text
