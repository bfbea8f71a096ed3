# The proof runs what the host supplies (the engine's imports, the model's config.json) in children
# with deadlines: ARGS["deadline_s"] is this program's budget (the controller waits a little
# longer), shared by its children; a child past its share is ended with its process group
# (procs.run_child_with_deadline), and so is every child when the controller goes away.
import time as _time

DEADLINE_S = float(ARGS.get("deadline_s") or 540)
_STARTED = _time.monotonic()


def time_left():
    return max(1.0, DEADLINE_S - (_time.monotonic() - _STARTED))


def load_module_without_package_init(modname):
    """Import `pkg.sub.mod` running only that module's own code.

    A package's __init__ can pull in the whole library (flashinfer's needs CUDA extensions);
    bare package shells with the right __path__ let the module's relative imports resolve to
    the real files while skipping the parents' __init__ side effects.
    """
    import importlib
    import types
    parts = modname.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in sys.modules:
            continue
        for site in site_dirs():
            d = os.path.join(site, *parts[:i])
            if os.path.isdir(d):
                shell = types.ModuleType(pkg)
                shell.__path__ = [d]
                shell.__package__ = pkg
                sys.modules[pkg] = shell
                break
    return importlib.import_module(modname)


def _error_fields(exc):
    import traceback
    unsupported = type(exc).__module__.startswith("torch._dynamo") and type(exc).__name__ == "Unsupported"
    text = str(exc).strip()
    return {"result": "unsupported" if unsupported else "error",
            "error_type": "%s.%s" % (type(exc).__module__, type(exc).__name__),
            "message": text.splitlines()[0][:1000] if text else "",
            "traceback": traceback.format_exc()[-4000:]}


def trace_entry_point():
    """dynamo_fullgraph: a function that calls the patched entry point, compiled whole (in a child:
    the import may hang)."""
    outcome = run_child_with_deadline(_trace, time_left(), "the trace of %s.%s" % (ARGS["module"], ARGS["call"]))
    if outcome.get("result") == "no-torch":
        fail(outcome["message"])
    if outcome.get("result") == "timeout":  # a hanging import, say: nothing was shown either way
        outcome["result"] = "unproven"
    reply(dict(outcome, site=site_dirs()))


def _trace():
    try:
        import torch
    except ImportError as exc:
        return {"result": "no-torch", "message": "preflight needs torch in the host venv: %s" % exc}
    mod = load_module_without_package_init(ARGS["module"])
    target = getattr(mod, ARGS["call"])
    call_args = list(ARGS.get("args") or [])

    def probe(x):
        if target(*call_args):
            return x + 1
        return x - 1

    outcome = {"torch": torch.__version__, "module_file": getattr(mod, "__file__", None)}
    try:
        value = torch.compile(probe, fullgraph=True, backend=ARGS.get("backend", "eager"))(torch.ones(2))
        outcome.update(result="pass", value=value.tolist())
    except Exception as exc:
        outcome.update(_error_fields(exc))
    return outcome


# ---- dynamo_call_site: the engine's own call site, pristine and with the fix set ----------------
# The server crashes where torch.compile meets the engine's call into a library, so that is what is
# compiled: the function the crash's "from user code:" frames name, imported the way the server
# imports it (package __init__s and all), called with tensors of the model's real shapes. Each
# state runs in a child process of its own (a module, once imported, stays imported), and each
# sees the files of the fix set as that state has them: the fix set's patches are applied (or
# reversed) to copies by patch(1), and an import hook serves those copies, so the proof comes
# before anything on the host changes.

PATCH_DEADLINE = 60  # seconds for one patch(1) run on copies of a few files


def _file_states(patches):
    """{absolute path: {"pristine": bytes, "fixed": bytes}} for every file the fix set touches."""
    import shutil
    import tempfile
    states = {}
    work = tempfile.mkdtemp(prefix="servops-preflight-")
    try:
        for spec in patches:
            for rel in spec["files"]:
                path = resolve_in_site(rel)[0]
                if path not in states:
                    with open(path, "rb") as f:
                        data = f.read()
                    states[path] = {"pristine": data, "fixed": data, "rel": rel}
            for state, direction in (("fixed", []), ("pristine", ["-R"])):
                tree = os.path.join(work, spec["name"] + "-" + state)
                for rel in spec["files"]:
                    dest = os.path.join(tree, rel)
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with open(dest, "wb") as f:
                        f.write(states[resolve_in_site(rel)[0]][state])
                common = ["patch", "-p%d" % spec.get("strip", 1), "-F0", "-N", "-s", "-d", tree] + direction
                if run_command_with_deadline(common + ["--dry-run"], PATCH_DEADLINE, stdin=spec["text"].encode())[0]:
                    continue  # already in that state (applied / not applied): keep the file as it is
                code, _out, err = run_command_with_deadline(common, PATCH_DEADLINE, stdin=spec["text"].encode())
                if code:
                    raise RuntimeError("patch(1) failed on %s: %s" % (spec["name"], err.decode("utf-8", "replace")[:300]))
                for rel in spec["files"]:
                    with open(os.path.join(tree, rel), "rb") as f:
                        states[resolve_in_site(rel)[0]][state] = f.read()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return states


