"""A deploy's pure stages from fixture facts, no host (issue 39): resolve (the `when:` rules of
the host's engine version), the branches the facts trip carries (so the check of whichever
version the host has is in that one trip), the check's verdict read from the facts, and the
plan ("unchanged" or what changes). The facts are dicts shaped as the host's check program
replies (servops/remote/launch_check.py with deploy_facts.py); the same stages run over the
real lab in tests/test_deploy_roundtrips.py and tests/test_deploy.py."""

from __future__ import annotations

import copy

import pytest

from servops import deploystages as stages
from servops import patchstore
from servops.errors import ServopsError
from servops.inventory import parse_inventory
from servops.launchcheck import LaunchRefused, launch_branches, raise_if_refused, resolve, verdict
from servops.patchplan import PatchPlanError
from servops.playbooks import load_variant
from servops.render import render_launch

HOST = parse_inventory("all: {hosts: {h1: {venv: /opt/v, server_port: 30000, model_path: /models/glm5, tp: 8}}}",
                       "inv.yml").hosts["h1"]
STORE = patchstore.all_patches()
FP8 = "flashinfer-fp8-blockscale-custom-op"  # sglang >=0.5.9,<0.5.24


def ok_result(gpus_needed: int = 8) -> dict:
    """validate()'s result for a launch the parser accepts, with the launch facts."""
    return {"ok": True, "problems": [], "warnings": [], "values": {"model_path": "/models/glm5", "tp_size": 8},
            "facts": {"model": {"path": "/models/glm5", "state": "dir", "config": True}, "gpus_needed": gpus_needed}}


def patch_entries(applied: set[str] = frozenset(), version: str = "0.5.23", state: str | None = None) -> list[dict]:
    """The patch program's status entries for every patch in the store (in the store's order)."""
    rows = []
    for p in STORE:
        s = state or ("applied" if p.name in applied else "not-applied")
        rows.append({"name": p.name, "dist": p.distribution, "version": version if p.distribution == "sglang"
                     else "0.3.1", "recorded": p.name in applied, "state": s})
    return rows


def host_facts(variant: dict, version: str | None = "0.5.23", *, parser: str | None = "cached",
               result: dict | None = None, port_state: str = "free", gpus: int | None = 8,
               current: dict | None = None, applied: set[str] = frozenset()) -> dict:
    """The facts trip's reply for `variant` on HOST: every branch the controller sent, each
    with `result` (default: accepted)."""
    sent, _env = launch_branches(HOST, variant)
    return {"python": "/opt/v/bin/python", "python_version": "3.11.9",
            "sglang": {"version": version, "parser": parser, "note": None, "prog": "launch_server.py",
                       "actions": 412, "unchecked": [], "skipped": [], "cache": "hit"},
            "branches": {b["id"]: copy.deepcopy(result or ok_result()) for b in sent},
            "port": {"port": 30000, "state": port_state, **({"pid": 4242} if port_state == "ours" else {})},
            "gpus": None if gpus is None else {"count": gpus, "names": [f"GPU {i}: NVIDIA B200" for i in range(gpus)]},
            "timings": {"cache_s": 0.05, "host_s": 0.21}, "sent": sent, "elapsed_s": 0.3,
            "deploy_root": "~/.servops/deploy",
            "deploy": {"root": "/home/ops/.servops/deploy", "current": current or {"name": None},
                       "patches": patch_entries(applied, version or "0.5.23"), "patches_recovered": None, "lock": None}}


def stages_to_check(variant: dict, facts: dict):
    resolved, applied = resolve(variant, facts)
    launch = render_launch(HOST, resolved)
    return resolved, launch, verdict(HOST, variant, resolved, applied, launch, facts)


# ---- resolve ------------------------------------------------------------------------------------

def test_resolve_applies_the_when_rules_of_the_hosts_engine_version():
    base = load_variant("baseline")
    resolved, rules = resolve(base, host_facts(base, "0.5.23"))
    assert "cuda-graph-max-bs-decode" in resolved["server_args"] and "cuda-graph-max-bs" not in resolved["server_args"]
    assert resolved["server_args"]["cuda-graph-backend-prefill"] == "disabled" and len(rules) == 1
    resolved, rules = resolve(base, host_facts(base, "0.5.12"))
    assert resolved["server_args"]["disable-piecewise-cuda-graph"] is True and len(rules) == 1
    resolved, rules = resolve(base, host_facts(base, "0.5.9"))
    assert rules == [] and resolved["server_args"]["cuda-graph-max-bs"] == 256
    resolved, rules = resolve(base, host_facts(base, None))  # no sglang on the host: the variant as written
    assert rules == [] and resolved["server_args"] == base["server_args"]


