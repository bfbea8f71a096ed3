import select
import signal
import shutil
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request

# Releases, `current`, the server process, the deploy lock, the health gate, the host journal
# and the health-gate guard, under one deploy root. Everything servops writes here is 0600/0700:
# scripts, variant files and logs can hold tokens.
ROOT = os.path.realpath(os.path.expanduser(ARGS.get("deploy_root", "~/.servops/deploy")))
RELEASES = os.path.join(ROOT, "releases")
CURRENT = os.path.join(ROOT, "current")
PIDFILE = os.path.join(ROOT, "server.pid")
LOCKFILE = os.path.join(ROOT, "deploy.lock")
JOURNAL = os.path.join(ROOT, "journal.jsonl")
NAME_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z-[A-Za-z0-9][A-Za-z0-9._-]*")
PINS = os.path.join(ROOT, "pins.json")
# A release whose server a controller is bringing up (a new release, or a restart of one): its
# guard watches it, and a command that finds it so with no guard alive starts one.
IN_FLIGHT = ("deploying", "restarting")


def release_dir(name):
    """A release named as `releases` lists it; never a path."""
    if not NAME_RE.fullmatch(name or ""):
        fail("%r is not a release name (see invoke releases)" % (name,))
    path = os.path.join(RELEASES, name)
    if os.path.islink(path):  # planted: servops' writes would land wherever it points
        fail("release %s is a symlink (to %s), not a release servops made; remove it" % (name, os.readlink(path)))
    return path


def check_root():
    """The deploy root's own entries are what servops made them: a symlink planted at
    `releases` or the journal (by a compromised server, say) would carry every write of every
    op elsewhere, so no op runs until it is removed."""
    for path in (RELEASES, JOURNAL):
        if os.path.islink(path):
            fail("%s is a symlink (to %s); servops does not write through it: remove it" % (path, os.readlink(path)))


def own_file(path, flags):
    """Open a file servops owns inside a release (server.log, lease, markers), never through a
    symlink (one planted there is removed and the file made anew), never blocking on a FIFO or
    opening anything but a regular file (one line naming it)."""
    if os.path.islink(path):
        os.unlink(path)
    return open_regular(path, flags)


def current_name():
    try:
        return os.path.basename(os.readlink(CURRENT))
    except OSError:
        return None


def release_info(name):
    meta = read_json(os.path.join(RELEASES, name, "release.json"), {})
    meta = meta if isinstance(meta, dict) else {}
    meta["name"] = name
    return meta


def list_releases():
    try:
        names = sorted(n for n in os.listdir(RELEASES) if NAME_RE.fullmatch(n) and os.path.isdir(os.path.join(RELEASES, n))
                       and not os.path.islink(os.path.join(RELEASES, n)))
    except OSError:
        names = []
    return [release_info(n) for n in names]


def journal(entry):
    append_journal(JOURNAL, entry)


def guard_lock(name):
    """One guard per release: its spawn, and the check for a dead one, under this flock."""
    import contextlib
    import fcntl

    @contextlib.contextmanager
    def held():
        fd = open_private(os.path.join(release_dir(name), "guard.lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
    return held()


def release_secrets(name):
    """Secret values of a release (its 0600 secrets.env): masked in every log line we return."""
    values = []
    try:
        with open(os.path.join(RELEASES, name, "secrets.env")) as fh:
            for line in fh:
                if "=" in line:
                    import shlex
                    try:
                        value = shlex.split(line.split("=", 1)[1])
                    except ValueError:
                        continue
                    if value and len(value[0]) >= 4:
                        values.append(value[0])
    except OSError:
        pass
    return sorted(set(values), key=len, reverse=True)


def masker(name):
    secrets = release_secrets(name) if name else []

    def mask(text):
        for s in secrets:
            text = text.replace(s, "***")
        return text
    return mask


# ---- the deploy lock ------------------------------------------------------------------------

def lock_state():
    """(holder record or None, age seconds, readable). An empty or unreadable lock (a full disk
    at lock time, say) is reported as unreadable: it is stale and always breakable."""
    try:
        st = os.lstat(LOCKFILE)
    except FileNotFoundError:
        return None, 0, True
    # A symlink (dangling, or to another file) or anything not a plain file is no lock servops
    # wrote: unreadable, so stale and breakable (the break unlinks the entry, never its target).
    held = read_json(LOCKFILE) if stat.S_ISREG(st.st_mode) else None
    age = time.time() - st.st_mtime
    damaged = lock_problem(held) if isinstance(held, dict) and held.get("id") else None
    if not isinstance(held, dict) or not held.get("id") or damaged:
        return dict({"id": None, "unreadable": True, "size": st.st_size, "mtime": st.st_mtime},
                    **({"damaged": damaged} if damaged else {})), age, False
    # A holder running ON this host (the guard) is alive or not by its pid and start time.
    if held.get("host_pid"):
        held["alive_on_host"] = proc_starttime(held["host_pid"]) == held.get("host_starttime")
    return held, age, True


def lock_problem(held):
    """Why a lock record is not one servops writes (a field of another type, a pid that is none),
    or None: such a record is taken for an unreadable lock, stale and breakable."""
    for key in ("id", "who", "user", "controller", "action", "acquired_at", "detail", "host_starttime"):
        if held.get(key) is not None and not isinstance(held[key], str):
            return "%s %s is not text" % (key, repr(held[key])[:40])
    for key in ("pid", "host_pid"):
        value = held.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 22):
            return "%s %s is not a pid" % (key, repr(value)[:40])
    return None


def lock_record():
    """The deploy lock's holder with its age in seconds, or None: what a check mode reports the
    real run would meet."""
    held, age, _readable = lock_state()
    return None if held is None else dict(held, age=round(age, 1))


def take_lock(owner):
    """Publish a complete lock record atomically: write a temp file, then link(2) it into place
    (fails if a lock exists). A failed write leaves no lock at all, never an empty one."""
    os.makedirs(ROOT, mode=0o700, exist_ok=True)
    tmp = LOCKFILE + ".new-%d" % os.getpid()
    replace_with(tmp, json.dumps(owner))
    try:
        os.link(tmp, LOCKFILE)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def op_lock():
    owner = dict(ARGS["owner"], acquired_at=now_iso())
    replace = ARGS.get("replace")
    for _ in range(2):
        if take_lock(owner):
            busy = [u for u in UNFINISHED if u["guard"] in ("watching", "restarted")]
            if busy and not ARGS.get("supersede"):
                # a guard is finishing a deploy whose controller was lost: wait for it
                os.unlink(LOCKFILE)
                return {"acquired": False, "root": ROOT, "age": 0, "held": {
                    "id": "guard", "who": "the host's guard", "action": "finishing the deploy of %s" % busy[0]["release"],
                    "acquired_at": now_iso(), "guard": True, "detail": busy[0]["detail"]}}
            orphans = supersede_unfinished(owner)
            out = {"acquired": True, "root": ROOT, "listing": op_releases(), "orphans": orphans}
            if ARGS.get("port"):
                out["port"] = op_port_check()
            return out
        held, age, readable = lock_state()
        if held is None:
            continue  # released between our two looks
        # Break only the lock the controller saw (same id, or the same unreadable file), so a
        # lock a third party took in between is never broken by mistake.
        if replace and ((readable and held.get("id") == replace.get("id")) or
                        (not readable and replace.get("unreadable") and held.get("mtime") == replace.get("mtime"))):
            os.unlink(LOCKFILE)
            journal({"action": "lock.break", "who": owner.get("who"), "detail": replace.get("why"),
                     "previous": {k: held.get(k) for k in ("who", "action", "acquired_at", "id")}})
            replace = None
            continue
        return {"acquired": False, "held": held, "age": age, "root": ROOT}
    fail("could not take the deploy lock %s" % LOCKFILE)


def supersede_unfinished(owner):
    """Releases still 'deploying' when an operation that replaces or stops the server holds the
    lock belong to a deploy that died (its lock was stale or broken): that operation decides now
    (its `decision` token: a guard watching one stands down) and they are 'interrupted'."""
    names = []
    for rel in list_releases():
        if rel.get("status") in IN_FLIGHT:
            claim(rel["name"], {"by": "op", "id": owner.get("id"), "action": owner.get("action")}, take_over=True)
            write_fields(rel["name"], {"status": "interrupted", "failure": "the deploy that made it did not finish "
                                       "(superseded by %s)" % owner.get("action")})
            journal({"action": "release.interrupted", "release": rel["name"], "who": owner.get("who"),
                     "detail": "its deploy did not finish"})
            names.append(rel["name"])
    return names


def op_unlock():
    held, _age, _readable = lock_state()
    if held and held.get("id") == ARGS["id"]:
        os.unlink(LOCKFILE)
    return {"released": True}


# ---- releases and the server ----------------------------------------------------------------

def op_releases():
    server = server_proc(adopt=True)
    leftovers = [] if server else [{"pid": p, "name": f.get("name"), "release": f.get("release")}
                                   for p, f in sorted(release_tree().items())]
    return {"root": ROOT, "current": current_name(), "releases": list_releases(), "server": server,
            "leftovers": leftovers, "unfinished": UNFINISHED, "protected": protected(), "pins_damaged": pins_damaged()}


def op_facts():
    """`releases` and the state of the given patches in one round trip: what rollback, start and
    restart plan from (the patch state as patch.status reads it, after finishing a transaction a
    killed patch run left behind), and how the current release's launch files drifted."""
    status = do_status(ARGS["patches"], ARGS.get("lock_timeout", 30)) if ARGS.get("patches") else {}
    listing = op_releases()
    return dict(listing, patches=status.get("patches") or [], patches_recovered=status.get("recovered"),
                lock=lock_record(), drift=release_drift(listing["current"]) if listing["current"] else None)


def release_drift(name):
    """The launch files of release `name` that are no longer what servops wrote (release.json's
    "files": each one's sha256 as written): [{file, recorded, now, bytes, modified}], `now` None
    for a file gone or no longer a regular file (`kind` says what); None where nothing was
    recorded (a release made by an older servops)."""
    import hashlib
    recorded = release_info(name).get("files")
    if not isinstance(recorded, dict):
        return None
    d = release_dir(name)
    drift = []
    for rel, digest in sorted(recorded.items()):
        if not isinstance(rel, str) or "/" in rel or rel.startswith("."):
            continue
        path = os.path.join(d, rel)
        entry = {"file": rel, "recorded": digest if isinstance(digest, str) else None, "now": None}
        try:
            with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as fh:  # never a FIFO or a symlink's target
                h = hashlib.sha256()
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
                st = os.fstat(fh.fileno())
            entry.update(now="sha256=" + h.hexdigest(), bytes=st.st_size,
                         modified=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.st_mtime)))
        except FileNotFoundError:
            entry["kind"] = "gone"
        except (OSError, FileProblem) as exc:
            entry["kind"] = str(exc).split("; ")[0]
        if entry["now"] != entry["recorded"]:
            drift.append(entry)
    return drift


