# The facts a fleet campaign compares between hosts before its first trial: the GPUs (model and
# count), the engine's distribution and version in the venv, the model path (and what is there),
# the python, and the servops patches applied to the venv. Read only; changes nothing.
import platform


def engine_fact(dists):
    for name in dists:
        meta = find_dist(name)
        if meta:
            return {"dist": meta["name"], "version": meta["version"]}
    return {"dist": None, "version": None}


def patches_fact():
    applied = load_patch_state()["applied"]
    return sorted("%s %s" % (name, (rec or {}).get("version") or "") for name, rec in applied.items())


reply({"gpu": gpu_fact(), "engine": engine_fact(ARGS["dists"]), "model": model_fact(ARGS.get("model_path")),
       "python": platform.python_version(), "patches": patches_fact()})