@pytest.mark.parametrize("version", [None, "0.4.9", "0.5.2", "0.5.9", "0.5.10", "0.5.13", "0.5.14", "0.5.23", "0.6.1"])
def test_the_facts_trip_carries_the_launch_of_every_version_the_host_could_have(version):
    """launch_branches renders every `when:` branch before the trip: whatever the host's version
    turns out to be, its resolved launch is among those its parser checked (no second trip)."""
    for name in ("baseline", "piecewise"):
        variant = load_variant(name)
        facts = host_facts(variant, version)
        resolved, _rules = resolve(variant, facts)
        launch = render_launch(HOST, resolved)
        sent = [(b["argv"], b["env"]) for b in facts["sent"]]
        assert (launch.argv, dict(launch.env, **launch.secret_env)) in sent, (name, version)


# ---- check --------------------------------------------------------------------------------------

def test_verdict_of_an_accepted_launch():
    base = load_variant("baseline")
    resolved, launch, check = stages_to_check(base, host_facts(base, "0.5.23"))
    assert check.ok and check.problems == [] and check.argv == launch.argv and check.variant == resolved
    assert check.summary() == "launch ok on sglang 0.5.23 (sglang's parser, cached, 1 rule(s)) in 0.30s"
    raise_if_refused(check, "h1")


def test_verdict_names_the_flag_the_hosts_parser_rejected_with_its_version():
    base = load_variant("baseline")
    bad = dict(ok_result(), ok=False, problems=[{"flag": "--cuda-graph-max-bz", "kind": "unrecognized",
                                                "message": "unrecognized",
                                                "suggestions": ["--cuda-graph-max-bs-decode"]}])
    _resolved, _launch, check = stages_to_check(base, host_facts(base, "0.5.23", parser="real", result=bad))
    assert not check.ok and check.problems == [
        "--cuda-graph-max-bz: unrecognized on sglang 0.5.23; did you mean --cuda-graph-max-bs-decode?"]
    with pytest.raises(LaunchRefused, match=r"^h1: launch of baseline refused: --cuda-graph-max-bz: unrecognized"):
        raise_if_refused(check, "h1")


def test_verdict_refuses_a_busy_port_a_missing_model_and_too_few_gpus_in_the_preflight():
    base = load_variant("baseline")
    missing = dict(ok_result(), facts={"model": {"path": "/models/glm5", "state": "missing"}, "gpus_needed": 8})
    _r, _l, check = stages_to_check(base, host_facts(base, "0.5.23", result=missing, port_state="busy", gpus=4))
    assert check.problems == [
        "model path /models/glm5 does not exist on the host",
        "port 30000 is already in use by a process servops did not start; free it or change server_port",
        "needs 8 GPUs (tp x pp per node), nvidia-smi shows 4"]
    _r, _l, check = stages_to_check(base, host_facts(base, "0.5.23", port_state="ours"))
    assert check.ok  # servops' own server on the port: the deploy replaces it


def test_a_when_rule_that_refuses_the_hosts_release_is_the_first_problem():
    pw = load_variant("piecewise")
    _r, _l, check = stages_to_check(pw, host_facts(pw, "0.5.2"))
    assert not check.ok and check.problems[0].startswith("piecewise cannot run on sglang 0.5.2: ")


def test_verdict_without_the_launch_in_the_facts_asks_for_its_own_trip():
    base = load_variant("baseline")
    facts = host_facts(base, "0.5.23")
    facts["sent"] = [b for b in facts["sent"] if "--cuda-graph-backend-prefill" not in b["argv"]]
    with pytest.raises(ServopsError, match="check_missing_branch runs first"):
        stages_to_check(base, facts)


# ---- plan ---------------------------------------------------------------------------------------

def running(variant: dict, version: str = "0.5.23", **changes) -> dict:
    """The current release as deploy_facts reports it, made from exactly what `variant` renders
    to on HOST at `version` (so a deploy of it changes nothing)."""
    resolved, _ = resolve(variant, {"sglang": {"version": version}})
    launch = render_launch(HOST, resolved)
    files = stages.digests(stages.launch_files(HOST, resolved, launch))
    files.setdefault("secrets.env", None)
    cur = {"name": "20261206T101500Z-baseline", "files": files, "status": "healthy", "patches": [],
           "health": {"endpoint": "/health"}, "running": True, "healthy": True}
    cur.update(changes)
    return cur


def plan_of(variant: dict, facts: dict, wanted: list[str] | None = None) -> stages.Plan:
    resolved, launch, _check = stages_to_check(variant, facts)
    return stages.plan(HOST, facts, resolved, launch, list(resolved["patches"]) if wanted is None else wanted, STORE)


def test_plan_of_a_first_deploy_and_of_an_unchanged_one():
    base = load_variant("baseline")
    first = plan_of(base, host_facts(base))
    assert first.current is None and first.unchanged is None and first.actions == []
    assert first.text("baseline") == "would deploy baseline (replacing nothing) (check mode)"
    same = plan_of(base, host_facts(base, current=running(base)))
    assert same.unchanged == "20261206T101500Z-baseline" and same.actions == []


