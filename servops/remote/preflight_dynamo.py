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
            "message": text.splitlines()[0] if text else "",
            "traceback": traceback.format_exc()[-4000:]}


def trace_entry_point():
    """dynamo_fullgraph: a function that calls the patched entry point, compiled whole."""
    try:
        import torch
    except ImportError as exc:
        fail("preflight needs torch in the host venv: %s" % exc)
    mod = load_module_without_package_init(ARGS["module"])
    target = getattr(mod, ARGS["call"])
    call_args = list(ARGS.get("args") or [])

    def probe(x):
        if target(*call_args):
            return x + 1
        return x - 1

    outcome = {"site": site_dirs(), "torch": torch.__version__, "module_file": getattr(mod, "__file__", None)}
    try:
        value = torch.compile(probe, fullgraph=True, backend=ARGS.get("backend", "eager"))(torch.ones(2))
        outcome.update(result="pass", value=value.tolist())
    except Exception as exc:
        outcome.update(_error_fields(exc))
    reply(outcome)


# ---- dynamo_call_site: the engine's own call site, pristine and with the fix set ----------------
# The server crashes where torch.compile meets the engine's call into a library, so that is what is
# compiled: the function the crash's "from user code:" frames name, imported the way the server
# imports it (package __init__s and all), called with tensors of the model's real shapes. Each
# state runs in a child process of its own (a module, once imported, stays imported), and each
# sees the files of the fix set as that state has them: the fix set's patches are applied (or
# reversed) to copies by patch(1), and an import hook serves those copies, so the proof comes
# before anything on the host changes.

def _file_states(patches):
    """{absolute path: {"pristine": bytes, "fixed": bytes}} for every file the fix set touches."""
    import shutil
    import subprocess
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
                check = subprocess.run(common + ["--dry-run"], input=spec["text"].encode(), capture_output=True)
                if check.returncode != 0:
                    continue  # already in that state (applied / not applied): keep the file as it is
                subprocess.run(common, input=spec["text"].encode(), capture_output=True, check=True)
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


def _model_config(model_path):
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
        return config.get("text_config", config) if isinstance(config, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def _block_fp8_linear_cases(torch, device, model_path):
    """The FP8 block-scale linear layers of the model: (M, K) bf16 activations of a small prefill
    batch (M < 32 takes FlashInfer's swapAB kernel), (N, K) e4m3 weights, (N/bn, K/bk) fp32 scales."""
    config = _model_config(model_path) if model_path else {}
    hidden = int(config.get("hidden_size") or 4096)
    inter = int(config.get("intermediate_size") or 4 * hidden)
    block = ((config.get("quantization_config") or {}).get("weight_block_size")) or [128, 128]
    bn, bk = int(block[0]), int(block[1])
    where = "the model's config.json" if config else "no model config.json: default shapes"
    cases = []
    for layer, (n, k) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
        gen = torch.Generator(device="cpu").manual_seed(n * 7 + k)
        x = torch.randn(4, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, generator=gen) * 0.02
        blocks = w.view(n // bn, bn, k // bk, bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        wq = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
        cases.append({"what": "%s: x (4, %d) bf16, weight (%d, %d) e4m3, scales (%d, %d) fp32 [%s]" % (
                          layer, k, n, k, n // bn, k // bk, where),
                      "args": (x, wq.to(device), [bn, bk], scale.float().to(device))})
    return cases


def _tensor_cases(torch, device, specs):
    """Plain tensors [{shape, dtype}] (a call site without a model: the tests' CPU call sites)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    args = tuple(torch.randn(*s["shape"], generator=gen).to(device=device, dtype=getattr(torch, s.get("dtype", "float32")))
                 for s in specs)
    return [{"what": ", ".join("%s %s" % (tuple(s["shape"]), s.get("dtype", "float32")) for s in specs), "args": args}]


def _prove_state(state, overlay):
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
        cases = (_block_fp8_linear_cases(torch, device, ARGS.get("model_path")) if builder == "block_fp8_linear"
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
    states = _file_states(ARGS.get("patches") or [])
    outcome = {"site": site_dirs(), "call_site": "%s.%s" % (ARGS["module"], ARGS["call"]),
               "files": sorted(v["rel"] for v in states.values())}
    for state in ("pristine", "fixed"):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            try:
                result = _prove_state(state, {path: v[state] for path, v in states.items()})
            except BaseException as exc:  # noqa: BLE001 - the child's answer, whatever happened
                result = {"result": "error", "error_type": type(exc).__name__, "message": str(exc)[:500]}
            with os.fdopen(write_end, "w") as f:
                f.write(json.dumps(result))
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as f:
            text = f.read()
        os.waitpid(pid, 0)
        try:
            outcome[state] = json.loads(text)
        except ValueError:
            outcome[state] = {"result": "error", "error_type": "ChildDied", "message": "the %s run ended "
                              "without an answer (killed by a signal?)" % state}
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