def op_prepare():
    os.makedirs(RELEASES, mode=0o700, exist_ok=True)
    os.chmod(ROOT, 0o700)
    base = ARGS["name"]
    name, n = base, 1
    while True:
        d = release_dir(name)
        try:
            os.mkdir(d, 0o700)
            break
        except FileExistsError:
            n += 1
            name = "%s-%d" % (base, n)
    try:
        for rel, spec in ARGS["files"].items():
            if "/" in rel or rel.startswith("."):
                fail("release file name %r" % rel)
            replace_with(os.path.join(d, rel), spec["text"], spec.get("mode", 0o600))
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)  # a failed prepare leaves no half release behind
        raise
    if ARGS.get("journal"):
        journal(dict(ARGS["journal"], release=name))
    register_dependent(ROOT)  # a patch change on this venv now asks this root's lock
    out = {"name": name, "dir": d}
    if ARGS.get("guard"):
        with guard_lock(name):
            out["guard"] = spawn_guard(name, ARGS["guard"])
    return out


def op_discard():
    """Remove a release that never ran (an aborted deploy): no orphan directories."""
    d = release_dir(ARGS["name"])
    if current_name() == ARGS["name"]:
        fail("release %s is current; not removing it" % ARGS["name"])
    if warmup_processes(d):  # a warm-up its aborted deploy left running (Ctrl-C mid pre-build): ended first
        end_warmup(d, None)
    shutil.rmtree(d, ignore_errors=True)
    return {"removed": ARGS["name"]}


def op_mark():
    path = os.path.join(release_dir(ARGS["name"]), "release.json")
    meta = read_json(path, {}) or {}
    meta.update(ARGS["fields"])
    replace_with(path, json.dumps(meta, indent=1, sort_keys=True))
    if ARGS.get("journal"):
        journal(ARGS["journal"])
    return {"ok": True}


def op_switch():
    return switch_to(ARGS["name"])


def switch_to(name):
    if not os.path.isdir(release_dir(name)):
        fail("release %s does not exist under %s" % (name, RELEASES))
    tmp = CURRENT + ".tmp-%d" % os.getpid()
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("releases", name), tmp)
    os.replace(tmp, CURRENT)  # rename(2): readers see the old or the new release, never neither
    return {"current": name}


def recorded_leader():
    """(pid, release) that server.pid names, whether or not that process still runs: the tree
    of a dead leader can still be running (a child serving the port)."""
    info = read_json(PIDFILE)
    try:
        return [(int(info["pid"]), str(info["release"]))]
    except (TypeError, ValueError, KeyError):
        return []


def server_proc(adopt=False):
    """The server servops started here, verified in /proc (see procs.our_server). `adopt`: when
    server.pid is missing or stale but a release's server leader runs (a start whose pidfile was
    never published, by an older servops killed mid-start), record it again: every server
    started is known."""
    proc = our_server(ROOT)
    if proc or not adopt or not os.path.isdir(RELEASES):
        return proc
    for pid, facts in sorted(release_processes(RELEASES).items()):
        d = os.path.join(RELEASES, facts["release"])
        if (facts["sid"] == pid and facts["pgid"] == pid and NAME_RE.fullmatch(facts["release"])
                and _link(pid, "cwd") == os.path.realpath(d)):  # (None once it exited meanwhile)
            meta = release_info(facts["release"])
            info = {"pid": pid, "pgid": pid, "starttime": facts["starttime"], "release": facts["release"],
                    "port": meta.get("port"), "started_at": now_iso(), "started_epoch": time.time(),
                    "log": os.path.join(d, "server.log"), "adopted": True}
            replace_with(PIDFILE, json.dumps(info))
            journal({"action": "server.adopted", "release": facts["release"], "pid": pid,
                     "detail": "a running server of this release had no valid server.pid; recorded it again"})
            return our_server(ROOT)
    return None


def release_tree(leaders=None):
    """Every process of every release under this deploy root (a deploy root runs one server)."""
    if not os.path.isdir(RELEASES):
        return {}
    return release_processes(RELEASES, recorded_leader() if leaders is None else leaders)


def tree_holds_port(port):
    """Is this port's listener a process of our release tree? None: nothing listens."""
    if not listener_inodes(port):
        return None
    return bool(port_holders(port, list(release_tree())))


def op_port_check():
    proc = server_proc(adopt=True)
    port = int(ARGS["port"])
    busy = port_in_use(port)
    ours = bool(proc)
    if busy and not ours:  # a leftover of one of our releases (its leader gone) is ours to stop
        tree = release_tree()
        ours = bool(port_holders(port, list(tree)))
    return {"busy": busy, "ours": ours, "server": proc}


