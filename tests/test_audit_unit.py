"""The audit's pure parts, with no host: a break record read (boundary, sizes, candidates), the fix
synthesised from the probe, the shrunk model config, the launch compiles or not.

Records and probes are fixtures from servops' own audit of the lab (tests/fixtures/audit/, their
`source` says how they were made: the real dynamo of CPU torch 2.13 over the lab kernels). The
synthesised diff is then applied with the real patch(1) to the lab kernels' real files and run under
the real torch.compile(fullgraph=True) in the base venv: the proof that it compiles and equals eager."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from servops import audit, engines, synth
from servops.auditstage import launch_compiles
from servops.lab import venvs
from servops.lab import modelgen
from servops.remote.model_shrink import audit_memory, read_config, shrink_config, shrunk_weight_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
ENGINE_CODE = ("sglang", "sgl_kernel", "sglang_double", "piecewise_model", "sglang_args")


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def synthesised(name: str, wraps: str) -> synth.Synthesis:
    data = fixture(name)
    brk = audit.analyse(data["record"], ENGINE_CODE)
    frame = next(f for f in brk["candidates"] if f"{f['module']}:{f['qualname']}" == wraps)
    return synth.synthesise(brk, frame, data["probes"][wraps]["reply"], "unit")


def test_a_break_names_its_boundary_its_size_and_the_functions_that_could_be_wrapped():
    brk = audit.analyse(fixture("lab-kernel-loader.json")["record"], ENGINE_CODE)
    assert brk["boundary_text"] == "piecewise_model.PiecewiseModel.linear -> labkernels.ops.quantization.per_token_group_quant"
    assert brk["sizes"] == [64]
    assert "import_module" in brk["reason_line"]
    # innermost first; a method (KernelSpec.load) and torch's own polyfill are not candidates
    assert [f["qualname"] for f in brk["candidates"]] == ["get_kernel", "per_token_group_quant"]
    gemm = audit.analyse(fixture("lab-jit-loader.json")["record"], ENGINE_CODE)
    assert gemm["sizes"] == [16] and "posix.stat" in gemm["reason_line"]
    assert gemm["boundary_text"].endswith("-> labgemm.gemm.fp8_blockscale_gemm")


def test_without_engine_frames_the_boundary_is_the_last_frame_and_its_untraceable_callee():
    brk = audit.analyse(fixture("lab-kernel-loader.json")["record"], ("sglang",))
    assert brk["boundary_text"] == "labkernels.spec.KernelSpec.load -> import_module"


def test_the_same_break_from_several_ranks_is_one():
    record = fixture("lab-kernel-loader.json")["record"]
    assert len(audit.distinct([audit.analyse(record, ENGINE_CODE)] * 3)) == 1


def test_a_function_returning_a_python_value_cannot_be_wrapped():
    with pytest.raises(synth.CannotWrap, match="returns a Python value"):
        synthesised("lab-kernel-loader.json", "labkernels.selector:get_kernel")


def test_the_quant_op_schema_fake_and_guard_follow_the_capture_and_the_probe():
    s = synthesised("lab-kernel-loader.json", "labkernels.ops.quantization:per_token_group_quant")
    assert s.schema == ("(Tensor input, Tensor? output_q, Tensor? output_s, SymInt group_size, float eps, "
                        "bool column_major_scales) -> (Tensor, Tensor)")
    assert s.meta["applies_to"] == "servops-lab-kernels==1.0.0"
    assert s.file == "labkernels/ops/quantization/__init__.py"
    # the scales' columns follow the input's, divided by the group-size argument (probed at two K)
    assert "input.shape[1] // group_size" in s.text and "float8_e4m3fn" in s.text
    assert "if output_q is None and output_s is None:" in s.text


def test_the_gemm_fake_follows_the_weight_and_the_dtype_argument():
    s = synthesised("lab-jit-loader.json", "labgemm.gemm:fp8_blockscale_gemm")
    assert s.schema == "(Tensor input, Tensor weight, Tensor? weight_scale, ScalarType? out_dtype) -> Tensor"
    assert "input.new_empty((input.shape[0], weight.shape[0],), dtype=(out_dtype if out_dtype is not None" in s.text
    assert "if input_scale is None and weight_scale is not None:" in s.text  # untyped None: not an op argument


def lab_kernels_copy(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    shutil.copytree(venvs.LAB_KERNELS, site, ignore=shutil.ignore_patterns("*.md", "__pycache__"))
    return site


@pytest.mark.parametrize("name,wraps,call", [
    ("lab-kernel-loader.json", "labkernels.ops.quantization:per_token_group_quant",
     "from labkernels.ops.quantization import per_token_group_quant as f\n"
     "def fwd(x):\n    q, s = f(x, None, None, 128)\n    return q.float() * s.repeat_interleave(128, -1)\n"
     "x = torch.rand(48, 256) - 0.5\nother = torch.rand(20, 512) - 0.5\n"),
    ("lab-jit-loader.json", "labgemm.gemm:fp8_blockscale_gemm",
     "from labgemm import fp8_blockscale_gemm as f\n"
     "w = (torch.rand(1024, 256) - 0.5).to(torch.float8_e4m3fn); ws = torch.rand(8, 2) + 0.5\n"
     "def fwd(x):\n    return f(x, w, None, ws, torch.bfloat16)\n"
     "x = (torch.rand(16, 256) - 0.5).to(torch.bfloat16)\nother = (torch.rand(5, 256) - 0.5).to(torch.bfloat16)\n"),
], ids=["quant", "gemm"])
def test_the_synthesised_patch_applies_with_patch1_and_compiles_whole_equal_to_eager(tmp_path, remote_env, name, wraps,
                                                                                   call):
    s = synthesised(name, wraps)
    site = lab_kernels_copy(tmp_path)
    pristine = (site / s.file).read_text()
    applied = subprocess.run(["patch", "-p1", "-F0", "-d", str(site)], input=s.text, text=True, capture_output=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    cuda = tmp_path / "cuda"
    cuda.mkdir()
    (cuda / "version.json").write_text('{"cuda": {"version": "12.9.1"}}')
    # beside them, the base venv's FlashInfer JIT files with the version patch (labgemm asks FlashInfer for
    # the CUDA version, as a GPU host's venv would have them patched by the fix set)
    shutil.copytree(remote_env["site"] / "flashinfer" / "jit", site / "flashinfer" / "jit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["patch", "-p1", "-s", "-d", str(site)], check=True,
                   input=(Path(__file__).parents[1] / "patches/flashinfer-python/cuda-version-no-subprocess.patch").read_text(),
                   text=True)
    program = ("import torch\n" + call +
               "eager = fwd(x)\n"
               "torch._dynamo.maybe_mark_dynamic(x, 0)\n"
               "compiled = torch.compile(fwd, fullgraph=True, backend='eager')\n"
               "assert torch.equal(compiled(x).float(), eager.float())\n"
               "assert torch.equal(compiled(other).float(), fwd(other).float())\n"
               "print('compiled == eager')\n")
    py = Path(remote_env["venv"]) / "bin" / "python"
    env = {"PYTHONPATH": str(site), "CUDA_HOME": str(cuda), "PATH": "/usr/bin:/bin"}
    ok = subprocess.run([str(py), "-c", program], env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "compiled == eager" in ok.stdout, ok.stderr[-3000:]
    (site / s.file).write_text(pristine)  # the pristine function breaks dynamo at the same call
    broken = subprocess.run([str(py), "-c", program], env=env, capture_output=True, text=True, timeout=300)
    assert broken.returncode != 0 and "Unsupported" in broken.stderr, broken.stderr[-2000:]


def test_an_output_whose_size_follows_no_input_is_data_dependent(tmp_path, remote_env):
    """A real function (a boolean mask's rows) probed by the real shim in the base venv."""
    mod = tmp_path / "masked.py"
    mod.write_text("import torch\n\ndef positive_rows(x):\n    return x[x[:, 0] > 0.5]\n")
    request = {"module": "masked", "qualname": "positive_rows", "kwargs": {},
               "args": [{"kind": "tensor", "shape": [{"sym": "s0", "hint": 64}, 8], "stride": [8, 1],
                         "dtype": "torch.float32", "device": "cpu"}],
               "cases": [{"sizes": {"s0": n}} for n in (64, 128, 256, 512)]}
    req = tmp_path / "request.json"
    req.write_text(json.dumps(request))
    out = subprocess.run([str(Path(remote_env["venv"]) / "bin" / "python"), str(audit.SHIM), "probe", str(req)],
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=120)
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    params = synth.bind(reply["signature"], request["args"], {})
    with pytest.raises(synth.CannotWrap, match="data-dependent"):
        synth.fit_outputs(reply["cases"], params)


# ---- the shrunk model: real configs' layer layouts (values as their public config.json give them) ----

def test_a_dense_model_keeps_one_layer_and_the_rest_of_its_config():
    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,  # Llama-3.1-8B
             "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    shrunk, info = shrink_config(llama)
    assert shrunk["num_hidden_layers"] == 1 and shrunk["hidden_size"] == 4096 and info == {"layers": 32, "kept": 1,
                                                                                          "kinds": 1}
    assert shrunk["quantization_config"] == llama["quantization_config"]


def test_deepseek_keeps_one_dense_and_one_moe_layer():
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "first_k_dense_replace": 3,  # DeepSeek-V3
          "moe_layer_freq": 1, "n_routed_experts": 256, "num_nextn_predict_layers": 1}
    shrunk, info = shrink_config(v3)
    assert shrunk["num_hidden_layers"] == 2 and shrunk["first_k_dense_replace"] == 1 and info["kinds"] == 2


