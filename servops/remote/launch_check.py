# Launch preflight: validate rendered launch argvs with the host's OWN sglang parser (sglang_args,
# included before this file), plus the facts a launch needs: the model path, the port, the GPUs.
#
# The real parser's flag table is cached per venv and installed sglang (argtable, launch_cache):
# a later check validates against it without importing sglang (parser "cached"); where the
# table cannot decide (a custom action, a value of a custom type not seen before) or the cache
# is stale or damaged, the real parser runs and the cache is rewritten.
#
# ARGS: {"branches": [{"id", "argv", "env"}], "deploy_root", "port", "allow_real", "version_only", "cache",
#        "deploy": a deploy's facts request (deploy_facts),
#        "caches": the JIT/compile cache directories to report (cache_ledger.cache_facts)}
# Reply: {"python", "sglang": {"version", "package", "parser": real|cached|static, "note", "prog",
#         "actions", "unchecked", "cache": the cache's state},
#         "branches": {id: validate() result + "facts"}, "port": {...}, "gpus": {...} | None,
#         "timings": {...}}
import json as _json
import shutil
import subprocess
import time

_T0 = time.time()


_ARCHS = {}


def missing_architectures(pkg, archs):
    """Of the model's config.json architectures, those no `EntryClass` module under sglang's
    srt/models defines a class for (read as text, not imported: sglang's ModelRegistry registers
    each module's EntryClass by class name). GLM-5's GlmMoeDsaForCausalLM, e.g., ships from 0.5.9."""
    if not pkg or not archs:
        return []
    models = os.path.join(pkg, "srt", "models")
    if not os.path.isdir(models):
        return []
    want = [a for a in archs if a not in _ARCHS]
    if want:
        found = set()
        pattern = re.compile(r"^class\s+(%s)\b" % "|".join(re.escape(a) for a in want), re.M)
        for root, _dirs, files in os.walk(models):
            for name in files:
                if not name.endswith(".py"):
                    continue
                try:
                    with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
                        text = fh.read()
                except OSError:
                    continue
                if "EntryClass" in text:
                    found.update(m.group(1) for m in pattern.finditer(text))
        for a in want:
            _ARCHS[a] = a in found
    return [a for a in archs if not _ARCHS[a]]


_KEEP = ("model_path", "port", "host", "tp_size", "pp_size", "dp_size", "nnodes", "node_rank",
         "enable_dp_attention", "attn_dp_size", "cuda_graph_max_bs", "cuda_graph_max_bs_decode",
         "cuda_graph_backend_prefill", "enable_piecewise_cuda_graph", "served_model_name")