def _signal(facts, sig):
    """Signal a process found in /proc, if it is still that very process (pid reuse)."""
    if proc_starttime(facts["pid"]) != facts["starttime"]:
        return False
    try:
        os.kill(facts["pid"], sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _shown(facts, how):
    out = {"pid": facts["pid"], "name": facts.get("name"), "release": facts.get("release"), "why": facts.get("why"),
           "signal": how}
    if facts.get("escaped"):
        out["escaped"] = True
    return out


def stop_server(grace, poll=0.25):
    """End every process of the release: SIGTERM to the server's group and to each process of its
    tree (found again on every look: children started during shutdown, setsid() escapees), the
    grace period, SIGKILL for what is left; then check that nothing remains and the port is free.
    Returns what it did, process by process."""
    proc = server_proc(adopt=True)
    leaders = [(proc["pid"], proc["release"])] if proc else recorded_leader()
    recorded = read_json(PIDFILE)
    port = (proc or (recorded if isinstance(recorded, dict) else {})).get("port")
    tree = release_tree(leaders)
    if not tree:
        if os.path.lexists(PIDFILE):
            os.unlink(PIDFILE)
        return {"stopped": False, "reason": "no server running", "processes": [], "gpu": gpu_report({})}
    seen = {}
    if proc:
        try:
            os.killpg(proc["pgid"], signal.SIGTERM)  # the server's own shutdown path first
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while tree:
        for pid, facts in tree.items():
            if pid not in seen:
                seen[pid] = facts
                _signal(facts, signal.SIGTERM)
        if time.monotonic() >= deadline:
            break
        time.sleep(poll)
        tree = release_tree(leaders)
    killed = {}
    for _ in range(40):  # SIGKILL whatever is left, until nothing of the release remains
        if not tree:
            break
        for pid, facts in tree.items():
            seen.setdefault(pid, facts)
            if _signal(facts, signal.SIGKILL):
                killed[pid] = True
        time.sleep(poll)
        tree = release_tree(leaders)
    survivors = [_shown(dict(f, state=(proc_state(p) or "?")), "survived SIGKILL") for p, f in tree.items()]
    port_free = True
    if port:
        for _ in range(int(10 / poll)):  # the listening socket can outlive its process by a moment
            port_free = not port_in_use(int(port))
            if port_free:
                break
            time.sleep(poll)
    if not survivors and os.path.lexists(PIDFILE):
        os.unlink(PIDFILE)
    shown = [_shown(f, "SIGKILL" if pid in killed else "SIGTERM") for pid, f in sorted(seen.items())]
    out = {"stopped": True, "pid": proc["pid"] if proc else None, "release": (proc or {}).get("release") or
           next((f["release"] for f in seen.values()), None), "killed": bool(killed), "processes": shown,
           "survivors": survivors, "port": port, "port_free": port_free, "gpu": gpu_report(seen)}
    if not port_free:
        out["port_holders"] = sorted(port_holders(int(port)))
    return out


def proc_state(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def gpu_report(ours):
    """On a GPU host: compute apps still holding GPU memory after the stop (a leftover of ours
    would starve the next server; another's is named so the operator knows)."""
    found = gpu_apps()
    if found is None or "error" in found:
        return found
    apps = [dict(a, name=a["name"][:80]) for a in found["apps"][:64]]
    return {"ours": [a for a in apps if a["pid"] in ours and proc_starttime(a["pid"])],
            "others": [a for a in apps if a["pid"] not in ours], "skipped": len(found["skipped"])}


def op_stop():
    if ARGS.get("restart_of"):
        # A restart onto this release is under way (stop, switch, start): the guard waits for it.
        touch_private(os.path.join(release_dir(ARGS["restart_of"]), "restarting"))
    res = stop_server(float(ARGS.get("grace", 30)))
    if res["stopped"] and ARGS.get("journal"):
        journal(dict(ARGS["journal"], release=res.get("release"), pid=res.get("pid"),
                     outcome="SIGKILL after grace" if res["killed"] else "SIGTERM",
                     processes=len(res["processes"]), survivors=len(res["survivors"])))
    if res.get("survivors") and ARGS.get("strict", True):
        names = ", ".join("%d (%s, state %s)" % (p["pid"], p["name"], p.get("state", "?")) for p in res["survivors"])
        fail("stop: process(es) of release %s survive SIGKILL: %s; the next server cannot start until they are "
             "gone (a process stuck in the kernel, e.g. a hung GPU driver call)" % (res.get("release"), names))
    return res


def become_detached_child(d, log_fd):
    """In a forked child: its own session in the release directory d, no stdin, stdout and stderr
    to log_fd (a server or a pre-build outlives the program that started it)."""
    os.setsid()
    os.chdir(d)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)


def start_server(name, port):
    """Start a release's launch script in a new session, its pid recorded BEFORE it can serve:
    the child waits on a pipe until server.pid names it, so a controller or host program killed
    at any moment leaves either no server or a recorded one."""
    if server_proc(adopt=True):
        fail("a server is still running (pid %d); stop it first" % server_proc()["pid"])
    left = release_tree()
    if left:
        fail("processes of an earlier server still run (%s); run invoke stop first"
             % ", ".join("%d %s" % (p, f.get("name")) for p, f in sorted(left.items())[:5]))
    verify_patches(name)
    d = release_dir(name)
    log_path = os.path.join(d, "server.log")
    log_fd = own_file(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    env = dict(os.environ, **{RELEASE_ENV: d})
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server-to-be: its own session, output to the log, exec only on "go"
        try:
            os.close(go_w)
            become_detached_child(d, log_fd)
            os.closerange(3, go_r)
            os.closerange(go_r + 1, 1 << 16)
            if os.read(go_r, 1) != b"1":
                os._exit(0)  # the parent died before recording us: never serve untracked
            os.close(go_r)
            os.execvpe("bash", ["bash", os.path.join(d, "launch.sh")], env)
        finally:
            os._exit(127)
    os.close(go_r)
    # where this run's output starts in the (appended) log: a gate reads from there, never an
    # earlier run's lines (vLLM logs EngineDeadError when it is stopped)
    log_offset = os.fstat(log_fd).st_size
    os.close(log_fd)
    info = {"pid": pid, "pgid": pid, "starttime": proc_starttime(pid), "release": name,
            "port": port, "started_at": now_iso(), "started_epoch": time.time(), "log": log_path,
            "log_offset": log_offset}
    try:
        fault("start:forked")
        replace_with(PIDFILE, json.dumps(info))
        fault("start:recorded")
        os.write(go_w, b"1")
    finally:
        os.close(go_w)
    return info


def verify_patches(name):
    """The release's patch set is what the venv holds (files as the patches left them), before
    its server starts: a patch reverted under a live release would crash its next restart."""
    meta = release_info(name)
    wanted = meta.get("patches") or []
    if not isinstance(wanted, list):
        fail("release %s: its release.json names no patch list" % name)
    state = load_patch_state()
    applied = state["applied"]
    missing = [p for p in wanted if p not in applied]
    changed = []
    for p in wanted:
        rec = applied.get(p)
        if rec:
            site = (find_dist(rec.get("dist") or "") or {}).get("site")
            if site and any(sha256_hex(os.path.join(site, rel)) != h.get("after")
                            for rel, h in (rec.get("files") or {}).items()):
                changed.append(p)
    if missing or changed:
        what = "; ".join(x for x in (
            ("not applied: " + ", ".join(missing)) if missing else "",
            ("files changed since applied: " + ", ".join(changed)) if changed else "") if x)
        fail("release %s needs patches %s in %s, but %s; `invoke patch.status` shows the venv, a deploy or "
             "rollback restores the set" % (name, ", ".join(wanted) or "none", sys.prefix, what))
    return True


def op_verify_patches():
    return {"ok": verify_patches(ARGS["name"])}


def op_start():
    info = start_server(ARGS["name"], ARGS.get("port"))
    marker = os.path.join(release_dir(ARGS["name"]), "restarting")
    if os.path.lexists(marker):
        os.unlink(marker)
    return {"server": info}


def touch_private(path):
    fd = own_file(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


# ---- the health gate --------------------------------------------------------------------------

def http_get(port, path, timeout=2.0):
    """(status, body) of a GET on the server; (None, error) when nothing answers."""
    try:
        with local_urlopen("http://127.0.0.1:%d%s" % (port, path), timeout) as r:
            return r.status, r.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except Exception as exc:
        return None, str(exc)


def http_ok(port, path, timeout=2.0):
    return http_get(port, path, timeout)[0] == 200


def first_request(port, path, timeout=120.0):
    """(status, body) of one 1-token completion, the model the server lists at /v1/models."""
    model = None
    status, body = http_get(port, "/v1/models")
    if status == 200:
        try:
            model = json.loads(body)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            model = None
    payload = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
    if model:
        payload["model"] = model
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with local_urlopen(req, timeout) as r:
            return r.status, r.read(4096).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        try:
            text = exc.read(4096).decode("utf-8", "replace")
        except Exception:
            text = ""
        return exc.code, text
    except Exception as exc:
        return None, str(exc)


def info_ok(port, paths):
    """The model info endpoint, newest spelling first (/model_info; /get_model_info before 0.5.x)."""
    for path in paths:
        status, _ = http_get(port, path)
        if status == 200:
            return path
    return None


class _Overran(Exception):
    pass


def _overran(signum, frame):
    raise _Overran()


class LogWatch:
    """Follows a server log: new lines, crash signatures, and the excerpt around a hit."""

    # Bounds for a 20-minute load that logs without pause: what is read per poll, what is kept
    # (excerpts need only the recent lines), how much of a line a signature sees, and how long
    # the signatures may take on one poll (a pathological regex must not pin the gate).
    READ_CHUNK = 8 << 20
    KEEP_LINES = 20000
    # what of a line is kept (signatures see MATCH_CHARS, startlog 4 KiB, an excerpt a screen) and
    # of all lines together: a server flooding 8 MB lines held gigabytes in the gate before
    KEEP_LINE_CHARS = 16384
    KEEP_CHARS = 32 << 20
    MATCH_CHARS = 8192
    MATCH_BUDGET_S = 2.0

    def __init__(self, path, signatures):
        self.path, self.pos, self.partial, self.lines = path, 0, "", []
        self.kept_chars = 0
        self.fatal = [re.compile(p) for p in signatures]
        self.dropped = []  # signatures that overran the budget: no longer searched

    def poll(self):
        """Read what was appended; returns (signature, line index) of the first crash hit, or None."""
        try:
            with os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as fh:
                fh.seek(self.pos)
                chunk = fh.read(self.READ_CHUNK)
        except OSError:
            return None
        self.pos += len(chunk)
        if not chunk:
            return None
        text = self.partial + chunk.decode("utf-8", "replace")
        new = text.split("\n")
        self.partial = new.pop()
        if len(self.partial) > self.READ_CHUNK:  # a line without end (a progress bar's CRs)
            new.append(self.partial)
            self.partial = ""
        self._keep(new)
        return self._search(new, len(self.lines) - len(new))

    def _keep(self, new):
        """Append `new` (each line cut at KEEP_LINE_CHARS, in place); past either bound (lines or
        characters) the oldest lines go, down to half of it."""
        new[:] = [line[:self.KEEP_LINE_CHARS] for line in new]
        self.kept_chars += sum(len(line) for line in new)
        if len(self.lines) + len(new) > self.KEEP_LINES or self.kept_chars > self.KEEP_CHARS:
            first = max(0, len(self.lines) + len(new) - self.KEEP_LINES // 2) \
                if len(self.lines) + len(new) > self.KEEP_LINES else 0  # the oldest line kept
            self.kept_chars -= sum(len(line) for line in self.lines[:first])
            while first < len(self.lines) and self.kept_chars > self.KEEP_CHARS // 2:
                self.kept_chars -= len(self.lines[first])
                first += 1
            del self.lines[:first]
        self.lines.extend(new)

    def _search(self, new, base):
        timed = threading.current_thread() is threading.main_thread()
        if timed:
            previous = signal.signal(signal.SIGALRM, _overran)
        try:
            for rx in list(self.fatal):
                if timed:
                    signal.setitimer(signal.ITIMER_REAL, self.MATCH_BUDGET_S)
                try:
                    for i, line in enumerate(new):
                        if rx.search(line[:self.MATCH_CHARS]):
                            return rx.pattern, base + i
                except _Overran:
                    self.fatal.remove(rx)
                    self.dropped.append(rx.pattern)
                finally:
                    if timed:
                        signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            if timed:
                signal.signal(signal.SIGALRM, previous)
        return None

    def settle(self):
        """Let a traceback finish writing, then take the rest."""
        time.sleep(0.3)
        self.poll()
        if self.partial:
            self._keep([self.partial])
            self.partial = ""

    # A failure line a server logs above its traceback ("Piecewise CUDA Graph failed with error:
    # ..."), and a line that starts the server's next log record (the end of a traceback).
    LEAD = re.compile(r"(?i)\bfailed\b.*:|\berror: ")
    RECORD = re.compile(r"^\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d")
    SCAN = 2000

    def excerpt(self, hit=None, before=12, after=30, limit=80):
        """Bounded (`limit` lines): the failure around a signature's line `hit`: from its Traceback
        header (and a failure line just above it) to the end of that traceback -- the last frames,
        the exception line and what follows it -- with the middle cut when it is longer. Without a
        traceback around the hit: the hit with context. Without a hit: the last traceback, else the tail."""
        lines = self.lines
        headers = [i for i, l in enumerate(lines) if "Traceback (most recent call last)" in l]
        if hit is None:
            if not headers:
                return lines[-25:]
            hit = headers[-1]
        above = [i for i in headers if hit - self.SCAN < i <= hit]
        if above and self._end(above[-1]) > hit:  # the hit is in the traceback that opens above it
            header = above[-1]
        else:  # or it is a failure line the server logs just before its traceback
            header = next((i for i in headers if hit < i <= hit + after), None)
        if header is None:
            return lines[max(0, hit - before):min(len(lines), hit + after + 1)][:limit]
        start = min(hit, header)
        if start == header:  # the failure line a server logs above its traceback, and the hints between
            start = next((i for i in range(header - 1, max(-1, header - 8), -1) if self.LEAD.search(lines[i])), header)
        end = max(self._end(header), hit + 1)
        while end > hit + 1 and not lines[end - 1].strip():
            end -= 1
        if end - start <= limit:
            return lines[start:end]
        # the opening (failure line, header, first frame), the hit and the exception after it, the end
        keep = set(range(start, min(header + 3, end))) | set(range(max(start, hit - 1), min(hit + 6, end)))
        keep |= set(range(max(start, end - max(limit - len(keep) - 2, 1)), end))
        out, last = [], start - 1
        for i in sorted(keep):
            if i > last + 1:
                out.append("    ... (%d lines) ..." % (i - last - 1))
            out.append(lines[i])
            last = i
        return out

    def _end(self, header):
        """The line after the traceback that opens at `header`: the server's next log record."""
        end = header + 1
        while end < min(len(self.lines), header + self.SCAN) and not self.RECORD.match(self.lines[end]):
            end += 1
        return end

    def last_line(self):
        for line in reversed(self.lines + ([self.partial] if self.partial else [])):
            if line.strip():
                return line
        return ""


def gate(name, port, health, signatures, deadline_s, progress=None, stop_when=None):
    """Wait until the release answers its health endpoints, dies, logs a crash signature or runs
    out of time. Returns the outcome dict."""
    log = LogWatch(os.path.join(release_dir(name), "server.log"), signatures)
    proc = server_proc() or {}
    offset = proc.get("log_offset")
    if proc.get("release") == name and isinstance(offset, int) and not isinstance(offset, bool) and offset > 0:
        log.pos = offset  # this run's lines only (a release started again appends to its log)
    mask = masker(name)
    started = time.monotonic()
    endpoint = health.get("endpoint", "/health")
    # The model-info check prefers today's /model_info and falls back to the deprecated
    # /get_model_info of older releases; `model_info: null` turns it off.
    preferred = health.get("model_info", "/model_info")
    info_paths = [] if preferred is None else list(dict.fromkeys([preferred, "/model_info", "/get_model_info"]))
    interval = float(health.get("interval", 2))
    last_progress = 0

    def result(state, reason, ex=None):
        out = {"state": state, "reason": reason, "elapsed": round(time.monotonic() - started, 2),
               "excerpt": [mask(l) for l in (ex or [])], "log": log.path}
        if log.dropped:
            out["slow_signatures"] = log.dropped
        return out

    while True:
        hit = log.poll()
        if hit:
            log.settle()
            line = mask(log.lines[hit[1]].strip())
            return result("crashed", "server.log: %s" % (line if len(line) <= 200 else line[:197] + "..."),
                          log.excerpt(hit[1]))
        if (server_proc() or {}).get("release") != name:
            log.settle()
            tb = any("Traceback (most recent call last)" in l for l in log.lines)
            return result("crashed", "server exited" + (" after a Traceback" if tb else " during startup"),
                          log.excerpt())
        if http_ok(port, endpoint):
            used = info_ok(port, info_paths) if info_paths else ""
            if used is not None:
                # A 200 counts only from this release's own process group: a stray server on
                # the port would otherwise pass for the new release.
                if tree_holds_port(port) is False:
                    log.settle()
                    return result("crashed", "port %d answered, but another process holds it, not this release's "
                                             "server" % port, log.lines[-25:])
                first = health.get("first_request")
                if first:  # a server that dies at its first request (vLLM's CPU attention) fails here
                    status, body = first_request(port, first)
                    if status != 200:
                        time.sleep(1.0)
                        hit = log.poll()
                        log.settle()
                        what = "HTTP %s" % status if status else "no answer (%s)" % body[:200]
                        return result("crashed", "first request to %s: %s%s" % (
                            first, what, (": " + mask(body.strip())[:200]) if status and body.strip() else ""),
                            log.excerpt(hit[1] if hit else None))
                    used = (used + ", " if used else "") + "a 1-token request to " + first
                out = result("healthy", "%s answered 200%s" % (endpoint, (" and " + used) if used else ""))
                log.poll()
                out["start"] = start_phases(log.lines + [log.partial], out["elapsed"])  # its phases (startlog)
                return out
        elapsed = time.monotonic() - started
        if elapsed > deadline_s:
            return result("timeout", "not healthy after %ds" % deadline_s, log.lines[-25:])
        if stop_when and stop_when():
            return result("abandoned", "stood down")
        if progress and time.monotonic() - last_progress >= interval:
            last_progress = time.monotonic()
            progress({"progress": round(elapsed, 1), "log": mask(log.last_line())[-400:]})
        time.sleep(min(interval, 0.5))


def op_health():
    """The gate; healthy, also the earlier starts this one is judged against (`compare`: the
    release itself, then the one it replaces: the first with recorded starts) and, with
    `caches`, the cache ledger updated with what this start built (cache_ledger)."""
    def progress(p):
        sys.stdout.write(json.dumps(p) + "\n")
        sys.stdout.flush()
    out = gate(ARGS["name"], int(ARGS["port"]), ARGS.get("health") or {}, ARGS.get("signatures", []),
               float(ARGS["timeout"]), progress)
    if out["state"] == "healthy":
        for name in ARGS.get("compare") or []:
            starts = release_info(name).get("starts") if NAME_RE.fullmatch(str(name or "")) else None
            if isinstance(starts, list) and starts:
                out["before"] = {"release": name, "starts": starts[-10:]}
                break
        if ARGS.get("caches"):
            note_jit_builds(ARGS["caches"], out.get("start") or {}, out.get("elapsed"))
            problem = record_built(ARGS["caches"], out.get("start") or {}, ARGS["name"])
            if problem:
                out["cache_problem"] = problem
    return out


WARMUP_ENV = "SERVOPS_WARMUP_DIR"  # marks every process of a release's warm-up (never its server's tree)


def warmup_processes(d):
    """pid -> facts of the warm-up processes of release directory `d` (its mark in their env)."""
    return {pid: f for pid, f in process_table().items() if environ_value(pid, WARMUP_ENV) == d}


def end_warmup(d, pgid, grace=10.0, poll=0.25):
    """SIGTERM to the warm-up's group and every process carrying its mark, the grace, SIGKILL;
    returns how many were ended and whether any survived."""
    try:
        if pgid is not None and pgid > 1:  # (None: no group known; every marked process is still found)
            os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    seen, deadline, sig = {}, time.monotonic() + grace, signal.SIGTERM
    for _ in range(int((grace + 10) / poll)):
        left = warmup_processes(d)
        if not left:
            break
        if time.monotonic() >= deadline:
            sig = signal.SIGKILL
        for pid, facts in left.items():
            seen[pid] = True
            _signal(facts, sig)
        time.sleep(poll)
    return {"ended": len(seen), "survivors": sorted(warmup_processes(d))}


WARMUP_OWNER = "warmup.owner"  # "<pid> <start time> <pgid>" of the program running a release's warm-up


def orphan_warmups():
    """Warm-ups whose program died before it ended them (SIGKILL, the SIGHUP of a dropped SSH
    session: its `finally` never ran), ended by the next command on the host, whatever its verb:
    a warm-up server left beside the serving one holds its GPU memory and port for good."""
    ended = []
    try:
        names = sorted(os.listdir(RELEASES))
    except OSError:
        return ended
    for name in names:
        d = os.path.join(RELEASES, name)
        owner = os.path.join(d, WARMUP_OWNER)
        try:
            fd = os.open(owner, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            words = os.read(fd, 200).decode("ascii", "replace").split()
        finally:
            os.close(fd)
        try:
            pid, start, pgid = int(words[0]), words[1], int(words[2])
        except (IndexError, ValueError):
            pid, start, pgid = 0, "", 0
        if pid and proc_starttime(pid) == start:
            continue  # its warm-up still runs, watched
        end_warmup(d, pgid)
        os.unlink(owner)
        ended.append(name)
    return ended


def op_warmup():
    """Before the old server stops: the new release's server started beside it (its own script,
    warmup.sh: the launch on a spare port with the same cache directories) until it answers
    healthy -- its JIT builds, compiles and its own warm-up request done -- then ended, so the
    restart finds its kernels built. sglang's own compile_deep_gemm builds DeepGEMM's the same
    way (a server launched with the serving args, one request, then killed). Never touches the
    serving server, `current` or server.pid; its processes carry WARMUP_ENV, and every one is
    ended before this returns. Its log: warmup.log in the release."""
    name, port = ARGS["name"], int(ARGS["port"])
    d = release_dir(name)
    if not os.path.isdir(d):
        fail("release %s does not exist" % name)
    if port_in_use(port):
        return {"state": "skipped", "reason": "warm-up port %d is in use" % port}
    script = os.path.join(d, "warmup.sh")
    if os.path.islink(script):
        os.unlink(script)
    replace_with(script, ARGS["script"], mode=0o700)
    log_path = os.path.join(d, "warmup.log")
    log_fd = own_file(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    env = dict(os.environ, **{WARMUP_ENV: d})
    env.pop(RELEASE_ENV, None)
    pid = os.fork()
    if pid == 0:
        try:
            become_detached_child(d, log_fd)
            os.closerange(3, 1 << 16)
            os.execvpe("bash", ["bash", script], env)
        finally:
            os._exit(127)
    os.close(log_fd)
    owner = os.path.join(d, WARMUP_OWNER)
    replace_with(owner, "%d %s %d\n" % (os.getpid(), proc_starttime(os.getpid()), pid), mode=0o600)
    health = ARGS.get("health") or {}
    endpoint, timeout = health.get("endpoint", "/health"), float(ARGS.get("timeout") or 1200)
    watch = LogWatch(log_path, ARGS.get("signatures") or [])
    started, last = time.monotonic(), 0.0
    state, reason = "timeout", "not healthy after %ds" % timeout
    try:
        while True:
            hit = watch.poll()
            elapsed = time.monotonic() - started
            if hit:
                state, reason = "crashed", "warmup.log: %s" % watch.lines[hit[1]].strip()[:200]
                break
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                state, reason = "crashed", "the warm-up server exited (status %d) before it was healthy" % status
                break
            if http_ok(port, endpoint):
                state, reason = "healthy", "%s answered 200 on port %d" % (endpoint, port)
                break
            if elapsed > timeout:
                break
            if time.monotonic() - last >= float(health.get("interval", 2)):
                last = time.monotonic()
                sys.stdout.write(json.dumps({"progress": round(elapsed, 1), "log": watch.last_line()[-400:]}) + "\n")
                sys.stdout.flush()
            time.sleep(0.25)
    finally:
        elapsed = round(time.monotonic() - started, 2)
        ended = end_warmup(d, pid)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        if os.path.lexists(owner):
            os.unlink(owner)
    watch.poll()
    out = {"state": state, "reason": reason, "elapsed": elapsed, "log": log_path, "ended": ended,
           "start": start_phases(watch.lines + [watch.partial], elapsed if state == "healthy" else None)}
    if state != "healthy":
        out["excerpt"] = watch.excerpt()[-25:]
    elif ARGS.get("caches"):
        note_jit_builds(ARGS["caches"], out["start"], elapsed)
        problem = record_built(ARGS["caches"], out["start"], name)
        if problem:
            out["cache_problem"] = problem
    return out


def op_status():
    cur = current_name()
    proc = server_proc(adopt=True)
    out = {"root": ROOT, "current": cur, "release": release_info(cur) if cur else None, "server": proc,
           "healthy": None, "now": time.time(), "server_info": None, "unfinished": UNFINISHED}
    if proc and proc.get("port"):
        port = int(proc["port"])
        out["healthy"] = http_ok(port, ARGS.get("endpoint", "/health"))
        for path in ("/server_info", "/get_server_info"):  # newest spelling first
            status, body = http_get(port, path)
            if status == 200:
                try:
                    info = json.loads(body)
                except ValueError:
                    break
                mask = masker(proc.get("release"))
                out["server_info"] = {"version": info.get("version"),
                                      "launch_command": mask(str(info.get("launch_command") or "")) or None}
                break
    return out


def op_logs():
    name = ARGS.get("name") or current_name()
    if not name:
        fail("no release deployed under %s" % ROOT)
    path = os.path.join(release_dir(name), "server.log")
    if not os.path.exists(path):
        fail("release %s has no server.log" % name)
    if not os.path.isfile(path) or os.path.islink(path):
        fail("release %s: server.log is not a plain file (a symlink?); not reading it" % name)
    mask = masker(name)
    n = int(ARGS.get("lines", 100))
    return {"name": name, "path": path, "lines": [mask(l) for l in tail_lines(path, n)]}


LOG_TAIL_BYTES = 32 << 20   # what `logs` reads from the end of a server.log, at most
LOG_LINE_CHARS = 16 << 10   # one line as shown, at most


def tail_lines(path, n, max_bytes=LOG_TAIL_BYTES, max_line=LOG_LINE_CHARS):
    """The last `n` lines of a log of any size (weeks of a server, or one a hostile process
    flooded), read backwards in blocks: at most `max_bytes` read, each line cut at `max_line`."""
    if n <= 0:
        return []
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        end = pos = fh.tell()
        chunks, newlines = [], 0
        while pos > 0 and newlines <= n and end - pos < max_bytes:
            step = min(1 << 20, pos, max_bytes - (end - pos))
            pos -= step
            fh.seek(pos)
            chunk = fh.read(step)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
    lines = b"".join(reversed(chunks)).decode("utf-8", "replace").splitlines()
    if pos > 0 and lines:
        lines = lines[1:]  # the first line read is cut at its start
    return [l if len(l) <= max_line else l[:max_line] + " ... [%d more characters]" % (len(l) - max_line)
            for l in lines[-n:]]


def op_follow():
    """tail -F, with the release's secrets masked before a line leaves the host."""
    name = ARGS["name"]
    path = os.path.join(release_dir(name), "server.log")
    mask = masker(name)
    pos = os.path.getsize(path) if os.path.exists(path) else 0
    partial = ""
    parent = os.getppid()
    reader = select.poll()
    reader.register(sys.stdout.fileno(), 0)  # reports only POLLERR/POLLHUP: our stdout's reader is gone
    # The SSH session ended, or just our channel closed (Ctrl-C; a connection agent's client
    # went): nobody reads us any more.
    while os.getppid() == parent and not reader.poll(0):

        try:
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as fh:
                if os.fstat(fh.fileno()).st_size < pos:
                    pos = 0  # truncated
                fh.seek(pos)
                chunk = fh.read()
                pos += len(chunk)
        except OSError:
            chunk = b""
        if chunk:
            text = partial + chunk.decode("utf-8", "replace")
            lines = text.split("\n")
            partial = lines.pop()
            if lines:
                sys.stdout.write("".join(mask(l) + "\n" for l in lines))
                sys.stdout.flush()
        time.sleep(0.2)
    return {}


def pins_damaged():
    """Why pins.json cannot be read (torn, not an object, a symlink...), or None: intact or absent.
    A damaged pin file must never read as "no pins": the next prune would remove a pinned release."""
    if not os.path.lexists(PINS):
        return None
    pins = read_json(PINS, None)
    if not isinstance(pins, dict) or not all(isinstance(v, list) for v in pins.values()):
        return "%s is damaged (cut short, not a JSON object, or not a regular file)" % PINS
    return None


def read_pins():
    """release name -> the reasons it is pinned (by hand, or by a campaign); {} when damaged
    (callers that remove or rewrite check pins_damaged() first)."""
    pins = read_json(PINS, {})
    if not isinstance(pins, dict):
        return {}
    return {k: [str(r) for r in v] for k, v in pins.items() if NAME_RE.fullmatch(str(k)) and isinstance(v, list)}


def op_pin():
    """Pin (or with `unpin`, unpin) a release: a pinned release is never pruned. `why` names the
    reason; unpinning with a reason drops only that reason, without one every reason."""
    name = ARGS["name"]
    damaged = pins_damaged()
    if damaged:  # rewriting it would drop every pin it held
        fail("%s: fix it or remove it, then pin again" % damaged)
    pins = read_pins()
    reasons = pins.get(name, [])
    why = ARGS.get("why")
    if ARGS.get("unpin"):
        reasons = [r for r in reasons if why and r != why]
    else:
        if not os.path.isdir(release_dir(name)):
            fail("no release %s under %s (see invoke releases)" % (name, RELEASES))
        if (why or "pinned by hand") not in reasons:
            reasons.append(why or "pinned by hand")
    if reasons:
        pins[name] = reasons
    else:
        pins.pop(name, None)
    replace_with(PINS, json.dumps(pins, indent=1, sort_keys=True))
    return {"pins": pins}


def protected():
    """Releases prune never removes: the current one, the previous healthy one (what a rollback
    goes to), and every pinned one."""
    rels = list_releases()
    cur = current_name()
    names = [r["name"] for r in rels]
    upto = names.index(cur) if cur in names else len(names)
    previous = next((r["name"] for r in reversed(rels[:upto]) if r.get("status") == "healthy"), None)
    return {n: why for n, why in [(cur, ["current"]), (previous, ["previous healthy"])] if n} | {
        n: why for n, why in read_pins().items()}


def op_prune():
    keep = int(ARGS["keep"])
    damaged = pins_damaged()
    if damaged:  # prune nothing rather than a pinned release
        return {"removed": [], "skipped": "%s: no release pruned until it is fixed or removed" % damaged}
    protect = set(protected()) | {ARGS.get("protect")}
    names = [r["name"] for r in list_releases()]
    removed = []
    for name in names[:-keep] if keep > 0 else []:
        if name in protect:
            continue
        shutil.rmtree(os.path.join(RELEASES, name), ignore_errors=True)
        removed.append(name)
    return {"removed": removed}


def op_identity():
    """sha256 of a release's launch files (launch.sh, secrets.env, the server files) and whether
    its server runs and answers: what `deploy` compares to skip a pointless restart."""
    require_regular(JOURNAL)  # an unchanged deploy writes nothing, but a broken root is still named
    return release_identity(ARGS.get("name") or current_name(), ARGS.get("files") or [])


def release_identity(name, files, script=False):
    """A release's identity (see op_identity); `script`: its launch.sh text too (a --diff)."""
    if not name or not os.path.isdir(os.path.join(RELEASES, name)):
        return {"name": None}
    d = release_dir(name)
    hashes = {}
    for rel in files:
        if "/" in rel or rel.startswith("."):
            fail("release file name %r" % rel)
        hashes[rel] = sha256_hex(os.path.join(d, rel)) if os.path.isfile(os.path.join(d, rel)) else None
    meta = release_info(name)
    proc = server_proc(adopt=True)
    running = bool(proc and proc.get("release") == name)
    health = meta.get("health") if isinstance(meta.get("health"), dict) else {}
    healthy = running and http_ok(int(proc.get("port") or meta.get("port") or 0), health.get("endpoint", "/health"))
    out = {"name": name, "files": hashes, "status": meta.get("status"), "patches": meta.get("patches"),
           "health": health, "running": running, "healthy": bool(healthy)}
    if script:
        path = os.path.join(d, "launch.sh")
        try:
            with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as fh:
                out["launch_sh"] = fh.read(4 << 20).decode("utf-8", "replace")
        except (OSError, FileProblem):
            out["launch_sh"] = None
    return out


def op_rearm():
    """A restart of an existing release is watched like a deploy: its status says so, the old
    decision and disarm marker go, and a fresh guard (this restart's spec) watches the lease."""
    name = ARGS["name"]
    d = release_dir(name)
    for marker in ("decision", "guard.disarm"):
        if os.path.lexists(os.path.join(d, marker)):
            os.unlink(os.path.join(d, marker))
    replace_with(os.path.join(d, "lease"), "0\n")
    before = release_info(name).get("status")
    write_fields(name, {"status": "restarting", "status_before": before})
    if ARGS.get("journal"):
        journal(ARGS["journal"])
    with guard_lock(name):
        return {"guard": spawn_guard(name, ARGS["guard"])}


def op_journal():
    if ARGS.get("entry"):
        journal(ARGS["entry"])
        return {"ok": True}
    entries, report = read_entries(JOURNAL, journal_entry_problem)
    n = int(ARGS.get("last") or 0)
    return {"path": JOURNAL, "entries": entries[-n:] if n else entries, "report": report,
            "problems": describe(report)}


def journal_entry_problem(entry):
    """Why a journal line is not an entry servops wrote (None when it is)."""
    if not isinstance(entry.get("action"), str) or not isinstance(entry.get("at"), str):
        return "no action/at text"
    for key, value in entry.items():
        if not isinstance(value, (str, int, float, bool, type(None), list, dict)):
            return "field %s of the wrong type" % key
        if isinstance(value, (list, dict)) and len(json.dumps(value)) > 65536:
            return "field %s too large" % key
    return None


# ---- the guard: auto-rollback that survives the controller ----------------------------------
#
# Armed with the new release, before any patch. While the controller bumps the lease counter,
# the guard only watches. The lease is judged on the guard's own monotonic clock: a wall-clock
# step (NTP, a VM resumed) neither disarms it nor makes it act. If the counter stops moving for
# lease_timeout (controller killed, laptop closed, SSH dropped), the guard finishes the deploy
# itself: a healthy server stays (marked "unconfirmed": the deploy's later gates never ran); a
# dead, crashed or never-healthy one is rolled back to the previous release, patches included,
# and the journal says why. Whoever acts on a release first, controller or guard, takes its
# `decision` token; the other stands down (and the controller reports what the guard did). A
# guard that dies is started again by the next servops command on the host, from guard.json.

GUARD_FILES = ("guard.json", "guard.pid", "lease", "decision")


def guard_path(name, what):
    return os.path.join(release_dir(name), what)


def guard_status(name):
    return release_info(name).get("status")


def read_lease(path):
    """The lease counter the controller bumps (its text); None when unreadable."""
    try:
        data = read_regular(path)
    except (OSError, FileProblem):
        return None
    return None if data is None else data[:64]


def decision(name):
    held = read_json(guard_path(name, "decision"))
    return held if isinstance(held, dict) else None


def claim(name, who, take_over=False):
    """Take the release's decision token: (True, ours) or (False, the holder's). `take_over`
    replaces a holder that is gone (a dead guard, a controller whose lease ran out)."""
    path = guard_path(name, "decision")
    who = dict(who, at=now_iso())
    tmp = path + ".new-%d" % os.getpid()
    replace_with(tmp, json.dumps(who))
    try:
        if take_over:
            os.replace(tmp, path)
            return True, who
        try:
            os.link(tmp, path)
            return True, who
        except FileExistsError:
            held = decision(name) or {}
            return held.get("id") == who["id"], held
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def op_claim():
    """The controller takes the decision on its release before it marks it or rolls it back."""
    ok, held = claim(ARGS["name"], {"by": "controller", "id": ARGS["id"], "action": ARGS["action"],
                                    "who": ARGS.get("who")})
    if not ok:
        fail("GUARD-TOOK-OVER: the host's guard took over %s at %s (%s); servops stands down: see invoke "
             "status and invoke history" % (ARGS["name"], held.get("at"), held.get("action") or "acting"))
    return {"claimed": True}


def op_owns():
    """A step of the controller's restart goes ahead only while the release is still its own."""
    held = decision(ARGS["name"])
    if held and held.get("id") != ARGS["id"]:
        fail("GUARD-TOOK-OVER: the host's guard took over %s at %s (%s); servops stands down: see invoke "
             "status and invoke history" % (ARGS["name"], held.get("at"), held.get("action") or "acting"))
    return {"owns": True}


def guard_alive(name):
    rec = read_json(guard_path(name, "guard.pid"))
    if not isinstance(rec, dict):
        return False
    try:
        return proc_starttime(int(rec["pid"])) == rec.get("starttime") is not None
    except (KeyError, TypeError, ValueError):
        return False


def spawn_guard(name, spec, resumed=False):
    d = release_dir(name)
    if not os.path.lexists(os.path.join(d, "lease")):
        replace_with(os.path.join(d, "lease"), "0\n")
    replace_with(os.path.join(d, "guard.json"), json.dumps(spec))
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        guard_pid = int(os.read(r, 32) or b"0")
        os.close(r)
        os.waitpid(pid, 0)
        record = {"pid": guard_pid, "starttime": proc_starttime(guard_pid)}
        replace_with(os.path.join(d, "guard.pid"), json.dumps(record))
        return dict(record, lease=os.path.join(d, "lease"))
    # First child: new session, fork again so the guard is reparented and outlives this SSH channel.
    os.close(r)
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.write(w, str(os.getpid()).encode())
    # nothing inherited stays open: the SSH channel, the guard.lock flock
    os.closerange(3, 1 << 16)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if spec.get("_clock_step"):
        # test hook: the guard's wall clock stepped (NTP, a resumed VM); it must not care
        wall, step = time.time, float(spec["_clock_step"])
        time.time = lambda: wall() + step
    try:
        run_guard(name, spec, resumed)
    except BaseException as exc:  # the guard must never die silently
        try:
            what = LAST_FAILURE[0] if isinstance(exc, SystemExit) and LAST_FAILURE else "%s: %s" % (
                type(exc).__name__, exc)
            journal({"action": "guard.error", "release": name, "detail": what})
        except Exception:
            pass
    os._exit(0)


def run_guard(name, spec, resumed=False):
    started = time.monotonic()
    lease_timeout = float(spec["lease_timeout"])
    d = release_dir(name)
    disarm = os.path.join(d, "guard.disarm")
    lease = os.path.join(d, "lease")
    previous = (spec.get("previous") or {}).get("name")
    me = {"by": "guard", "id": "guard-%d" % os.getpid(), "pid": os.getpid(), "starttime": proc_starttime(os.getpid())}

    def concluded():
        held = decision(name) or {}
        return (os.path.lexists(disarm) or held.get("by") == "op"
                or (held.get("by") == "controller" and guard_status(name) == "healthy")
                or (not held and guard_status(name) not in IN_FLIGHT)
                or current_name() not in (name, previous))  # armed before the switch: previous until then

    seen, changed_at = read_lease(lease), time.monotonic()
    while True:
        if concluded():
            return
        value = read_lease(lease)
        if value != seen:
            seen, changed_at = value, time.monotonic()
        idle = time.monotonic() - changed_at
        if idle > lease_timeout:
            break
        time.sleep(min(1.0, lease_timeout / 4))
    held = decision(name)
    if held and held.get("by") == "guard" and held.get("id") != me["id"] and \
            proc_starttime(held.get("pid") or 0) == held.get("starttime") is not None:
        return  # another guard acts (never two)
    action = "finishing the deploy" if not held else "finishing %s's %s" % (held.get("by"), held.get("action"))
    ok, held = claim(name, dict(me, action=action), take_over=bool(held))
    if not ok:
        return  # the controller decided first
    journal({"action": "guard.takeover", "release": name, "who": "guard on host",
             "detail": "controller's lease has not moved for %ds (host monotonic clock)%s; %s"
             % (int(idle), " (guard restarted)" if resumed else "", action)})
    if guard_status(name) in ("failed", "interrupted"):  # the controller was rolling it back
        guard_rollback(name, spec, {"state": guard_status(name), "reason": "the controller's rollback did not finish"})
        return
    # A restart the controller began is finished by the host program: wait for it.
    marker = os.path.join(d, "restarting")
    limit = time.monotonic() + float(spec.get("stop_grace", 30)) + 120
    while os.path.lexists(marker) and time.monotonic() < limit:
        time.sleep(1)
    if current_name() != name:
        if previous and not server_proc(adopt=True):  # stopped, never switched: bring the old one back
            guard_rollback(name, spec, {"state": "interrupted", "reason": "the restart onto it did not finish"})
            return
        # The controller died before the restart: the old release (if any) still stands; only
        # the patches it had applied for this release are undone.
        problems = undo_patches(spec)
        serving = server_proc()
        write_fields(name, {"status": "interrupted", "failure": "controller lost before the restart"})
        journal({"action": "guard.keep", "release": previous, "outcome": "nothing restarted",
                 "detail": "controller lost before the restart onto %s; %s; its patches undone%s"
                 % (name, "the previous release still serving" if serving else "no server was running",
                    ("; " + "; ".join(problems)) if problems else "")})
        return
    remaining = max(5.0, float(spec["health_timeout"]) - (time.monotonic() - started))
    outcome = gate(name, int(spec["port"]), spec.get("health") or {}, spec.get("signatures") or [], remaining,
                   stop_when=lambda: os.path.lexists(disarm))
    if outcome["state"] == "abandoned":
        return
    if outcome["state"] == "healthy":
        write_fields(name, {"status": "unconfirmed", "guard": "controller lost; server healthy, left running; "
                            "the deploy's later gates did not run"})
        journal({"action": "guard.keep", "release": name, "outcome": "unconfirmed",
                 "detail": "controller lost; release healthy (%s); left running" % outcome["reason"]})
        return
    guard_rollback(name, spec, outcome)


def unfinished_deploys():
    """Releases whose deploy never finished: still deploying (or mid-rollback by its controller)
    with no disarm. A dead guard is started again from its guard.json, under the release's
    guard.pid lock (never two guards); returns what the caller should report."""
    out = []
    for rel in list_releases():
        name = rel["name"]
        d = os.path.join(RELEASES, name)
        held = decision(name) or {}
        mid_rollback = held.get("by") in ("controller", "guard") and rel.get("status") in ("failed", "interrupted")
        if os.path.lexists(os.path.join(d, "guard.disarm")) or held.get("by") == "op":
            continue
        if rel.get("status") not in IN_FLIGHT and not mid_rollback:
            continue
        spec = read_json(os.path.join(d, "guard.json"))
        if not isinstance(spec, dict):
            continue  # armed by an older servops: the lock op marks it interrupted
        with guard_lock(name):
            if guard_alive(name):
                out.append({"release": name, "guard": "watching", "detail": "deploy in progress; the host's guard "
                            "finishes it if its controller is lost"})
                continue
            spawn_guard(name, spec, resumed=True)
        journal({"action": "guard.restarted", "release": name,
                 "detail": "deploy never finished and its guard was gone; a new guard finishes it (rollback or keep) "
                           "once the controller's lease has not moved for %ds" % int(float(spec["lease_timeout"]))})
        out.append({"release": name, "guard": "restarted", "detail": "deploy never finished: its guard was gone, a "
                    "new one finishes it (rollback or keep) within %ds" % int(float(spec["lease_timeout"]))})
    return out


def write_fields(name, fields):
    path = os.path.join(release_dir(name), "release.json")
    meta = release_info(name)
    meta.pop("name", None)
    meta.update(fields)
    replace_with(path, json.dumps(meta, indent=1, sort_keys=True))


def undo_patches(spec):
    """Bring the venv's patch set back to the previous release's; returns what failed."""
    problems = []
    for step in spec.get("patch_plan") or []:
        try:
            if step["action"] == "apply":
                do_apply(step["patch"])
            else:
                do_revert(step["patch"])
        except SystemExit:
            problems.append("%s %s failed%s" % (step["action"], step["patch"]["name"],
                                                (": " + LAST_FAILURE[0]) if LAST_FAILURE else ""))
    return problems


def guard_rollback(name, spec, outcome):
    owner = {"id": "guard-%d" % os.getpid(), "who": "servops guard on host", "action": "guard rollback of " + name,
             "host_pid": os.getpid(), "host_starttime": proc_starttime(os.getpid())}
    held, _age, readable = lock_state()
    # The dead controller's lock is ours to take over: the guard acts for that deploy (as for an
    # unreadable lock, or one a dead guard left).
    if held is not None and (held.get("id") == spec.get("lock_id") or not readable
                             or (held.get("host_pid") and not held.get("alive_on_host"))):
        os.unlink(LOCKFILE)
    took = take_lock(dict(owner, acquired_at=now_iso()))
    why = "controller lost and the release %s: %s" % (outcome["state"], outcome["reason"])
    stop_server(float(spec.get("stop_grace", 30)))
    target = spec.get("previous")
    try:
        if not target:
            write_fields(name, {"status": "failed", "failure": why + "; no earlier release: server stopped"})
            journal({"action": "guard.rollback", "release": name, "outcome": "server stopped", "detail": why})
            return
        problems = undo_patches(spec)
        write_fields(name, {"status": "failed", "failure": why})
        switch_to(target["name"])
        start_server(target["name"], target.get("port"))
        back = gate(target["name"], int(target.get("port")), target.get("health") or {},
                    spec.get("signatures") or [], float((target.get("health") or {}).get("timeout", 1200)))
        write_fields(target["name"], {"status": "healthy" if back["state"] == "healthy" else "failed",
                                      "rolled_back_at": now_iso(), "rolled_back_by": "guard"})
        journal({"action": "guard.rollback", "release": name, "to": target["name"],
                 "outcome": "rolled back" if back["state"] == "healthy" else "rollback failed: " + back["reason"],
                 "detail": why + ("; " + "; ".join(problems) if problems else "")})
    finally:
        touch_private(os.path.join(release_dir(name), "guard.disarm"))  # done: no guard acts on it again
        if took:
            held, _a, _r = lock_state()
            if held and held.get("id") == owner["id"]:
                os.unlink(LOCKFILE)


def op_disarm():
    touch_private(os.path.join(release_dir(ARGS["name"]), "guard.disarm"))
    return {"disarmed": True}


OPS = {"lock": op_lock, "unlock": op_unlock, "releases": op_releases, "prepare": op_prepare, "discard": op_discard,
       "mark": op_mark, "switch": op_switch, "port_check": op_port_check, "stop": op_stop, "start": op_start,
       "health": op_health, "status": op_status, "logs": op_logs, "follow": op_follow, "prune": op_prune,
       "journal": op_journal, "disarm": op_disarm, "claim": op_claim, "owns": op_owns,
       "verify_patches": op_verify_patches, "pin": op_pin, "identity": op_identity, "rearm": op_rearm,
       "facts": op_facts, "warmup": op_warmup}


def run_op(op):
    check_root()
    injected = ARGS.get("_fail") or ""
    fail_op, _, suffix = injected.partition(":")
    if injected and fail_op == op and str(ARGS.get("name") or "").endswith(suffix):
        fail("%s failed: [Errno 28] No space left on device (injected by SERVOPS_INJECT_FAILURE)" % op)
    return OPS[op]()


def op_batch():
    """Several ops in one SSH command, in order; a failing step stops the rest."""
    results = []
    common = {k: v for k, v in ARGS.items() if k not in ("op", "steps")}
    for step in ARGS["steps"]:
        ARGS.clear()
        ARGS.update(common)
        ARGS.update(step)
        results.append(run_op(step["op"]))
    return {"results": results}


OPS["batch"] = op_batch
# Run as its own program (not included as a library: the deploy facts read releases through it).
if _SERVOPS_MAIN == "deploy_ctl":
    try:
        check_root()
        # Every command (any verb) sees a deploy that never finished; a dead guard starts again.
        UNFINISHED = [] if ARGS["op"] in ("follow", "claim", "owns") else unfinished_deploys()
        # (what a killed program left beside the server: ended by any command but a guard's own)
        sweeps = {} if ARGS["op"] in ("follow", "claim", "owns") else {"orphan_warmups_ended": orphan_warmups()}
        try:
            if sweeps:
                sweeps["audit_leftovers_removed"] = sweep_audit_leftovers()
        except OSError:  # a sweep that cannot run (a full disk, /proc unreadable) leaves the command to run
            pass
        out = run_op(ARGS["op"])
        out.update((key, names) for key, names in sweeps.items() if names)
    except FileProblem as exc:
        fail(str(exc))
    out["site"] = []
    reply(out)
