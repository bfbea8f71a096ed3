import difflib
import errno
import fcntl
import shutil
import signal
import subprocess
import tempfile
import time

# Patch state, lock and journal live in patch_state_root(): keyed to this environment's real
# path, so every inventory entry and operator using the venv sees the same state.
#
# Crash safety: a commit first publishes an intent journal (every file's old and new content and
# hashes, the state to save afterwards), fsynced, by renaming txn.tmp -> txn. Only then are the
# files replaced, one rename each. A `committed` marker follows the last rename. Every later
# patch operation first calls recover(): without the marker it restores every file to its old
# content (rolled back); with it, it finishes the work (rolled forward). Temp files sit beside
# their target under a dot-name import never loads, and are recorded in the journal and removed
# by recovery.
PATCH_ROOT = patch_state_root()
TXN = os.path.join(PATCH_ROOT, "txn")
STATE_VERSION = 2


def now_iso():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def fault(point):
    """Crash-safety tests kill the program at a named point (SIGKILL: no cleanup), or fill the
    disk there (`enospc-<point>`: the next write fails as on a full disk)."""
    injected = ARGS.get("_fault") or ""
    if injected == point:
        os.kill(os.getpid(), signal.SIGKILL)
    op, _, where = point.partition(":")
    if injected == "%s:enospc-%s" % (op, where):
        raise OSError(errno.ENOSPC, "No space left on device (injected by SERVOPS_FAULT)")


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path, data, mode=0o600):
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    replace_with(path, data, mode)


def read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def load_state():
    state = load_patch_state(PATCH_ROOT)
    state["version"] = STATE_VERSION
    return state


def save_state(state):
    write_durable(os.path.join(PATCH_ROOT, "state.json"), json.dumps(state, indent=1, sort_keys=True).encode())
    fsync_dir(PATCH_ROOT)


class Lock:
    """flock on the venv's patch state: one patch operation at a time per environment."""

    def __init__(self, timeout):
        os.makedirs(PATCH_ROOT, mode=0o700, exist_ok=True)
        self.path = os.path.join(PATCH_ROOT, "lock")
        self.timeout = timeout

    def __enter__(self):
        # never through a symlink planted at the lock: the holder line below truncates the file
        self.fh = os.fdopen(open_private(self.path, os.O_RDWR | os.O_CREAT), "r+")
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
        self.fh.write("pid %d since %s\n" % (os.getpid(), now_iso()))
        self.fh.flush()
        return self

    def __exit__(self, *exc):
        self.fh.truncate(0)
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


# ---- the transaction ----------------------------------------------------------------------

def tmp_path(site, rel):
    target = os.path.join(site, rel)
    return os.path.join(os.path.dirname(target), "." + os.path.basename(target) + ".servops-tmp")


def put(site, rel, data, mode):
    """Make site/rel hold `data` (None: absent) via a temp file + rename; never half-written."""
    target = os.path.join(site, rel)
    if data is None:
        if os.path.lexists(target):
            os.unlink(target)
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    replace_with(target, data, mode, tmp=tmp_path(site, rel))


def begin(op, patch_name, site, changes, state_after, backup):
    """Publish the intent journal; nothing in site-packages has changed yet."""
    work = TXN + ".tmp"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, mode=0o700)
    files = []
    for i, (rel, before, after) in enumerate(changes):
        if before is not None:
            write_durable(os.path.join(work, "old", str(i)), before)
        if after is not None:
            write_durable(os.path.join(work, "new", str(i)), after)
        try:
            mode = os.stat(os.path.join(site, rel)).st_mode & 0o777
        except OSError:
            mode = 0o644
        files.append({"rel": rel, "i": i, "old": sha_bytes(before), "new": sha_bytes(after), "mode": mode})
    journal = {"op": op, "patch": patch_name, "site": site, "files": files, "state_after": state_after,
               "backup": backup, "started_at": now_iso(), "pid": os.getpid()}
    write_durable(os.path.join(work, "journal.json"), json.dumps(journal).encode())
    fsync_dir(work)
    fault("%s:journal" % op)
    os.rename(work, TXN)
    fsync_dir(PATCH_ROOT)
    return journal


def txn_content(kind, entry):
    return read(os.path.join(TXN, kind, str(entry["i"])))


def clean_temps(journal):
    for f in journal["files"]:
        tmp = tmp_path(journal["site"], f["rel"])
        if os.path.lexists(tmp):
            os.unlink(tmp)


