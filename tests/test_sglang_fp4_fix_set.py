"""The seed's own path, per sglang release: FlashInfer's fp4_quantize and mm_fp4, which sglang's NVFP4
linear (ModelOptFp4LinearMethod.apply) calls bare on Blackwell (fp4_quantize in 0.5.4.post2-0.5.11,
mm_fp4 in 0.5.3.post2-0.5.5.post2), made opaque torch.library custom ops by the sglang patches
flashinfer-fp4-quantize-custom-op-<first release> and flashinfer-mm-fp4-custom-op-<first release>.

The sweep (bench/sglang_fp4_call_sweep.py) reads each released wheel: each patch applies with real
patch(1), no fuzz, exactly where its applies_to says, removes the bare call, is refused a second time
and reverts to the exact bytes; everywhere else it is outside applies_to ("version does not match").

The proof runs on this machine's CPU torch (no Blackwell is lent): the real import block of the
release's modelopt_quant.py, pristine and patched, with the real FlashInfer release that sglang
release pins (its wheel and its pure-Python dependencies, no CUDA), the real call of
ModelOptFp4LinearMethod.apply compiled under torch.compile(fullgraph=True) with fake CUDA tensors
(FakeTensorMode). The machine states the GPU: torch.cuda.get_device_capability answers (12, 0),
torch.version.cuda "12.9" and sglang's is_sm120_supported() True, as an SM120 host answers.
Pristine, dynamo walks fp4_quantize into FlashInfer's SM120 module loader and stops at the seed's
Unsupported (_thread.allocate_lock in the CUDA version query), and mm_fp4 into FlashInfer's SM120
CUTLASS JIT generation (posix.stat); with FlashInfer's version patch alone fp4_quantize still stops
inside FlashInfer's JIT; patched, each call site compiles into one call of sglang's custom op whose
fake outputs have FlashInfer's shapes and dtypes. NOT proven here: the kernels' results (eager vs
compiled on a real SM120 GPU) and the CUDA-graph capture and replay."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from conftest import bench_script
from servops.lab import venvs
from servops.patchstore import find_patch
from servops.playbooks import load_variant, resolve

sweep = bench_script("sglang_fp4_call_sweep")
# read from the wheels: [first bare, first wrapped upstream) of each call of ModelOptFp4LinearMethod.apply
BARE = {"fp4_quantize": (Version("0.5.4.post2"), Version("0.5.12")),
        "mm_fp4": (Version("0.5.3.post2"), Version("0.5.5.post3"))}
# FlashInfer's own imports that are pure Python (its CUDA-side ones are not needed to trace)
FLASHINFER_DEPS = ["click", "einops", "ninja", "nvidia-ml-py", "requests", "tabulate", "tqdm", "urllib3",
                   "certifi", "charset-normalizer", "idna"]


@pytest.mark.parametrize("version", sweep.RELEASES)
def test_each_fp4_patch_covers_exactly_the_releases_with_its_bare_call(version):
    row = sweep.check_release(version)
    if not row["cached"]:
        pytest.skip(f"sglang {version}: not cached and the download failed (offline?)")
    bare = sorted(api for api, (first, wrapped) in BARE.items() if first <= Version(version) < wrapped)
    assert sorted({s.split()[0] for s in row["bare_linear"]
                   if s.endswith("ModelOptFp4LinearMethod.apply")}) == bare, row["bare_linear"]
    covering = [n for n, e in row["patches"].items() if e["in_applies_to"]]
    assert sorted(sweep.PATCHES[n] for n in covering) == bare, covering  # one fix per bare call
    for name, entry in row["patches"].items():
        assert entry.get("applies", False) == entry["in_applies_to"], (name, entry)  # -F0 exactly there
        if entry["in_applies_to"]:
            assert entry["fixed"] and entry["reapply_refused"] and entry["reverts_exactly"], (name, entry)
    if covering:  # the release's fixes together: no bare call left, reverted to the exact bytes
        assert all(row["together"].values()), row["together"]
    assert "PROBLEM" not in sweep.verdict(row)


def test_outside_applies_to_the_patch_says_version_does_not_match():
    patch = find_patch("flashinfer-fp4-quantize-custom-op-0.5.10")
    assert patch.version_ok("0.5.11") and not patch.version_ok("0.5.12") and not patch.version_ok("0.5.9")
    patch = find_patch("flashinfer-mm-fp4-custom-op-0.5.5")
    assert patch.version_ok("0.5.5.post2") and not patch.version_ok("0.5.5.post3")


@pytest.mark.parametrize("version,fp4_patches", [
    ("0.5.3.post2", ["flashinfer-mm-fp4-custom-op-0.5.3.post2"]),
    ("0.5.4.post1", ["flashinfer-mm-fp4-custom-op-0.5.3.post2"]),
    ("0.5.4.post2", ["flashinfer-mm-fp4-custom-op-0.5.3.post2", "flashinfer-fp4-quantize-custom-op-0.5.4.post2"]),
    ("0.5.5", ["flashinfer-mm-fp4-custom-op-0.5.5", "flashinfer-fp4-quantize-custom-op-0.5.4.post3"]),
    ("0.5.6", ["flashinfer-fp4-quantize-custom-op-0.5.4.post3"]),
    ("0.5.9", ["flashinfer-fp4-quantize-custom-op-0.5.9"]),
    ("0.5.11", ["flashinfer-fp4-quantize-custom-op-0.5.10"]),
    ("0.5.12", []),
    ("0.5.17", []),
])
def test_piecewise_adds_the_fp4_patches_of_each_release(version, fp4_patches):
    resolved, rules = resolve(load_variant("piecewise"), version)
    fp4 = [p for p in resolved["patches"] if p.startswith(("flashinfer-fp4-quantize", "flashinfer-mm-fp4"))]
    assert fp4 == fp4_patches
    assert resolved["patches"][0] == "cuda-version-no-subprocess"


# -- the proof on CPU torch ---------------------------------------------------------------------------------

HARNESS = r'''
import ast, json, sys, traceback
args = json.loads(sys.stdin.read())
sys.path[:0] = args["path"]
import torch, torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode
# The machine states its GPU and CUDA as an SM120 host's CUDA build of torch does (this CPU build has
# neither): FlashInfer picks its SM120 modules from these answers, sglang its FlashInfer import from
# is_sm120_supported().
torch.cuda.get_device_capability = lambda device=None: (12, 0)
torch.version.cuda = "12.9"
import flashinfer
source = open(args["module"]).read()
tree = ast.parse(source)
IMPORTS = {"fp4_quantize": "from flashinfer import fp4_quantize",
           "fp4_gemm": "from flashinfer import mm_fp4 as fp4_gemm"}
block = next(n for n in tree.body
             if isinstance(n, ast.Try) and IMPORTS[args["call"]] in ast.get_source_segment(source, n))
# 0.5.3.post2-0.5.4.post3 pick mm_fp4's backend from SGLANG_USE_CUTLASS_BACKEND_FOR_FP4_GEMM: set, as
# 0.5.5 defaults to "cutlass" (FlashInfer's own default, cudnn, is not installed here)
ns = {"torch": torch, "is_sm120_supported": lambda: True, "is_cuda": lambda: True,
      "USE_CUTLASS_BACKEND_FOR_FP4_GEMM": True}
exec(compile(ast.Module([block], []), args["module"], "exec"), ns)
method = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ModelOptFp4LinearMethod")
call = next(n for n in ast.walk(method) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == args["call"])
# the call as ModelOptFp4LinearMethod.apply makes it, its local names as parameters
params = "x, layer" if args["call"] == "fp4_quantize" else (
    "x_fp4, w, x_scale_interleaved, w_scale_interleaved, layer, output_dtype, backend")
exec(f"def call_site({params}):\n    return {ast.get_source_segment(source, call)}\n", ns)
graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
out = {"flashinfer": flashinfer.__version__, "call": ast.get_source_segment(source, call), "cases": []}
for m, k, dynamic in args["cases"]:
    torch._dynamo.reset()
    graphs.clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = torch.nn.Module()
        if args["call"] == "fp4_quantize":
            x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
            layer.input_scale_inv = torch.nn.Parameter(torch.empty(1, device="cuda"), requires_grad=False)
            inputs = (x, layer)
        else:  # NVFP4 operands as apply passes them: the weight and its scales transposed
            n = 64
            x = torch.empty(m, k // 2, dtype=torch.uint8, device="cuda")
            weight = torch.empty(n, k // 2, dtype=torch.uint8, device="cuda")
            x_sf = torch.empty((m + 127) // 128 * 128, k // 16, dtype=torch.uint8, device="cuda")
            w_sf = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device="cuda")
            layer.alpha = torch.nn.Parameter(torch.empty((), device="cuda"), requires_grad=False)
            inputs = (x, weight.T, x_sf, w_sf.T, layer, torch.bfloat16, "cutlass")
        if dynamic:
            torch._dynamo.mark_dynamic(x, 0)
        try:
            res = torch.compile(ns["call_site"], fullgraph=True, backend=backend)(*inputs)
        except torch._dynamo.exc.Unsupported as e:
            out["cases"].append({"result": "unsupported", "message": str(e), "traceback": traceback.format_exc()})
            continue
        ops = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
        res = res if isinstance(res, tuple) else (res,)
        out["cases"].append({"result": "compiled", "ops": ops,
                             "outputs": [[list(t.shape), str(t.dtype), t.device.type] for t in res]})
print(json.dumps(out))
'''


def _pinned_flashinfer(sglang_version: str) -> str:
    whl = sweep.cached_sglang_wheel(sglang_version)
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist: flashinfer_python=="):
                return line.split("==")[1].strip()
    raise AssertionError(f"sglang {sglang_version} pins no flashinfer_python")


def _pip(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *argv], check=True, capture_output=True)


@pytest.fixture(scope="session")  # a directory under the cache's lock: the proofs need not share a worker
def flashinfer_deps() -> Path:
    return venvs.build_once(venvs.CACHE / "flashinfer-pure-deps", "flashinfer-pure-deps",
                            lambda target: _pip("install", "-q", "--no-deps", "--target", str(target), *FLASHINFER_DEPS),
                            marker=".complete")


def flashinfer_release(version: str) -> Path:
    """The real flashinfer-python wheel of VERSION, unpacked once under the test cache."""
    root = venvs.CACHE / f"flashinfer-{version}-src"
    # another xdist worker may be unpacking it: one at a time, and whole (a half-unpacked package
    # imports as "partially initialized")
    with venvs.BuildLock(f"flashinfer-{version}-src"):
        if not root.exists():
            wheel = venvs.cached_wheel(f"flashinfer_python-{version}-*.whl", f"flashinfer-python=={version}")
            partial = root.with_name(root.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            with zipfile.ZipFile(wheel) as z:
                z.extractall(partial)
            partial.rename(root)
    return root


def prove(sglang_version: str, deps: Path, patches: list[str], flashinfer_patches: list[str] = (),
          cases=((5, 32, False), (37, 256, True)), flashinfer: str | None = None, call: str = "fp4_quantize") -> dict:
    """Run HARNESS (the CALL of ModelOptFp4LinearMethod.apply) on the release's modelopt_quant.py with
    PATCHES applied (real patch(1)), against its pinned FlashInfer (or FLASHINFER) with
    FLASHINFER_PATCHES applied to a copy."""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(sweep.cached_sglang_wheel(sglang_version)) as z:
        site = Path(tmp) / "site"
        (site / sweep.FILE).parent.mkdir(parents=True)
        (site / sweep.FILE).write_bytes(z.read(sweep.FILE))
        fi = Path(tmp) / "flashinfer"
        release = flashinfer_release(flashinfer or _pinned_flashinfer(sglang_version))
        subprocess.run(["cp", "-a", str(release), str(fi)], check=True)
        for name, where in [(n, site) for n in patches] + [(n, fi) for n in flashinfer_patches]:
            subprocess.run(["patch", "-p1", "-F0", "-N", "-s", "-d", str(where)], input=find_patch(name).text.encode(),
                           check=True, capture_output=True)
        args = {"path": [str(fi), str(deps)], "module": str(site / sweep.FILE), "cases": cases, "call": call}
        res = subprocess.run([str(venvs.build_venv() / "bin" / "python"), "-c", HARNESS], input=json.dumps(args),
                             capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def expected_sf(flashinfer: str, m: int, k: int) -> list[int]:
    """FlashInfer's scale-factor shape for a swizzled 128x4 layout: round_up(m,128) x round_up(k/16,4)
    bytes, viewed as rows of k/16 (0.6.8 on: of round_up(k/16,4))."""
    cols = k // 16
    padded = (cols + 3) // 4 * 4
    size = (m + 127) // 128 * 128 * padded
    if Version(flashinfer).release >= (0, 6, 8):
        cols = padded
    return [size // cols, cols]


# sglang release, its patch, the FlashInfer release it runs with: the pinned one, except 0.5.4.post2's
# pin (0.4.1), published as an sdist only (no wheel to unpack): there the next release, 0.5.0.
PROVEN = [("0.5.4.post2", "flashinfer-fp4-quantize-custom-op-0.5.4.post2", "0.5.0"),
          ("0.5.6", "flashinfer-fp4-quantize-custom-op-0.5.4.post3", None),
          ("0.5.9", "flashinfer-fp4-quantize-custom-op-0.5.9", None),
          ("0.5.11", "flashinfer-fp4-quantize-custom-op-0.5.10", None)]


@pytest.mark.parametrize("version,patch,flashinfer", PROVEN)
def test_pristine_the_call_site_crashes_as_the_seed_and_patched_it_compiles(version, patch, flashinfer,
                                                                             flashinfer_deps):
    pristine = prove(version, flashinfer_deps, [], cases=((5, 32, False),), flashinfer=flashinfer)
    assert pristine["flashinfer"] == (flashinfer or _pinned_flashinfer(version))
    assert pristine["call"] in ("fp4_quantize(x, layer.input_scale_inv)",)
    (case,) = pristine["cases"]
    assert case["result"] == "unsupported", case
    text = case["message"] + case["traceback"]
    # the seed's crash, reached through FlashInfer's SM120 quantization module
    assert "_thread.allocate_lock" in text and "get_cuda_version" in text, text[-3000:]
    assert "fp4_quantization.py" in text and "gen_fp4_quantization_sm120" in text, text[-3000:]

    fixed = prove(version, flashinfer_deps, [patch], flashinfer=flashinfer)
    for (m, k, dynamic), case in zip(((5, 32, False), (37, 256, True)), fixed["cases"]):
        assert case["result"] == "compiled", case
        assert case["ops"].count("sglang.flashinfer_fp4_quantize.default") == 1, case["ops"]
        assert not any("flashinfer" in op and "sglang" not in op for op in case["ops"]), case["ops"]
        if not dynamic:  # FlashInfer's shapes and dtypes, on the input's device
            assert case["outputs"] == [[[m, k // 2], "torch.uint8", "cuda"],
                                       [expected_sf(fixed["flashinfer"], m, k), "torch.uint8", "cuda"]], case


def test_flashinfers_version_patch_alone_leaves_dynamo_inside_flashinfer(flashinfer_deps):
    """The issue's second crash, on the seed's path: with cuda-version-no-subprocess applied to FlashInfer
    and sglang pristine, dynamo gets past the version query and walks on into FlashInfer's JIT (on this
    CPU host it stops at the JIT's architecture check, which finds no GPU; on the GPU it went on to the
    loader's file checks)."""
    res = prove("0.5.9", flashinfer_deps, [], ["cuda-version-no-subprocess"], cases=((5, 32, False),))
    (case,) = res["cases"]
    assert case["result"] == "unsupported", case
    text = case["message"] + case["traceback"]
    assert "_thread.allocate_lock" not in text and "gen_fp4_quantization_module" in text, text[-3000:]
    assert "flashinfer/jit/core.py" in text, text[-3000:]
    fixed = prove("0.5.9", flashinfer_deps, ["flashinfer-fp4-quantize-custom-op-0.5.9"],
                  ["cuda-version-no-subprocess"], cases=((5, 32, False),))
    assert fixed["cases"][0]["result"] == "compiled", fixed


