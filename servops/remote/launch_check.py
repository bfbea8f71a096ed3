# Launch preflight: validate rendered launch argvs with the host's OWN sglang parser (sglang_args,
# included before this file), plus the facts a launch needs: the model path, the port, the GPUs.
#
# ARGS: {"branches": [{"id", "argv", "env"}], "deploy_root", "port", "allow_real", "version_only"}
# Reply: {"python", "sglang": {"version", "package", "parser", "note", "prog", "actions", "unchecked"},
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


def main():
    root = os.path.realpath(os.path.expanduser(ARGS.get("deploy_root") or "~/.servops/deploy"))
    pkg = sglang_package()
    version = sglang_version(pkg) if pkg else None
    info = {"version": version, "package": pkg, "parser": None, "note": None, "prog": None, "actions": 0,
            "unchecked": [], "skipped": []}
    timings = {}
    out = {"python": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3], "sglang": info,
           "branches": {}}
    base_env = dict(os.environ)
    parsers = {}
    if ARGS.get("version_only"):
        out["timings"] = {"host_s": round(time.time() - _T0, 3)}
        reply(out)
        return
    if pkg:
        saved = _stdout_to_stderr()
        try:
            t = time.time()
            how = None
            if ARGS.get("allow_real", True):
                try:
                    parsers[None] = real_parser(pkg)
                    how = "real"
                except BaseException as exc:
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    info["note"] = "importing sglang failed: %s" % _one_line(exc)
            else:
                info["note"] = "static check requested"
            timings["import_s"] = round(time.time() - t, 3)
            if how is None:
                t = time.time()
                try:
                    parsers[None] = static_parser(pkg)
                    how = "static"
                except Exception as exc:
                    info["note"] = (info["note"] + "; " if info["note"] else "") + \
                        "reading its source failed too: %s" % _one_line(exc)
                timings["static_s"] = round(time.time() - t, 3)
        finally:
            _restore_stdout(saved)
        info["parser"] = how
        if how:
            p = parsers[None]
            info["prog"] = p.prog
            info["actions"] = len(p._actions)
            info["unchecked"] = list(getattr(p, "servops_unchecked", []))
            info["skipped"] = list(getattr(p, "servops_skipped", []))
    t = time.time()
    for branch in ARGS.get("branches") or []:
        argv = [str(a) for a in branch.get("argv") or []]
        env = dict((str(k), str(v)) for k, v in (branch.get("env") or {}).items())
        result = {"ok": None, "problems": [], "warnings": [], "values": {}}
        if info["parser"]:
            parser = parsers[None]
            changed = any(base_env.get(k) != v for k, v in env.items())
            if changed and info["parser"] == "real":
                # sglang reads some SGLANG_* variables while it builds the parser (choices)
                os.environ.update(env)
                saved = _stdout_to_stderr()
                try:
                    parser = real_parser(pkg)
                except BaseException:
                    parser = parsers[None]
                finally:
                    _restore_stdout(saved)
                    os.environ.clear()
                    os.environ.update(base_env)
            saved = _stdout_to_stderr()
            try:
                result = validate(parser, argv, version, keep=_KEEP)
            finally:
                _restore_stdout(saved)
        else:
            result["values"] = _values_without_parser(argv)
        values = result.get("values") or {}
        model = model_fact(values.get("model_path"))
        if model and model.get("architectures") and pkg:
            model["missing_architectures"] = missing_architectures(pkg, model["architectures"])
        result["facts"] = {"model": model, "gpus_needed": gpus_needed(values)}
        out["branches"][branch.get("id", str(len(out["branches"])))] = result
    timings["validate_s"] = round(time.time() - t, 3)
    out["port"] = port_fact(ARGS.get("port"), root)
    out["gpus"] = gpu_fact()
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