def end_txn():
    gone = TXN + ".del"
    shutil.rmtree(gone, ignore_errors=True)
    if os.path.isdir(TXN):
        os.rename(TXN, gone)
        fsync_dir(PATCH_ROOT)
    shutil.rmtree(gone, ignore_errors=True)


def commit_files(journal):
    """Every file replaced, then the commit point: the `committed` marker."""
    site = journal["site"]
    for n, f in enumerate(journal["files"]):
        fault("%s:rename:%d" % (journal["op"], n))
        put(site, f["rel"], txn_content("new", f), f["mode"])
    for d in sorted({os.path.dirname(os.path.join(site, f["rel"])) for f in journal["files"]}):
        fsync_dir(d)
    fault("%s:before-commit-mark" % journal["op"])
    write_durable(os.path.join(TXN, "committed"), b"1")
    fsync_dir(TXN)
    fault("%s:committed" % journal["op"])


def finish(journal):
    """Roll forward from the commit point: every file new, backups and state saved, txn gone."""
    site = journal["site"]
    for f in journal["files"]:
        if sha256_hex(os.path.join(site, f["rel"])) != f["new"]:
            put(site, f["rel"], txn_content("new", f), f["mode"])
    clean_temps(journal)
    backup = journal["backup"]
    bdir = os.path.join(PATCH_ROOT, "backups", backup["name"])
    if backup["action"] == "set":
        shutil.rmtree(bdir, ignore_errors=True)
        for f in journal["files"]:
            old = txn_content("old", f)
            if old is not None:
                write_durable(os.path.join(bdir, f["rel"]), old)
    fault("%s:before-state" % journal["op"])
    save_state(journal["state_after"])
    if backup["action"] == "drop":
        shutil.rmtree(bdir, ignore_errors=True)
    end_txn()
    for f in journal["files"]:
        refresh_bytecode(os.path.join(site, f["rel"]))


def roll_back(journal):
    site = journal["site"]
    for f in reversed(journal["files"]):
        if sha256_hex(os.path.join(site, f["rel"])) != f["old"]:
            put(site, f["rel"], txn_content("old", f), f["mode"])
    clean_temps(journal)
    end_txn()
    for f in journal["files"]:
        refresh_bytecode(os.path.join(site, f["rel"]))


def recover():
    """Finish or undo a transaction a killed operation left behind. Returns what was done."""
    unpublished = os.path.isdir(TXN + ".tmp")
    shutil.rmtree(TXN + ".tmp", ignore_errors=True)  # never published: nothing was replaced
    shutil.rmtree(TXN + ".del", ignore_errors=True)
    if not os.path.isdir(TXN):
        return "discarded the unfinished journal of a killed operation (no file had changed)" if unpublished else None
    try:
        with open(os.path.join(TXN, "journal.json")) as fh:
            journal = json.load(fh)
    except (OSError, ValueError):
        end_txn()  # published journals are complete by construction; this one is not ours
        return "removed an unreadable patch journal"
    what = "%s %s (pid %s, %s)" % (journal["op"], journal["patch"], journal.get("pid"), journal.get("started_at"))
    if os.path.exists(os.path.join(TXN, "committed")):
        finish(journal)
        return "finished an interrupted " + what
    roll_back(journal)
    return "undid an interrupted " + what


def transact(op, patch_name, site, changes, state_after, backup):
    """Run the transaction; returns None when it is recorded, else why the record is pending.

    Before the commit point a failure (a full disk, say) undoes the files first and is reported
    as "nothing was changed"; after it, the files ARE patched and the message says so: the next
    patch operation finishes the record (the journal holds everything it needs)."""
    try:
        journal = begin(op, patch_name, site, changes, state_after, backup)
    except OSError as exc:
        shutil.rmtree(TXN + ".tmp", ignore_errors=True)
        fail("%s %s failed before any file changed (%s); nothing was changed" % (op, patch_name, exc))
    try:
        commit_files(journal)
    except OSError as exc:
        try:
            roll_back(journal)
        except OSError as again:
            fail("%s %s failed (%s) and could not be undone yet (%s): the next patch operation undoes it"
                 % (op, patch_name, exc, again))
        fail("%s %s failed (%s); rolled back, nothing was changed" % (op, patch_name, exc))
    try:
        finish(journal)
    except OSError as exc:
        return "%s (%s); the next patch operation will record it" % (
            {"apply": "applied, not yet recorded", "revert": "reverted, not yet recorded"}[op], exc)
    return None


# ---- patch(1) on a staged copy --------------------------------------------------------------

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


