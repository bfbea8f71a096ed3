"""Which sglang releases call FlashInfer's FP4 API bare inside the piecewise-compiled region (the seed's
own path: NVFP4 models on Blackwell, where sglang's ModelOpt FP4 linear quantizes its input with
FlashInfer's fp4_quantize on SM120 and multiplies with FlashInfer's mm_fp4), and do the shipped
fixes (patches/sglang/flashinfer-fp4-quantize-custom-op-*.patch, flashinfer-mm-fp4-custom-op-*.patch)
cover exactly those?

For each `sglang==X` wheel (fetched once into ~/.cache/servops-tests/wheels) every module under
sglang/srt/layers/ that names the FP4 API is read with ast. A call is "bare" when the name it calls
was imported from flashinfer (directly, or through another sglang module's import) and neither the
function around the call nor a function of that name is registered as a torch.library custom op
(sglang's register_custom_op / register_custom_op_from_extern, torch.library.custom_op). Each call
is placed: "linear" (the quantized linear layers, traced by the piecewise capture), "moe" (the fused
MoE layers: from 0.5.7 the piecewise capture reaches them only through sglang's own opaque
moe_forward_piecewise_cuda_graph_impl op), "kv" (FP4 KV-cache writes, inside the attention op the
capture splits the graph at) or "weights" (weight loading, never captured). Each fix
is applied to a copy of modelopt_quant.py with real patch(1), no fuzz, re-applied (must be refused)
and reversed (must restore the exact bytes); the fixes of one release are also applied together, in
order, and reversed in reverse order.

    python bench/sglang_fp4_call_sweep.py            # the table over 0.5.3.post2 .. 0.5.23
    python bench/sglang_fp4_call_sweep.py 0.5.9      # some releases
"""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from servops.lab.patchtrial import try_on_copy  # noqa: E402
from servops.lab.venvs import cached_sglang_wheel  # noqa: E402
from servops.patchstore import find_patch  # noqa: E402

FILE = "sglang/srt/layers/quantization/modelopt_quant.py"
# each fix and the FlashInfer call it makes opaque
PATCHES = {**{f"flashinfer-fp4-quantize-custom-op-{v}": "fp4_quantize"
              for v in ("0.5.4.post2", "0.5.4.post3", "0.5.9", "0.5.10")},
           **{f"flashinfer-mm-fp4-custom-op-{v}": "mm_fp4" for v in ("0.5.3.post2", "0.5.5")}}
# FlashInfer's FP4 forward API as sglang calls it (quantize, GEMM, fused MoE)
FP4_API = {"fp4_quantize", "mm_fp4", "trtllm_fp4_block_scale_moe", "trtllm_fp4_block_scale_routed_moe",
           "cutlass_fused_moe"}
WEIGHT_FUNCS = ("process_weights", "create_weights", "load", "quantize_weight", "mxfp4_quantize")
# from the first release with the piecewise capture (--enable-piecewise-cuda-graph, 0.5.3.post2)
RELEASES = ("0.5.3.post2 0.5.3.post3 0.5.4 0.5.4.post1 0.5.4.post2 0.5.4.post3 0.5.5 0.5.5.post1 "
            "0.5.5.post2 0.5.5.post3 0.5.6 0.5.6.post1 0.5.6.post2 0.5.7 0.5.8 0.5.8.post1 0.5.9 0.5.10 "
            "0.5.10.post1 0.5.11 0.5.12 0.5.12.post1 0.5.13 0.5.13.post1 0.5.14 "
            "0.5.15 0.5.15.post1 0.5.16 0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23").split()


def _registers_custom_op(node: ast.AST) -> bool:
    return "custom_op" in ast.unparse(node)


def _module_name(path: str) -> str:
    return path[:-3].replace("/", ".")


class Module:
    """One module's FlashInfer FP4 bindings, its custom-op functions and its FP4 call sites."""

    def __init__(self, path: str, source: str):
        self.path, self.tree = path, ast.parse(source)
        self.flashinfer: dict[str, str] = {}    # local name -> FlashInfer API name
        self.sglang: dict[str, tuple[str, str]] = {}  # local name -> (sglang module, name)
        self.opaque: set[str] = set()           # functions registered as custom ops
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if node.module.split(".")[0] == "flashinfer" and a.name in FP4_API:
                        self.flashinfer[a.asname or a.name] = a.name
                    elif node.module.startswith("sglang."):
                        self.sglang[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.FunctionDef) and any(map(_registers_custom_op, node.decorator_list)):
                self.opaque.add(node.name)
            elif isinstance(node, ast.Call) and "register_custom_op" in ast.unparse(node.func):
                self.opaque.update(a.id for a in node.args if isinstance(a, ast.Name))

    def bare_binding(self, name: str, modules: dict[str, Module]) -> str | None:
        """The FlashInfer API NAME calls bare here, or None (not FlashInfer's, or a custom op)."""
        if name in self.opaque:
            return None
        if name in self.flashinfer:
            return self.flashinfer[name]
        if name in self.sglang:
            mod, orig = self.sglang[name]
            other = modules.get(mod)
            return other.bare_binding(orig, {}) if other is not None and other is not self else None
        return None

    def calls(self, modules: dict[str, Module]) -> list[dict]:
        found = []

        def visit(node, stack):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, stack + [child])
                    continue
                if isinstance(child, ast.Call) and isinstance(child.func, ast.Name):
                    api = self.bare_binding(child.func.id, modules)
                    funcs = [s for s in stack if not isinstance(s, ast.ClassDef)]
                    if api and not any(f.name in self.opaque for f in funcs):
                        where = ".".join(s.name for s in stack) or "<module>"
                        found.append({"file": self.path, "line": child.lineno, "api": api, "where": where,
                                      "place": self._place(stack)})
                visit(child, stack)

        visit(self.tree, [])
        return found

    def _place(self, stack) -> str:
        names = [s.name for s in stack]
        if any(any(w in n.lower() for w in WEIGHT_FUNCS) for n in names if not n[0].isupper()):
            return "weights"
        if "/moe/" in self.path or any("moe" in n.lower() or "expert" in n.lower() for n in names):
            return "moe"
        if "kvfp4" in self.path:  # the KV cache's writes, inside the attention op the capture splits out
            return "kv"
        return "linear"