def test_qwen3_moe_with_dense_layers_listed_keeps_both_kinds():
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48, "num_experts": 128,  # Qwen3-30B-A3B
            "decoder_sparse_step": 1, "mlp_only_layers": []}
    assert shrink_config(qwen)[0]["num_hidden_layers"] == 1
    mixed = dict(qwen, mlp_only_layers=[0, 1, 2])
    shrunk, _ = shrink_config(mixed)
    assert shrunk["num_hidden_layers"] == 4 and shrunk["mlp_only_layers"] == [0, 1, 2]


def test_per_layer_lists_are_cut_with_the_layers():
    gpt_oss = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 24, "num_local_experts": 32,  # gpt-oss-20b
               "layer_types": ["sliding_attention", "full_attention"] * 12}
    shrunk, info = shrink_config(gpt_oss)
    assert shrunk["num_hidden_layers"] == 2 and shrunk["layer_types"] == ["sliding_attention", "full_attention"]
    qwen_next = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 48, "num_experts": 512,  # Qwen3-Next-80B-A3B
                 "full_attention_interval": 4, "decoder_sparse_step": 1}
    assert shrink_config(qwen_next)[0]["num_hidden_layers"] == 4
    vlm = {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
           "text_config": {"num_hidden_layers": 28}, "vision_config": {"depth": 32}}
    shrunk, _ = shrink_config(vlm)
    assert shrunk["text_config"]["num_hidden_layers"] == 1 and shrunk["vision_config"] == {"depth": 32}