def _serve_files(overlay):
    """An import hook: modules whose file is in `overlay` are compiled from its bytes."""
    import importlib.machinery

    class OverlayFinder(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else None
            if origin in overlay:
                source = overlay[origin]

                class OverlayLoader(importlib.machinery.SourceFileLoader):
                    def get_code(self, name):
                        return compile(source, self.path, "exec", dont_inherit=True)

                spec.loader = OverlayLoader(fullname, spec.origin)
            return spec

    sys.meta_path.insert(0, OverlayFinder)


# The proof's tensors have the model's real dims, bounded: a weight's rows (its output features)
# are cut to whole blocks within WEIGHT_ELEMENTS, its columns (the reduction, what the kernel's
# block scales and dynamo's trace depend on) are the model's. A legal 70B-class config asked for
# gigabytes of host memory; a layer too wide for even one block of rows is skipped, saying what
# it would take.
WEIGHT_ELEMENTS = 1 << 24
_DIM_MAX = 1 << 24


class ShapesRefused(Exception):
    """The model's config.json gives no shapes the proof can use (it says why)."""


def _dim(value, what, where):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _DIM_MAX:
        raise ShapesRefused("%s: %s %s is not a dimension (a positive integer up to %d)"
                            % (where, what, repr(value)[:40], _DIM_MAX))
    return value


def block_fp8_shapes(model_path):
    """[{layer, n, rows, k, bn, bk}] of the model's FP8 block-scale linear layers (gate_up and down
    projections), from its config.json (read bounded: jsonl.read_config_json), rows bounded (see
    WEIGHT_ELEMENTS); and where the dims came from. ShapesRefused when the config cannot give them."""
    path = os.path.join(model_path, "config.json") if model_path else None
    try:
        config = read_config_json(path) if path else None
    except FileNotFoundError:
        config = None
    except (OSError, FileProblem) as exc:
        raise ShapesRefused("the model's config.json cannot be read: %s" % exc) from None
    if config is not None:
        if not isinstance(config, dict):
            raise ShapesRefused("%s is not a JSON object" % path)
        config = config.get("text_config") or config
        if not isinstance(config, dict):
            raise ShapesRefused("%s: text_config is not a JSON object" % path)
    where = path if config is not None else "no model config.json: default shapes"
    config = config or {}
    hidden = _dim(config.get("hidden_size", 4096), "hidden_size", where)
    inter = _dim(config.get("intermediate_size", 4 * hidden), "intermediate_size", where)
    quant = config.get("quantization_config") or {}
    block = (quant.get("weight_block_size") if isinstance(quant, dict) else None) or [128, 128]
    if not isinstance(block, list) or len(block) != 2:
        raise ShapesRefused("%s: quantization_config.weight_block_size %s is not [rows, columns]" % (where, repr(block)[:40]))
    bn, bk = (_dim(b, "weight_block_size", where) for b in block)
    shapes = []
    for layer, n, k in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        if n % bn or k % bk:
            raise ShapesRefused("%s: %s (%d, %d) is not whole %dx%d blocks" % (where, layer, n, k, bn, bk))
        rows = min(n, WEIGHT_ELEMENTS // k // bn * bn)
        if rows < bn:
            raise ShapesRefused("%s: %s's weight is %d columns wide: even one block of %d rows (%.1f GiB as "
                                "fp32 while quantized) is over the proof's %d-element bound; not run"
                                % (where, layer, k, bn, 4.0 * bn * k / (1 << 30), WEIGHT_ELEMENTS))
        shapes.append({"layer": layer, "n": n, "rows": rows, "k": k, "bn": bn, "bk": bk})
    return shapes, where


def _block_fp8_linear_cases(torch, device, shapes, where):
    """The FP8 block-scale linear layers of the model (block_fp8_shapes): (M, K) bf16 activations of
    a small prefill batch (M < 32 takes FlashInfer's swapAB kernel), (rows, K) e4m3 weights,
    (rows/bn, K/bk) fp32 scales."""
    cases = []
    for shape in shapes:
        n, rows, k, bn, bk = shape["n"], shape["rows"], shape["k"], shape["bn"], shape["bk"]
        gen = torch.Generator(device="cpu").manual_seed(n * 7 + k)
        x = torch.randn(4, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        w = torch.randn(rows, k, generator=gen) * 0.02
        blocks = w.view(rows // bn, bn, k // bk, bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        wq = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows, k)
        del w, blocks
        weight = "(%d, %d)" % (n, k) if rows == n else "(%d of %d rows, %d)" % (rows, n, k)
        cases.append({"what": "%s: x (4, %d) bf16, weight %s e4m3, scales (%d, %d) fp32 [%s]" % (
                          shape["layer"], k, weight, rows // bn, k // bk, where),
                      "args": (x, wq.to(device), [bn, bk], scale.float().to(device))})
    return cases


def _tensor_cases(torch, device, specs):
    """Plain tensors [{shape, dtype}] (a call site without a model: the tests' CPU call sites)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    args = tuple(torch.randn(*s["shape"], generator=gen).to(device=device, dtype=getattr(torch, s.get("dtype", "float32")))
                 for s in specs)
    return [{"what": ", ".join("%s %s" % (tuple(s["shape"]), s.get("dtype", "float32")) for s in specs), "args": args}]


def _prove_state(overlay, shapes):
    """In a child: import the call site as the server does, call it eagerly, then compiled whole."""
    import importlib
    _serve_files(overlay)
    try:
        import torch
    except ImportError as exc:
        return {"result": "error", "error_type": "ImportError", "message": "no torch: %s" % exc}
    device = ARGS.get("device") or "cuda"
    out = {"torch": torch.__version__}
    if device == "cuda":
        if not torch.cuda.is_available():
            return dict(out, result="unproven", message="no CUDA device visible to the host's torch: the call "
                        "site's kernel cannot run here, so neither the crash nor the fix was proven")
        major, minor = torch.cuda.get_device_capability()
        out["device"] = "%s (sm_%d%d)" % (torch.cuda.get_device_name(), major, minor)
    try:
        mod = importlib.import_module(ARGS["module"])
        fn = getattr(mod, ARGS["call"])
        builder = ARGS.get("args")
        cases = (_block_fp8_linear_cases(torch, device, *shapes) if builder == "block_fp8_linear"
                 else _tensor_cases(torch, device, builder or []))
    except Exception as exc:
        return dict(out, **_error_fields(exc))
    out["module_file"] = getattr(mod, "__file__", None)
    out["cases"] = []
    for case in cases:
        row = {"what": case["what"]}
        out["cases"].append(row)
        try:
            eager = fn(*case["args"])
        except Exception as exc:  # the call site cannot run here at all (another GPU generation, say)
            row.update(_error_fields(exc), stage="eager")
            return dict(out, result="unproven", message="the call site does not run eagerly here: %s: %s" % (
                row["error_type"], row["message"]))
        torch._dynamo.reset()
        try:
            compiled = torch.compile(fn, fullgraph=True, backend=ARGS.get("backend", "eager"))(*case["args"])
        except Exception as exc:
            row.update(_error_fields(exc), stage="compile")
            return dict(out, **{k: row[k] for k in ("result", "error_type", "message", "traceback")})
        same = eager.shape == compiled.shape and eager.dtype == compiled.dtype
        diff = (eager.float() - compiled.float()).abs().max().item() if same and eager.numel() else 0.0
        row.update(result="pass" if same and diff == 0.0 else "mismatch", max_abs_diff=diff)
        if row["result"] != "pass":
            return dict(out, result="mismatch", message="%s: the compiled call differs from the eager one "
                        "(max |diff| %g)" % (case["what"], diff))
    return dict(out, result="pass")


def prove_call_site():
    outcome = {"site": site_dirs(), "call_site": "%s.%s" % (ARGS["module"], ARGS["call"])}
    try:
        shapes = block_fp8_shapes(ARGS.get("model_path")) if ARGS.get("args") == "block_fp8_linear" else None
        states = _file_states(ARGS.get("patches") or [])
    except (ShapesRefused, DeadlineExceeded, RuntimeError) as exc:  # nothing was run: nothing proven
        skipped = {"result": "unproven", "message": str(exc)}
        reply(dict(outcome, result="unproven", message=str(exc), pristine=skipped, fixed=skipped))
        return
    outcome["files"] = sorted(v["rel"] for v in states.values())
    for i, state in enumerate(("pristine", "fixed")):
        overlay = {path: v[state] for path, v in states.items()}
        answer = run_child_with_deadline(lambda: _prove_state(overlay, shapes), time_left() / (2 - i),
                                         "the %s run" % state)
        if answer.get("result") == "timeout":  # a hanging import, say: neither way was shown
            answer["result"] = "unproven"
        outcome[state] = answer
    pristine, fixed = outcome["pristine"]["result"], outcome["fixed"]["result"]
    if "unproven" in (pristine, fixed):
        outcome["result"] = "unproven"
    elif pristine == "unsupported" and fixed == "pass":
        outcome["result"] = "pass"
    elif pristine == "pass" and fixed == "pass":
        outcome["result"] = "not-needed"
    else:
        outcome["result"] = "fail"
    reply(outcome)


def main():
    if ARGS.get("check") == "dynamo_call_site":
        prove_call_site()
    else:
        trace_entry_point()


main()