def read_release(whl: Path) -> dict[str, Module]:
    modules = {}
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.startswith("sglang/srt/layers/") and name.endswith(".py"):
                text = z.read(name).decode()
                if any(api in text for api in FP4_API) or "flashinfer" in text:
                    modules[_module_name(name)] = Module(name, text)
    return modules


def moe_opaque_under_piecewise(modules: dict[str, Module]) -> bool:
    """From 0.5.7 FusedMoE.forward under the piecewise capture calls sglang's own opaque op."""
    layer = modules.get("sglang.srt.layers.moe.fused_moe_triton.layer")
    return layer is not None and "moe_forward_piecewise_cuda_graph_impl" in layer.opaque | {
        n.attr for n in ast.walk(layer.tree) if isinstance(n, ast.Attribute)}


def bare_linear(source: str, path: str = FILE) -> list[dict]:
    mod = Module(path, source)
    return [c for c in mod.calls({_module_name(path): mod}) if c["place"] == "linear"]


def try_patch(name: str, original: bytes) -> dict:
    api = PATCHES[name]
    return try_on_copy(FILE, original, [find_patch(name).text],
                       lambda source: not [c for c in bare_linear(source) if c["api"] == api])


def try_together(names: list[str], original: bytes) -> dict:
    """Every fix of the release applied in order (no bare linear call left), reversed in reverse order."""
    return try_on_copy(FILE, original, [find_patch(n).text for n in names], lambda source: not bare_linear(source))


def check_release(version: str) -> dict:
    whl = cached_sglang_wheel(version)
    if whl is None:
        return {"version": version, "cached": False}
    modules = read_release(whl)
    calls = [c for m in modules.values() for c in m.calls(modules)]
    row = {"version": version, "cached": True, "calls": calls,
           "bare_linear": sorted({f"{c['api']} in {c['where']}" for c in calls if c["place"] == "linear"}),
           "bare_moe": sorted({f"{c['api']} in {c['where']}" for c in calls if c["place"] == "moe"}),
           "moe_opaque": moe_opaque_under_piecewise(modules),
           "patches": {}}
    with zipfile.ZipFile(whl) as z:
        original = z.read(FILE) if FILE in z.namelist() else None
    for name in PATCHES:
        entry = {"in_applies_to": find_patch(name).version_ok(version)}
        if original is not None:
            entry.update(try_patch(name, original))
        row["patches"][name] = entry
    covering = [n for n, e in row["patches"].items() if e["in_applies_to"]]
    row["together"] = try_together(covering, original) if original is not None and covering else None
    return row


def verdict(row: dict) -> str:
    if not row["cached"]:
        return "not downloadable (offline?)"
    bare = {s.split()[0] for s in row["bare_linear"] if s.endswith("ModelOptFp4LinearMethod.apply")}
    covering = {n: PATCHES[n] for n, e in row["patches"].items() if e["in_applies_to"]}
    problems = [f"{n} applies outside applies_to" for n, e in row["patches"].items()
                if e.get("applies") and not e["in_applies_to"]]
    problems += [f"{n} in applies_to but {e}" for n, e in row["patches"].items() if e["in_applies_to"] and not (
        e.get("applies") and e.get("fixed") and e.get("reapply_refused") and e.get("reverts_exactly"))]
    if sorted(covering.values()) != sorted(bare):
        problems.append(f"bare {sorted(bare)} but fixes {covering}")
    if row["together"] and not all(row["together"].values()):
        problems.append(f"together: {row['together']}")
    linear = ", ".join(row["bare_linear"]) or "no bare call"
    fixes = f"; fixed by {', '.join(covering)}" if covering else ""
    moe = ("behind sglang's opaque MoE op" if row["moe_opaque"]
           else f"BARE ({len(row['bare_moe'])} call sites, no opaque MoE op)") if row["bare_moe"] else "none"
    text = f"linear: {linear}{fixes}; moe FP4 calls: {moe}"
    return text + (f"  PROBLEM: {'; '.join(problems)}" if problems else "")


def main() -> None:
    for version in sys.argv[1:] or RELEASES:
        print(f"sglang {version:13} {verdict(check_release(version))}", flush=True)


if __name__ == "__main__":
    main()