def test_a_config_without_a_layer_count_is_said_so():
    shrunk, why = shrink_config({"model_type": "glm_moe_dsa"})
    assert shrunk is None and "num_hidden_layers" in why


def test_the_config_is_read_bounded_never_from_a_fifo_or_a_device(tmp_path):
    import os
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    assert "not a regular file" in read_config(str(fifo))[1]
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "config.json").symlink_to("/dev/zero")
    assert "not a regular file" in read_config(str(dev))[1]
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text("{" + " " * (5 << 20) + "}")
    assert "bytes" in read_config(str(big))[1]


# ---- the audit server's GPU memory: the shrunk weights, sized against what is free now -------------

def checkpoint_headers(out: Path, shape: str, dtype: str) -> int:
    """A checkpoint's safetensors files as modelgen lays them out, headers only (sparse files of
    their real length, no weights written); the bytes of its tensors outside the layers and in layer 0."""
    out.mkdir()
    specs = modelgen.tensor_specs(modelgen.shape_of(shape), dtype)
    for i, part in enumerate(modelgen.shards(specs)):
        with open(out / f"model-{i + 1:05d}.safetensors", "wb") as f:
            f.write(modelgen.safetensors_header(part))
            f.truncate(f.tell() + sum(map(modelgen.nbytes, part)))
    return sum(modelgen.nbytes(s) for s in specs if ".layers." not in s[0] or ".layers.0." in s[0])