def check_targets(site, patch):
    """Every file the patch touches is a regular file (or absent) inside site-packages, reached
    without leaving it through a symlinked directory."""
    real_site = os.path.realpath(site)
    for rel in patch["files"]:
        target = os.path.join(site, rel)
        parent = os.path.realpath(os.path.dirname(target))
        if not inside(parent, real_site):
            fail("patch %s: %s resolves outside site-packages (%s) through a symlink; refusing"
                 % (patch["name"], rel, parent))
        if os.path.islink(target):
            fail("patch %s: %s is a symlink; refusing to patch through it" % (patch["name"], rel))


def stage(site, patch):
    """Copy the patch's files into a scratch tree, so patch(1) never touches the live venv."""
    work = tempfile.mkdtemp(prefix="servops-patch-")
    for rel in patch["files"]:
        src = os.path.join(site, rel)
        dst = os.path.join(work, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.isfile(src) and not os.path.islink(src):
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


def patched_copy(site, patch, reverse=False):
    """(ok, message, [(rel, live bytes, result bytes)]) of patch(1) on a staged copy."""
    work = stage(site, patch)
    try:
        ok, msg = run_patch(work, patch, reverse=reverse)
        if not ok:
            return False, msg, []
        for rel in patch["files"]:
            out = os.path.join(work, rel)
            if os.path.islink(out):
                fail("patch %s would create a symlink at %s; refusing" % (patch["name"], rel))
        return True, msg, [(rel, read(os.path.join(site, rel)), read(os.path.join(work, rel))) for rel in patch["files"]]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def unified(rel, before, after):
    a = (before or b"").decode("utf-8", "replace").splitlines(True)
    b = (after or b"").decode("utf-8", "replace").splitlines(True)
    return "".join(difflib.unified_diff(a, b, "a/" + rel, "b/" + rel))


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
    if not os.path.exists(path):
        return
    try:
        py_compile.compile(path, cfile=importlib.util.cache_from_source(path), doraise=True)
    except (OSError, py_compile.PyCompileError):
        pass  # a missing .pyc is recompiled at import; a read-only tree just runs slower


def dist_version(dist):
    meta = find_dist(dist)
    return (meta["version"], meta["site"]) if meta else (None, None)


def installed_or_fail(dist):
    version, site = dist_version(dist)
    if version is None:
        fail("%s is not installed in %s" % (dist, sys.executable))
    return version, site


def record_for(patch, version, changes, adopted=False):
    rec = {"dist": patch["dist"], "version": version, "applied_at": now_iso(), "by": ARGS.get("operator"),
           "files": {rel: {"before": sha_bytes(b), "after": sha_bytes(a)} for rel, b, a in changes}}
    if adopted:
        rec["adopted"] = True
    return rec


def files_match(site, record, which):
    files = record.get("files") or {}
    return bool(files) and all(sha256_hex(os.path.join(site, rel)) == h[which] for rel, h in files.items())


def answer(result, message, diff="", recovered=None):
    return {"site": site_dirs(), "result": result, "message": message, "diff": diff, "state_root": PATCH_ROOT,
            "recovered": recovered}


# ---- operations -------------------------------------------------------------------------

def do_status(patches, lock_timeout=30):
    """Each patch's state, derived from the FILES and reconciled with the state file."""
    with Lock(lock_timeout):
        recovered = recover()
        out = status_rows(patches)
    return {"site": site_dirs(), "patches": out, "state_root": PATCH_ROOT, "recovered": recovered}


def status_rows(patches):
    state = load_state()
    out, dropped = [], []
    for patch in patches:
        version, site = dist_version(patch["dist"])
        record = state["applied"].get(patch["name"])
        entry = {"name": patch["name"], "dist": patch["dist"], "version": version, "recorded": bool(record)}
        if version is None:
            entry["state"] = "not-installed"
        elif record and files_match(site, record, "after"):
            entry["state"], entry["detail"] = "applied", "files hold what the patch wrote"
        else:
            entry["state"], entry["detail"] = probe(site, patch)
        if record and entry["state"] == "not-applied":
            # The files say it is not applied (a reinstall, say): the record is stale.
            dropped.append(patch["name"])
            entry["recorded"] = False
            entry["detail"] = "stale record dropped: the files are unpatched"
        out.append(entry)
    if dropped:
        for name in dropped:
            state["applied"].pop(name, None)
            shutil.rmtree(os.path.join(PATCH_ROOT, "backups", name), ignore_errors=True)
        save_state(state)
    return out


def do_apply(patch, dry_run=False, expect_version=None, lock_timeout=30):
    with Lock(lock_timeout):
        recovered = recover()
        version, site = installed_or_fail(patch["dist"])
        if expect_version and version != expect_version:
            fail("%s changed to %s while applying; re-run" % (patch["dist"], version))
        check_targets(site, patch)
        state = load_state()
        ok, msg, changes = patched_copy(site, patch)
        if not ok:
            rev_ok, _m, reverted = patched_copy(site, patch, reverse=True)
            if not rev_ok:
                fail("patch %s does not apply to %s %s (nothing was changed):\n%s"
                     % (patch["name"], patch["dist"], version, msg))
            if patch["name"] not in state["applied"] and not dry_run:
                # Applied on disk but not recorded: adopt it, with exact backups from the reverse patch.
                for rel, _live, before in reverted:
                    if before is not None:
                        write_durable(os.path.join(PATCH_ROOT, "backups", patch["name"], rel), before)
                state["applied"][patch["name"]] = record_for(
                    patch, version, [(rel, before, live) for rel, live, before in reverted], adopted=True)
                save_state(state)
                return answer("ok", "already applied (recorded it now)", recovered=recovered)
            return answer("ok", "already applied", recovered=recovered)
        diff = "".join(unified(rel, b, a) for rel, b, a in changes)
        if dry_run:
            return answer("changed", "would apply (check mode)", diff, recovered)
        after = dict(state, applied=dict(state["applied"]))
        after["applied"][patch["name"]] = record_for(patch, version, changes)
        pending = transact("apply", patch["name"], site, changes, after, {"action": "set", "name": patch["name"]})
        return answer("changed", pending or "applied", diff, recovered)


def do_revert(patch, dry_run=False, lock_timeout=30):
    with Lock(lock_timeout):
        recovered = recover()
        version, site = installed_or_fail(patch["dist"])
        check_targets(site, patch)
        state = load_state()
        record = state["applied"].get(patch["name"])
        backup = os.path.join(PATCH_ROOT, "backups", patch["name"])
        exact = bool(record) and files_match(site, record, "after")
        if exact:
            # Exact restore from the backup: every file is still as servops left it.
            changes = [(rel, read(os.path.join(site, rel)), read(os.path.join(backup, rel)) if h["before"] else None)
                       for rel, h in record["files"].items()]
            if any(h["before"] and sha_bytes(after) != h["before"] for (_r, _l, after), h
                   in zip(changes, record["files"].values())):
                exact = False  # a damaged backup: fall back to the reverse patch
        if not exact:
            ok, msg, changes = patched_copy(site, patch, reverse=True)
            if not ok:
                if dry_run_applies(site, patch)[0]:
                    if record and not dry_run:
                        del state["applied"][patch["name"]]
                        save_state(state)
                        shutil.rmtree(backup, ignore_errors=True)
                    return answer("ok", "not applied", recovered=recovered)
                fail("patch %s cannot be reverted: the files were edited since (nothing was changed):\n%s"
                     % (patch["name"], msg))
        diff = "".join(unified(rel, b, a) for rel, b, a in changes)
        if dry_run:
            return answer("changed", "would revert (check mode)", diff, recovered)
        after = dict(state, applied=dict(state["applied"]))
        after["applied"].pop(patch["name"], None)
        pending = transact("revert", patch["name"], site, changes, after, {"action": "drop", "name": patch["name"]})
        return answer("changed", pending or ("reverted" + (" (exact restore)" if exact else "")), diff, recovered)


def pristine_from_wheel(dist, version, rel):
    """The file as shipped: a pip download of the same version (pip's cache answers offline)."""
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


def do_pristine(file):
    path, site = resolve_in_site(file)
    rel = os.path.relpath(path, site)
    owner = owner_of(rel, site)
    if owner is None:
        fail("%s is not owned by any installed distribution; cannot find its pristine content" % rel)
    current = read(path)
    state = load_state()
    source = None
    pristine = None
    for name, record in state["applied"].items():
        if rel in record.get("files", {}) and record["files"][rel]["before"]:
            pristine = read(os.path.join(PATCH_ROOT, "backups", name, rel))
            source = "servops backup of patch %s" % name
            break
    if pristine is None:
        pristine = pristine_from_wheel(owner["name"], owner["version"], rel)
        source = "%s %s wheel" % (owner["name"], owner["version"])
    return {"site": site_dirs(), "rel": rel, "dist": owner["name"], "version": owner["version"], "source": source,
            "diff": unified(rel, pristine, current)}
