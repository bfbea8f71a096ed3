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


def main():
    import traceback
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
        unsupported = type(exc).__module__.startswith("torch._dynamo") and type(exc).__name__ in ("Unsupported",)
        outcome.update(result="unsupported" if unsupported else "error",
                       error_type="%s.%s" % (type(exc).__module__, type(exc).__name__),
                       message=str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                       traceback=traceback.format_exc()[-4000:])
    reply(outcome)


main()