def test_the_shrunk_weights_are_read_from_the_checkpoints_headers(tmp_path):
    kept_one = checkpoint_headers(tmp_path / "llama8b", "llama3-8b", "fp8")
    assert shrunk_weight_bytes(str(tmp_path / "llama8b"), 1) == kept_one
    assert 2.2e9 < kept_one < 2.4e9  # the 128,256 x 4,096 embedding and head in bf16 are most of it
    assert shrunk_weight_bytes(str(tmp_path / "llama8b"), 32) > 9.0e9  # every layer: the whole 9.1 GB
    assert shrunk_weight_bytes(str(tmp_path), 1) is None  # no safetensors: not known, never 0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.safetensors").write_bytes(b"\xff" * 8 + b"{}")  # a header length past any real one
    assert shrunk_weight_bytes(str(tmp_path / "bad"), 1) is None


def sglang_kv_bytes(free_before: float, weights: float, fraction: float) -> float:
    """sglang 0.5.17's KV pool (kv_cache_configurator._profile_available_bytes): what is free after
    the weights, less (1 - fraction) of what was free before them."""
    return (free_before - weights) - free_before * (1 - fraction)


def test_beside_a_serving_server_the_audits_share_is_sized_for_its_weights():
    # the H100 of 2026-12-07: a serving 8B server held ~37 GiB (nvidia-smi: 38,474 MiB in all) when
    # the deploy's audit started; with --mem-fraction-static 0.05 of what was free, the shrunk model's
    # 2.3 GB of weights left the KV pool nothing and the audit server died at start
    gpu = {"index": 0, "total_mib": 81559, "free_mib": 81559 - 36700}
    weights_mib = 2.3e9 / 2 ** 20
    assert sglang_kv_bytes(gpu["free_mib"] - 1024, weights_mib, 0.05) < 0
    sized = audit_memory([gpu], 0.05, 3072, "free", weights_mib)
    assert not sized["short"]
    assert sglang_kv_bytes(gpu["free_mib"] - 1024, weights_mib, float(sized["value"])) >= 2048
    # alone on the card the share is what it was; vLLM's share is of the whole card either way
    assert audit_memory([dict(gpu, free_mib=81000)], 0.05, 3072, "free", weights_mib)["value"] == "0.054"
    assert audit_memory([gpu], 0.05, 3072, "total", weights_mib)["value"] == "0.053"
    # not known: the configured share, at least a KV reserve
    assert audit_memory([gpu], 0.05, 3072, "total", None)["value"] == "0.050"


def test_too_little_free_memory_for_the_weights_is_not_audited_with_what_it_needs():
    gpu = {"index": 0, "total_mib": 81559, "free_mib": 6000}
    sized = audit_memory([gpu], 0.05, 3072, "free", 4000)
    assert sized["short"] == [gpu] and sized["need_mib"] == 4000 + 2048 + 3072


def test_an_audit_server_that_died_at_start_is_said_to_have_died_of_its_root_error():
    # the H100's audit beside a serving server (2026-12-07) reported only the two lines that close
    # every such sglang log; the error above them is sglang 0.5.17's own (kv_cache_configurator.py)
    tail = ["[2026-12-07 13:48:20] Load weight end. elapsed=1.07 s, type=LlamaForCausalLM",
            "[2026-12-07 13:48:31] Scheduler hit an exception: Traceback (most recent call last):",
            '  File "/tmp/sgvenv/lib/python3.12/site-packages/sglang/srt/managers/scheduler.py", line 3000, '
            "in run_scheduler_process",
            "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank)",
            '  File "/tmp/sgvenv/lib/python3.12/site-packages/sglang/srt/mem_cache/kv_cache_configurator.py", '
            "line 1646, in _profile_available_bytes",
            "    raise ValueError(",
            "ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.05. "
            "Raise --mem-fraction-static above 0.952 (minimum viable = 1 - available/pre = 0.9512).",
            "",
            "[2026-12-07 13:48:32] Received sigquit from a child process. It usually means the child failed.",
            "[2026-12-07 13:48:32] kill_process_tree called: parent_pid=3433, include_parent=True, pid=3433"]
    assert audit.why_it_ended(tail).startswith("ValueError: Loaded weights leave no GPU memory for the KV cache")
    # no error in the tail: its last lines, as before
    assert audit.why_it_ended(tail[-2:]) == " | ".join(tail[-2:])
    assert audit.why_it_ended(None) == ""


