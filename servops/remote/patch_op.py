import difflib
import errno
import fcntl
import shutil
import subprocess
import tempfile
import time

STATE_VERSION = 1


def state_root():
    sites = site_dirs()
    venv_id = hashlib.sha256(sites[0].encode()).hexdigest()[:12]
    root = os.path.join(os.path.expanduser(ARGS["state_dir"]), "patches", venv_id)
    return root


def load_state(root):
    try:
        with open(os.path.join(root, "state.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {"version": STATE_VERSION, "site": site_dirs()[0], "applied": {}}


def save_state(root, state):
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, ".state.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(state, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(root, "state.json"))


class Lock:
    """flock on the venv's patch state: one patch operation at a time per venv."""

    def __init__(self, root, timeout):
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, "lock")
        self.timeout = timeout

    def __enter__(self):
        self.fh = open(self.path, "a+")
        deadline = time.time() + self.timeout
        while True:
            try:
                fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.time() >= deadline:
                    self.fh.seek(0)
                    holder = self.fh.read().strip() or "unknown"
                    fail("another servops patch operation holds %s (%s); retry, or raise --lock-timeout" % (self.path, holder))
                time.sleep(0.05)
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write("pid %d since %s\n" % (os.getpid(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
        self.fh.flush()
        return self

    def __exit__(self, *exc):
        self.fh.truncate(0)
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def run_patch(workdir, patch, reverse=False, dry_run=False):
    argv = ["patch", "-p%d" % patch["strip"], "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
            "-r", "-", "-d", workdir]
    if reverse:
        argv.append("--reverse")
    if dry_run:
        argv.append("--dry-run")
    try:
        proc = subprocess.run(argv, input=patch["text"], capture_output=True, text=True)
    except FileNotFoundError:
        fail("patch(1) is not installed on the host; install the 'patch' package")
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def stage(site, patch):
    """Copy the patch's files into a scratch tree, so patch(1) never touches the live venv."""
    work = tempfile.mkdtemp(prefix="servops-patch-")
    for rel in patch["files"]:
        src = os.path.join(site, rel)
        dst = os.path.join(work, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.exists(src):
            shutil.copy2(src, dst)
    return work


def dry_run_applies(site, patch, reverse=False):
    work = stage(site, patch)
    try:
        return run_patch(work, patch, reverse=reverse, dry_run=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def probe(site, patch):
    """applied / not-applied / conflicts, decided by patch(1) dry runs on a staged copy."""
    forward, fmsg = dry_run_applies(site, patch)
    if forward:
        return "not-applied", fmsg
    reverse, rmsg = dry_run_applies(site, patch, reverse=True)
    if reverse:
        return "applied", rmsg
    return "conflicts", fmsg


def read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def staged_changes(site, work, files):
    """(rel, live bytes, staged bytes) for each file patch(1) produced in the scratch tree."""
    return [(rel, read(os.path.join(site, rel)), read(os.path.join(work, rel))) for rel in files]


def unified(rel, before, after):
    a = (before or b"").decode("utf-8", "replace").splitlines(True)
    b = (after or b"").decode("utf-8", "replace").splitlines(True)
    return "".join(difflib.unified_diff(a, b, "a/" + rel, "b/" + rel))


def replace_file(path, data, like=None):
    """Write a sibling temp file, fsync it, then rename over the target: never half-written."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".servops-", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if like and os.path.exists(like):
            shutil.copymode(like, tmp)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def refresh_bytecode(path):
    """Drop stale .pyc for a touched module and compile a fresh one, so the edit takes effect."""
    if not path.endswith(".py"):
        return
    import importlib.util
    import py_compile
    cache_dir = os.path.join(os.path.dirname(path), "__pycache__")
    stem = os.path.splitext(os.path.basename(path))[0] + "."
    if os.path.isdir(cache_dir):
        for name in os.listdir(cache_dir):
            if name.startswith(stem) and name.endswith(".pyc"):
                try:
                    os.unlink(os.path.join(cache_dir, name))
                except OSError:
                    pass
    try:
        py_compile.compile(path, cfile=importlib.util.cache_from_source(path), doraise=True)
    except (OSError, py_compile.PyCompileError):
        pass  # a missing .pyc is recompiled at import; a read-only tree just runs slower


def put_content(path, data):
    """Make the file hold `data`; None means the file must not exist."""
    if data is None:
        if os.path.exists(path):
            os.unlink(path)
    else:
        replace_file(path, data, like=path)


def commit(site, changes):
    """Replace every file, or none: on any failure restore what was already replaced."""
    done = []
    try:
        for rel, before, after in changes:
            put_content(os.path.join(site, rel), after)
            done.append((rel, before))
    except BaseException as exc:
        for rel, before in reversed(done):
            put_content(os.path.join(site, rel), before)
        fail("writing the patched files failed (%s); every file was restored" % exc)
    for rel, _b, _a in changes:
        refresh_bytecode(os.path.join(site, rel))


def dist_version(dist):
    meta = find_dist(dist)
    return (meta["version"], meta["site"]) if meta else (None, None)


def installed_or_fail(dist):
    version, site = dist_version(dist)
    if version is None:
        fail("%s is not installed in %s" % (dist, sys.executable))
    return version, site


def op_status():
    root = state_root()
    state = load_state(root)
    out = []
    for patch in ARGS["patches"]:
        version, site = dist_version(patch["dist"])
        entry = {"name": patch["name"], "dist": patch["dist"], "version": version,
                 "recorded": patch["name"] in state["applied"]}
        if version is None:
            entry["state"] = "not-installed"
        else:
            entry["state"], entry["detail"] = probe(site, patch)
        out.append(entry)
    reply({"site": site_dirs(), "patches": out, "state_file": os.path.join(root, "state.json")})


def op_apply():
    patch = ARGS["patch"]
    root = state_root()
    with Lock(root, ARGS.get("lock_timeout", 30)):
        version, site = installed_or_fail(patch["dist"])
        if ARGS.get("expect_version") and version != ARGS["expect_version"]:
            fail("%s changed to %s while applying; re-run" % (patch["dist"], version))
        state = load_state(root)
        work = stage(site, patch)
        try:
            ok, msg = run_patch(work, patch)
            if not ok:
                rev_ok, _ = dry_run_applies(site, patch, reverse=True)
                if rev_ok:
                    if patch["name"] not in state["applied"] and not ARGS.get("dry_run"):
                        state["applied"][patch["name"]] = {
                            "dist": patch["dist"], "version": version, "files": {},
                            "applied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "adopted": True}
                        save_state(root, state)
                    reply({"site": site_dirs(), "result": "ok", "message": "already applied", "diff": ""})
                    return
                fail("patch %s does not apply to %s %s (nothing was changed):\n%s" % (patch["name"], patch["dist"], version, msg))
            changes = staged_changes(site, work, patch["files"])
        finally:
            shutil.rmtree(work, ignore_errors=True)
        diff = "".join(unified(rel, b, a) for rel, b, a in changes)
        if ARGS.get("dry_run"):
            reply({"site": site_dirs(), "result": "changed", "message": "would apply (check mode)", "diff": diff})
            return
        backup = os.path.join(root, "backups", patch["name"])
        shutil.rmtree(backup, ignore_errors=True)
        files = {}
        for rel, before, after in changes:
            if before is not None:
                dst = os.path.join(backup, rel)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                replace_file(dst, before)
            files[rel] = {"before": sha(before), "after": sha(after)}
        commit(site, changes)
        state["applied"][patch["name"]] = {"dist": patch["dist"], "version": version, "files": files,
                                           "applied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        save_state(root, state)
        reply({"site": site_dirs(), "result": "changed", "message": "applied", "diff": diff})


def sha(data):
    return data is not None and "sha256=" + hashlib.sha256(data).hexdigest()


def op_revert():
    patch = ARGS["patch"]
    root = state_root()
    with Lock(root, ARGS.get("lock_timeout", 30)):
        version, site = installed_or_fail(patch["dist"])
        state = load_state(root)
        record = state["applied"].get(patch["name"])
        backup = os.path.join(root, "backups", patch["name"])
        changes = []
        exact = bool(record and record.get("files"))
        if exact:
            # Exact restore from the backup when every file is still as servops left it.
            for rel, hashes in record["files"].items():
                current = read(os.path.join(site, rel))
                if sha(current) != hashes["after"]:
                    exact = False
                    break
                changes.append((rel, current, read(os.path.join(backup, rel)) if hashes["before"] else None))
        if not exact:
            changes = []
            work = stage(site, patch)
            try:
                ok, msg = run_patch(work, patch, reverse=True)
                if not ok:
                    fwd_ok, _ = dry_run_applies(site, patch)
                    if fwd_ok:
                        if record and not ARGS.get("dry_run"):
                            del state["applied"][patch["name"]]
                            save_state(root, state)
                        reply({"site": site_dirs(), "result": "ok", "message": "not applied", "diff": ""})
                        return
                    fail("patch %s cannot be reverted: the files were edited since (nothing was changed):\n%s" % (patch["name"], msg))
                changes = staged_changes(site, work, patch["files"])
            finally:
                shutil.rmtree(work, ignore_errors=True)
        diff = "".join(unified(rel, b, a) for rel, b, a in changes)
        if ARGS.get("dry_run"):
            reply({"site": site_dirs(), "result": "changed", "message": "would revert (check mode)", "diff": diff})
            return
        commit(site, changes)
        state["applied"].pop(patch["name"], None)
        save_state(root, state)
        shutil.rmtree(backup, ignore_errors=True)
        reply({"site": site_dirs(), "result": "changed", "message": "reverted" + (" (exact restore)" if exact else ""),
               "diff": diff})


def pristine_from_wheel(dist, version, rel):
    """The file as shipped: from the host's pip cache, or a pip download of the same version."""
    import zipfile
    work = tempfile.mkdtemp(prefix="servops-wheel-")
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "-q", "-d", work, "%s==%s" % (dist, version)], capture_output=True, text=True)
        wheels = [f for f in os.listdir(work) if f.endswith(".whl")]
        if proc.returncode != 0 or not wheels:
            fail("cannot fetch %s==%s with pip on the host: %s" % (dist, version, (proc.stderr.strip().splitlines() or ["no wheel"])[-1]))
        with zipfile.ZipFile(os.path.join(work, wheels[0])) as zf:
            try:
                return zf.read(rel)
            except KeyError:
                fail("%s is not in the %s %s wheel" % (rel, dist, version))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def op_pristine():
    path, site = resolve_in_site(ARGS["file"])
    rel = os.path.relpath(path, site)
    owner = owner_of(rel, site)
    if owner is None:
        fail("%s is not owned by any installed distribution; cannot find its pristine content" % rel)
    current = read(path)
    root = state_root()
    state = load_state(root)
    source = None
    pristine = None
    for name, record in state["applied"].items():
        if rel in record.get("files", {}) and record["files"][rel]["before"]:
            pristine = read(os.path.join(root, "backups", name, rel))
            source = "servops backup of patch %s" % name
            break
    if pristine is None:
        pristine = pristine_from_wheel(owner["name"], owner["version"], rel)
        source = "%s %s wheel" % (owner["name"], owner["version"])
    reply({"site": site_dirs(), "rel": rel, "dist": owner["name"], "version": owner["version"], "source": source,
           "diff": unified(rel, pristine, current)})


{"status": op_status, "apply": op_apply, "revert": op_revert, "pristine": op_pristine}[ARGS["op"]]()