def gpus_needed(values):
    tp = values.get("tp_size") or 1
    pp = values.get("pp_size") or 1
    dp = values.get("dp_size") or 1
    nnodes = values.get("nnodes") or 1
    try:
        total = int(tp) * int(pp)
        if int(dp) > 1 and not values.get("enable_dp_attention") and not values.get("attn_dp_size"):
            total *= int(dp)
        return -(-total // max(int(nnodes), 1))
    except (TypeError, ValueError):
        return None


def _import_parser(pkg, info, timings, env=None):
    """sglang's real parser (or, where it does not import, the static one): (parser, how)."""
    saved = _stdout_to_stderr()
    base = dict(os.environ)
    try:
        if env:
            os.environ.update(env)  # sglang reads some SGLANG_* variables while it builds the parser
        t = time.time()
        if ARGS.get("allow_real", True):
            try:
                return real_parser(pkg), "real"
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                if env:
                    return None, None
                info["note"] = "importing sglang failed: %s" % _one_line(exc)
            finally:
                timings["import_s"] = round(timings.get("import_s", 0) + time.time() - t, 3)
        else:
            info["note"] = "static check requested"
        if env:
            return None, None
        t = time.time()
        try:
            return static_parser(pkg), "static"
        except Exception as exc:
            info["note"] = (info["note"] + "; " if info["note"] else "") + \
                "reading its source failed too: %s" % _one_line(exc)
            return None, None
        finally:
            timings["static_s"] = round(time.time() - t, 3)
    finally:
        _restore_stdout(saved)
        if env:
            os.environ.clear()
            os.environ.update(base)


def _validate_all(branches, version, base, how, base_env, cache, pkg, info, timings):
    """{branch id: validate() result}; raises Undecidable where a cached table cannot decide."""
    results = {}
    by_env = {}
    for branch in branches:
        argv = [str(a) for a in branch.get("argv") or []]
        env = dict((str(k), str(v)) for k, v in (branch.get("env") or {}).items())
        parser = base
        if how == "cached" and cache.env_changed(env):
            parser = cache.parser(env)
            if parser is None:
                raise Undecidable("no cached table for this branch's SGLANG_* environment")
        elif how == "real" and any(base_env.get(k) != v for k, v in env.items()):
            ident = _json.dumps(sorted(env.items()))
            if ident not in by_env:
                rebuilt, _how = _import_parser(pkg, info, timings, env)
                if rebuilt is not None and cache is not None:
                    record_values(rebuilt, cache.memo(env))
                by_env[ident] = (rebuilt or base, env if rebuilt is not None else None)
            parser = by_env[ident][0]
        saved = _stdout_to_stderr()
        try:
            results[branch.get("id", str(len(results)))] = validate(parser, argv, version, keep=_KEEP)
        finally:
            _restore_stdout(saved)
    return results, [v for v in by_env.values() if v[1] is not None]


def main():
    root = os.path.realpath(os.path.expanduser(ARGS.get("deploy_root") or "~/.servops/deploy"))
    pkg = sglang_package()
    version = sglang_version(pkg) if pkg else None
    info = {"version": version, "package": pkg, "parser": None, "note": None, "prog": None, "actions": 0,
            "unchecked": [], "skipped": [], "cache": None}
    timings = {}
    out = {"python": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3], "sglang": info,
           "branches": {}}
    base_env = dict(os.environ)
    if ARGS.get("version_only"):
        out["timings"] = {"host_s": round(time.time() - _T0, 3)}
        reply(out)
        return
    branches = ARGS.get("branches") or []
    parser, how, results, cache = None, None, None, None
    if pkg and ARGS.get("allow_real", True) and ARGS.get("cache", True):
        t = time.time()
        cache = ParserCache("sglang", CACHE_DIST, pkg, root, base_env, parser_sources(pkg), CACHE_ENV_PREFIXES)
        cache, parser, results = from_cache(cache, info, lambda cached: _validate_all(
            branches, version, cached, "cached", base_env, cache, pkg, info, timings)[0])
        how = "cached" if parser is not None else None
        timings["cache_s"] = round(time.time() - t, 3)
    if pkg and how is None:
        parser, how = _import_parser(pkg, info, timings)
        if how == "real" and cache is not None:
            record_values(parser, cache.memo({}))
        if parser is not None:
            results, envs = _validate_all(branches, version, parser, how, base_env, cache, pkg, info, timings)
            if how == "real" and cache is not None:
                t = time.time()
                why = cache.save({}, parser)
                for rebuilt, env in envs:
                    why = why or cache.save(env, rebuilt)
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
        if results is not None:
            result = results[ident]
        else:
            result = {"ok": None, "problems": [], "warnings": [], "values": _values_without_parser(argv)}
        values = result.get("values") or {}
        model = model_fact(values.get("model_path"))
        if model and model.get("architectures") and pkg:
            model["missing_architectures"] = missing_architectures(pkg, model["architectures"])
        result["facts"] = {"model": model, "gpus_needed": gpus_needed(values)}
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


def _values_without_parser(argv):
    """No parser on this host: the few values the facts need, read from the argv as written."""
    spellings = {"--model-path": "model_path", "--model": "model_path", "--port": "port", "--tp": "tp_size",
                 "--tp-size": "tp_size", "--tensor-parallel-size": "tp_size", "--pp-size": "pp_size",
                 "--pipeline-parallel-size": "pp_size", "--nnodes": "nnodes", "--dp-size": "dp_size"}
    values = {}
    for i, tok in enumerate(argv):
        name, _sep, inline = tok.partition("=")
        key = spellings.get(name)
        if key:
            raw = inline if _sep else (argv[i + 1] if i + 1 < len(argv) else None)
            if raw is not None:
                values[key] = int(raw) if key != "model_path" and raw.isdigit() else raw
    return values


main()