# ---- which launches compile -----------------------------------------------------------------------

def test_which_sglang_launches_compile():
    sg = engines.get("sglang")
    assert launch_compiles(sg, {"cuda-graph-backend-prefill": "tc_piecewise"}, "0.5.17")
    assert not launch_compiles(sg, {"cuda-graph-backend-prefill": "breakable"}, "0.5.17")
    assert launch_compiles(sg, {"enable-piecewise-cuda-graph": True}, "0.5.9")
    assert launch_compiles(sg, {}, "0.5.12")  # 0.5.10-0.5.13 run piecewise by default
    assert not launch_compiles(sg, {"disable-piecewise-cuda-graph": True}, "0.5.12")
    assert launch_compiles(sg, {"enable-torch-compile": True}, "0.5.23")
    assert not launch_compiles(sg, {"enable-torch-compile": False}, "0.5.23")
    vl = engines.get("vllm")
    assert launch_compiles(vl, {}, "0.32.0") and not launch_compiles(vl, {"enforce-eager": True}, "0.32.0")


def test_the_workaround_and_the_eager_reference_are_the_releases_own_flags():
    sg = engines.get("sglang")
    assert sg.workaround("0.5.17") == "change flag --cuda-graph-backend-prefill breakable (or disabled)"
    assert sg.workaround("0.5.12") == "change flag --disable-piecewise-cuda-graph"
    assert "on sglang <0.5.10" in sg.workaround(None) and engines.get("vllm").workaround(None).endswith("--enforce-eager")
    assert sg.eager_prefill_args("0.5.17")["cuda-graph-backend-prefill"] == "disabled"
    assert sg.eager_prefill_args("0.5.9") == {"enable-piecewise-cuda-graph": None}


def test_the_logprob_proof_names_every_size_that_differs():
    same = {"4": [None, -1.0, -2.0], "64": [None, -3.0, -4.0]}
    assert audit.compare_logprobs(same, same, 0.02)["ok"]
    off = audit.compare_logprobs(same, {"4": [None, -1.0, -2.0], "64": [None, -3.5, -4.0]}, 0.02)
    assert not off["ok"] and [r["size"] for r in off["sizes"] if not r["ok"]] == [64]
    missing = audit.compare_logprobs(same, {"4": [None, -1.0, -2.0], "64": {"error": "HTTPError: 400"}}, 0.02)
    assert not missing["ok"] and "HTTPError" in missing["sizes"][1]["why"]


def test_a_secret_flag_stays_off_the_audit_servers_command_line():
    """The audit server's argv is readable by every user of the host (ps): a flag whose value is one
    of the launch's secrets is left out, the variant's other flags kept, the audit's overrides won."""
    from servops.inventory import parse_inventory
    from servops.playbooks import load_variant
    from servops.render import render_launch
    host = parse_inventory("all: {hosts: {h1: {venv: /opt/v, server_port: 30000, model_path: /models/m, tp: 8}}}",
                           "inv.yml").hosts["h1"]
    variant = load_variant("piecewise-fp8")
    variant["server_args"] = dict(variant["server_args"], **{"api-key": "sk-live-0123456789"})
    variant["env"] = dict(variant.get("env") or {}, HF_TOKEN="8")  # a secret as short as a flag's value
    launch = render_launch(host, variant)
    assert "sk-live-0123456789" not in launch.script            # as deploy writes it: "$SERVOPS_ARG_API_KEY"
    engine = engines.of_variant(variant)
    argv = audit.audit_argv(engine, launch, engine.audit_args("/tmp/shrunk", "31999", "0.1"))
    assert "sk-live-0123456789" not in argv and "--api-key" not in argv
    assert argv[argv.index("--model-path") + 1] == "/tmp/shrunk" and "--load-format" in argv
    assert "--cuda-graph-backend-prefill" in argv or "--enable-piecewise-cuda-graph" in argv
    assert argv[argv.index("--tp-size") + 1] == "8"  # never taken for that secret
