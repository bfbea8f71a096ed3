# Launch preflight for vLLM: validate rendered launch argvs with the host's OWN vLLM parser
# (vllm_args, built as `python -m vllm.entrypoints.openai.api_server` builds it; a static read of
# vllm's source where it does not import), plus the launch facts (launch_facts): model path,
# port, GPUs. The same request and reply as launch_check, the engine's facts under "engine".
# The real parser's flag table is cached per venv and installed vllm (argtable, launch_cache),
# as launch_check does for sglang: a later check needs no import of vllm (parser "cached").
#
# ARGS: {"branches": [{"id", "argv", "env"}], "deploy_root", "port", "allow_real", "version_only", "cache",
#        "deploy": a deploy's facts request (deploy_facts),
#        "caches": the JIT/compile cache directories to report (cache_ledger.cache_facts)}
import time

_T0 = time.time()

_KEEP_VLLM = ("model", "port", "host", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
              "max_model_len", "served_model_name", "enforce_eager", "max_num_seqs")


def vllm_gpus_needed(values):
    try:
        return (int(values.get("tensor_parallel_size") or 1) * int(values.get("pipeline_parallel_size") or 1)
                * int(values.get("data_parallel_size") or 1))
    except (TypeError, ValueError):
        return None


def _validate_branches(parser, branches, cached):
    """{branch id: validate_vllm() result}; with a cached table, raises Undecidable where only
    vLLM's own parser can decide."""
    results = {}
    for branch in branches:
        argv = [str(a) for a in branch.get("argv") or []]
        if cached and any(t == "--config" or t.startswith("--config=") for t in argv):
            raise Undecidable("--config (a YAML file vLLM's own parser reads)")
        saved = _stdout_to_stderr()
        try:
            results[branch.get("id", str(len(results)))] = validate_vllm(parser, argv, keep=set(_KEEP_VLLM))
        finally:
            _restore_stdout(saved)
    return results


def main():
    root = os.path.realpath(os.path.expanduser(ARGS.get("deploy_root") or "~/.servops/deploy"))
    pkg = vllm_package()
    version = vllm_version(pkg) if pkg else None
    info = {"name": "vllm", "version": version, "package": pkg, "parser": None, "note": None, "prog": None,
            "actions": 0, "unchecked": [], "skipped": [], "cache": None}
    out = {"python": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3], "engine": info,
           "branches": {}}
    timings = {}
    if ARGS.get("version_only"):
        out["timings"] = {"host_s": round(time.time() - _T0, 3)}
        reply(out)
        return
    branches = ARGS.get("branches") or []
    allow_real = ARGS.get("allow_real", True)
    parser, how, results, cache = None, None, None, None
    if pkg and allow_real and ARGS.get("cache", True):
        t = time.time()
        # the table stands for FlexibleArgumentParser: normalize() is its parse_args' rewrite
        cache = ParserCache("vllm", CACHE_DISTS, pkg, root, dict(os.environ), vllm_parser_sources(pkg),
                            CACHE_ENV_PREFIXES, subclass_ok=True)
        cache, parser, results = from_cache(cache, info, lambda cached: _validate_branches(cached, branches, True))
        how = "cached" if parser is not None else None
        timings["cache_s"] = round(time.time() - t, 3)
    if pkg and how is None:
        saved = _stdout_to_stderr()
        try:
            t = time.time()
            try:
                parser, how, note = build_vllm_parser(pkg, allow_real=allow_real)
                info["note"] = note
            except Exception as exc:
                info["note"] = "neither importing vllm nor reading its source gave a parser: %s" % _one_line(exc)
            timings["parser_s"] = round(time.time() - t, 3)
        finally:
            _restore_stdout(saved)
        if parser is not None:
            if how == "real" and cache is not None:
                record_values(parser, cache.memo({}))
            results = _validate_branches(parser, branches, cached=False)
            if how == "real" and cache is not None:
                t = time.time()
                why = cache.save({}, parser)
                note_saved(info, why)
                timings["cache_write_s"] = round(time.time() - t, 3)
    info["parser"] = how
    if parser is not None:
        info["prog"] = parser.prog
        info["actions"] = len(parser._actions)
        info["unchecked"] = list(getattr(parser, "servops_unchecked", []))
        info["skipped"] = list(getattr(parser, "servops_skipped", []))
    t = time.time()
    for branch in branches:
        argv = [str(a) for a in branch.get("argv") or []]
        ident = branch.get("id", str(len(out["branches"])))
        result = results[ident] if results is not None else {"ok": None, "problems": [], "warnings": [], "values": {}}
        values = result.get("values") or {}
        if not values.get("model"):
            for i, tok in enumerate(argv[:-1]):
                if tok == "--model":
                    values["model"] = argv[i + 1]
        result["facts"] = {"model": model_fact(values.get("model")), "gpus_needed": vllm_gpus_needed(values)}
        result.pop("normalized", None)
        out["branches"][ident] = result
    timings["validate_s"] = round(time.time() - t, 3)
    out["port"] = port_fact(ARGS.get("port"), root)
    out["gpus"] = gpu_fact(root)
    if ARGS.get("caches"):  # the inventory's jit_cache_dir: what the new launch can reuse there
        out["caches"] = cache_facts(ARGS["caches"])
    if ARGS.get("deploy"):  # run as PROGRAM+deploy_facts: the current release, patch state, lock
        t = time.time()
        out["deploy"] = deploy_facts(ARGS["deploy"])
        timings["deploy_s"] = round(time.time() - t, 3)
    timings["host_s"] = round(time.time() - _T0, 3)
    out["timings"] = timings
    out["site"] = site_dirs()
    reply(out)


main()