# sglang release, its mm_fp4 patch, the FlashInfer it runs with: 0.5.5's pin (0.5.0); 0.5.3.post2's pin
# (0.4.0) is an sdist only, so its call site is compiled against 0.5.0 too.
PROVEN_MM = [("0.5.3.post2", "flashinfer-mm-fp4-custom-op-0.5.3.post2", "0.5.0"),
             ("0.5.5", "flashinfer-mm-fp4-custom-op-0.5.5", None)]


@pytest.mark.parametrize("version,patch,flashinfer", PROVEN_MM)
def test_pristine_the_fp4_gemm_stops_in_flashinfers_jit_and_patched_it_compiles(version, patch, flashinfer,
                                                                                flashinfer_deps):
    pristine = prove(version, flashinfer_deps, [], cases=((5, 128, False),), flashinfer=flashinfer, call="fp4_gemm")
    (case,) = pristine["cases"]
    assert case["result"] == "unsupported", case
    text = case["message"] + case["traceback"]
    # dynamo walks FlashInfer's mm_fp4 into the SM120 CUTLASS module's JIT generation (a file check)
    assert "posix.stat" in text and "mm_fp4" in text and "get_gemm_sm120_module_cutlass_fp4" in text, text[-3000:]
    fixed = prove(version, flashinfer_deps, [patch], cases=((5, 128, False), (37, 256, True)),
                  flashinfer=flashinfer, call="fp4_gemm")
    for (m, _, dynamic), case in zip(((5, 128, False), (37, 256, True)), fixed["cases"]):
        assert case["result"] == "compiled", case
        assert case["ops"] == ["sglang.flashinfer_mm_fp4.default"], case["ops"]
        if not dynamic:  # FlashInfer's output: [M, N] of out_dtype
            assert case["outputs"] == [[[m, 64], "torch.bfloat16", "cuda"]], case