@pytest.mark.parametrize("why", ["launch.sh", "secrets.env", "unhealthy", "failed", "patches", "version"])
def test_plan_is_not_unchanged_when_anything_the_server_runs_from_differs(why):
    base = load_variant("baseline")
    cur = running(base)
    if why in ("launch.sh", "secrets.env"):
        cur["files"][why] = "sha256=" + "0" * 64
    elif why == "unhealthy":
        cur["healthy"] = False
    elif why == "failed":
        cur["status"] = "failed"
    elif why == "patches":
        cur["patches"] = [FP8]
    else:  # the host moved to another sglang: another `when:` rule, another launch.sh
        cur = running(base, version="0.5.12")
    p = plan_of(base, host_facts(base, current=cur))
    assert p.unchanged is None and p.current == "20261206T101500Z-baseline"


def test_plan_applies_what_the_resolved_variant_wants_and_reverts_what_it_does_not():
    base = load_variant("baseline")
    p = plan_of(base, host_facts(base, current=running(base)), wanted=[FP8])
    assert [(a, q.name) for a, q in p.actions] == [("apply", FP8)] and p.unchanged is None
    assert p.text("baseline") == (f"would deploy baseline (replacing 20261206T101500Z-baseline); patches: apply {FP8} "
                                  f"(check mode)")
    p = plan_of(base, host_facts(base, current=running(base, patches=[FP8]), applied={FP8}))
    assert [(a, q.name) for a, q in p.actions] == [("revert", FP8)] and p.unchanged is None
    # applied and recorded as the release's: nothing to do, nothing restarted
    p = plan_of(base, host_facts(base, current=running(base, patches=[FP8]), applied={FP8}), wanted=[FP8])
    assert p.actions == [] and p.unchanged == "20261206T101500Z-baseline"


def test_plan_refuses_a_required_patch_that_cannot_apply():
    base = load_variant("baseline")
    facts = host_facts(base)
    for entry in facts["deploy"]["patches"]:
        if entry["name"] == FP8:
            entry["state"] = "conflicts"
    with pytest.raises(PatchPlanError, match=f"h1: required patch {FP8} is conflicts"):
        plan_of(base, facts, wanted=[FP8])
    facts = host_facts(base, version="0.5.24")  # outside the patch's applies_to
    with pytest.raises(PatchPlanError, match="version does not match"):
        plan_of(base, facts, wanted=[FP8])
    with pytest.raises(PatchPlanError, match="needs patch 'no-such-patch'"):
        plan_of(base, host_facts(base), wanted=["no-such-patch"])


def test_facts_request_asks_for_the_launch_files_and_every_patch_in_the_store():
    base = load_variant("baseline")
    req = stages.facts_request(HOST, base, STORE, script=True)
    assert req["files"] == ["launch.sh", "secrets.env"] and req["script"] is True
    assert [p["name"] for p in req["patches"]] == [p.name for p in STORE]


def test_plan_refuses_a_server_file_that_is_missing_locally_before_any_lock(tmp_path):
    """The release files are made in the plan stage (also for a first deploy, with nothing to
    compare them to): a server file that is not here refuses there, before the transaction."""
    host = parse_inventory(f"all: {{hosts: {{h1: {{venv: /opt/v, server_port: 30000, model_path: /m, tp: 8, "
                           f"server_module: sglang_double, server_files: [{tmp_path}/gone.py]}}}}}}",
                           "inv.yml").hosts["h1"]
    base = load_variant("baseline")
    resolved, _ = resolve(base, {"sglang": {"version": None}})
    launch = render_launch(host, resolved)
    with pytest.raises(ServopsError, match="server_files entry .*gone.py' does not exist locally"):
        stages.plan(host, host_facts(base, None), resolved, launch, [], STORE)


@pytest.mark.parametrize("found", [None, {"current": {"name": "../../etc"}, "patches": []},
                                   {"current": {"name": None}, "patches": "all"},
                                   {"current": {"name": "20261206T101500Z-baseline", "files": []}, "patches": []}])
def test_malformed_deploy_facts_are_one_line_before_any_use(found):
    from servops import hostreply
    from servops.errors import RemoteError

    with pytest.raises(RemoteError, match="^h1: launch_check sent a malformed reply"):
        hostreply.check(found, hostreply.DEPLOY_FACTS, "h1", "launch_check")
    hostreply.check(host_facts(load_variant("baseline"))["deploy"], hostreply.DEPLOY_FACTS, "h1", "launch_check")


def test_check_mode_names_what_the_deploy_lock_would_do():
    from servops.deploylock import check_mode_note

    assert check_mode_note(None, 3600, False) is None
    far = {"id": "a" * 32, "who": "bo", "controller": "elsewhere", "pid": 7, "action": "tune", "acquired_at": "t",
           "age": 10.0}
    assert "would refuse unless it is released first" in check_mode_note(far, 3600, False)
    assert check_mode_note(far, 3600, True).endswith("would break it (--break-lock)")
    assert check_mode_note(dict(far, age=7200.0), 3600, False).endswith(
        "would break it (stale: it is 7200s old (lock_stale_after=3600))")
    unreadable = {"id": None, "unreadable": True, "size": 0, "mtime": 1.0, "age": 1.0}
    assert check_mode_note(unreadable, 3600, False) == ("the deploy lock is held by an unreadable lock file: the real "
                                                        "run would break it (stale: the lock file is empty or "
                                                        "unreadable (0 bytes))")
