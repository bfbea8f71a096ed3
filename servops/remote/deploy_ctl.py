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


def now_iso():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


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
    symlink: one planted there is removed and the file made anew."""
    if os.path.islink(path):
        os.unlink(path)
    return open_private(path, flags)


def current_name():
    try:
        return os.path.basename(os.readlink(CURRENT))
    except OSError:
        return None


def server_proc():
    return our_server(ROOT)


def release_info(name):
    meta = read_json(os.path.join(RELEASES, name, "release.json"), {}) or {}
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
    if not isinstance(held, dict) or not held.get("id"):
        return {"id": None, "unreadable": True, "size": st.st_size, "mtime": st.st_mtime}, age, False
    # A holder running ON this host (the guard) is alive or not by its pid and start time.
    if held.get("host_pid"):
        held["alive_on_host"] = proc_starttime(held["host_pid"]) == held.get("host_starttime")
    return held, age, True


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
            orphans = mark_orphans(owner)
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


def mark_orphans(owner):
    """Releases still 'deploying' when we hold the lock belong to a deploy that died (its lock was
    stale or broken): they are 'interrupted' now, and a guard still watching one stands down."""
    names = []
    for rel in list_releases():
        if rel.get("status") == "deploying":
            path = os.path.join(RELEASES, rel["name"], "release.json")
            meta = read_json(path, {}) or {}
            meta.update(status="interrupted", failure="the deploy that made it did not finish (superseded by %s)"
                        % owner.get("action"))
            replace_with(path, json.dumps(meta, indent=1, sort_keys=True))
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
    return {"root": ROOT, "current": current_name(), "releases": list_releases(), "server": server_proc()}


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
    out = {"name": name, "dir": d}
    if ARGS.get("guard"):
        out["guard"] = spawn_guard(name, ARGS["guard"])
    return out


def op_discard():
    """Remove a release that never ran (an aborted deploy): no orphan directories."""
    d = release_dir(ARGS["name"])
    if current_name() == ARGS["name"]:
        fail("release %s is current; not removing it" % ARGS["name"])
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


def listener_inodes(port):
    """Socket inodes listening on this TCP port (IPv4 and IPv6), from /proc/net."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f[9])
        except (OSError, StopIteration, ValueError):
            continue
    return inodes


def group_holds_port(pgid, port):
    """Is this port's listener a process of our server's process group? None: cannot tell."""
    inodes = listener_inodes(port)
    if not inodes:
        return None
    wanted = {"socket:[%s]" % i for i in inodes}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % pid) as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            for fd in os.listdir("/proc/%s/fd" % pid):
                if os.readlink("/proc/%s/fd/%s" % (pid, fd)) in wanted:
                    return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def op_port_check():
    proc = server_proc()
    busy = port_in_use(int(ARGS["port"]))
    return {"busy": busy, "ours": bool(proc), "server": proc}


def stop_server(grace):
    proc = server_proc()
    if not proc:
        if os.path.exists(PIDFILE):
            os.unlink(PIDFILE)
        return {"stopped": False, "reason": "no server running"}
    pgid = proc["pgid"]
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace
    killed = False
    while time.time() < deadline and server_proc():
        time.sleep(0.1)
    if server_proc():
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        killed = True
        for _ in range(50):
            if not server_proc():
                break
            time.sleep(0.1)
    port = proc.get("port")
    for _ in range(100):  # the listening socket can outlive the process group by a moment
        if not port or not port_in_use(int(port)):
            break
        time.sleep(0.1)
    os.unlink(PIDFILE)
    return {"stopped": True, "pid": proc["pid"], "killed": killed, "release": proc.get("release")}


def op_stop():
    if ARGS.get("restart_of"):
        # A restart onto this release is under way (stop, switch, start): the guard waits for it.
        touch_private(os.path.join(release_dir(ARGS["restart_of"]), "restarting"))
    res = stop_server(float(ARGS.get("grace", 30)))
    if res["stopped"] and ARGS.get("journal"):
        journal(dict(ARGS["journal"], release=res.get("release"), pid=res["pid"],
                     outcome="SIGKILL after grace" if res["killed"] else "SIGTERM"))
    return res


def start_server(name, port):
    if server_proc():
        fail("a server is still running (pid %d); stop it first" % server_proc()["pid"])
    d = release_dir(name)
    log_path = os.path.join(d, "server.log")
    log = os.fdopen(own_file(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")
    # A new session: the server outlives this SSH channel and is signalled as one group.
    proc = subprocess.Popen(["bash", os.path.join(d, "launch.sh")], cwd=d, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    log.close()
    info = {"pid": proc.pid, "pgid": proc.pid, "starttime": proc_starttime(proc.pid), "release": name,
            "port": port, "started_at": now_iso(), "started_epoch": time.time(), "log": log_path}
    replace_with(PIDFILE, json.dumps(info))
    return info


def op_start():
    info = start_server(ARGS["name"], ARGS.get("port"))
    marker = os.path.join(release_dir(ARGS["name"]), "restarting")
    if os.path.exists(marker):
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
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=timeout) as r:
            return r.status, r.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except Exception as exc:
        return None, str(exc)


def http_ok(port, path, timeout=2.0):
    return http_get(port, path, timeout)[0] == 200


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
    MATCH_CHARS = 8192
    MATCH_BUDGET_S = 2.0

    def __init__(self, path, signatures):
        self.path, self.pos, self.partial, self.lines = path, 0, "", []
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
        if len(self.lines) + len(new) > self.KEEP_LINES:
            del self.lines[:len(self.lines) + len(new) - self.KEEP_LINES // 2]
        base = len(self.lines)
        self.lines.extend(new)
        return self._search(new, base)

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
            self.lines.append(self.partial)
            self.partial = ""

    def excerpt(self, hit=None, before=12, after=30, limit=80):
        """Bounded: the signature line with context, from its Traceback header when one opens
        shortly before it; without a hit, the tail."""
        lines = self.lines
        if hit is None:
            return lines[-25:]
        lo = max(0, hit - before)
        for i in range(hit, max(-1, hit - 60), -1):
            if "Traceback (most recent call last)" in lines[i]:
                lo = i
                break
        return lines[lo:min(len(lines), hit + after + 1, lo + limit)]

    def last_line(self):
        for line in reversed(self.lines + ([self.partial] if self.partial else [])):
            if line.strip():
                return line
        return ""


def gate(name, port, health, signatures, deadline_s, progress=None, stop_when=None):
    """Wait until the release answers its health endpoints, dies, logs a crash signature or runs
    out of time. Returns the outcome dict."""
    log = LogWatch(os.path.join(release_dir(name), "server.log"), signatures)
    mask = masker(name)
    started = time.time()
    endpoint = health.get("endpoint", "/health")
    # The model-info check prefers today's /model_info and falls back to the deprecated
    # /get_model_info of older releases; `model_info: null` turns it off.
    preferred = health.get("model_info", "/model_info")
    info_paths = [] if preferred is None else list(dict.fromkeys([preferred, "/model_info", "/get_model_info"]))
    interval = float(health.get("interval", 2))
    last_progress = 0

    def result(state, reason, ex=None):
        out = {"state": state, "reason": reason, "elapsed": round(time.time() - started, 2),
               "excerpt": [mask(l) for l in (ex or [])], "log": log.path}
        if log.dropped:
            out["slow_signatures"] = log.dropped
        return out

    while True:
        hit = log.poll()
        if hit:
            log.settle()
            line = mask(log.lines[hit[1]].strip())
            return result("crashed", "crash signature %s matched in server.log: %s"
                          % (hit[0], line if len(line) <= 200 else line[:197] + "..."), log.excerpt(hit[1]))
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
                if group_holds_port((server_proc() or {}).get("pgid", -1), port) is False:
                    log.settle()
                    return result("crashed", "port %d answered, but another process holds it, not this release's "
                                             "server" % port, log.lines[-25:])
                return result("healthy", "%s answered 200%s" % (endpoint, (" and " + used) if used else ""))
        elapsed = time.time() - started
        if elapsed > deadline_s:
            return result("timeout", "not healthy after %ds" % deadline_s, log.lines[-25:])
        if stop_when and stop_when():
            return result("abandoned", "stood down")
        if progress and time.time() - last_progress >= interval:
            last_progress = time.time()
            progress({"progress": round(elapsed, 1), "log": mask(log.last_line())[-400:]})
        time.sleep(min(interval, 0.5))


def op_health():
    def progress(p):
        sys.stdout.write(json.dumps(p) + "\n")
        sys.stdout.flush()
    return gate(ARGS["name"], int(ARGS["port"]), ARGS.get("health") or {}, ARGS.get("signatures", []),
                float(ARGS["timeout"]), progress)


def op_status():
    cur = current_name()
    proc = server_proc()
    out = {"root": ROOT, "current": cur, "release": release_info(cur) if cur else None, "server": proc,
           "healthy": None, "now": time.time(), "server_info": None}
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
    while os.getppid() == parent:  # the SSH session ended (Ctrl-C): nobody reads us any more

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


def op_prune():
    keep = int(ARGS["keep"])
    protect = {current_name(), ARGS.get("protect")}
    names = [r["name"] for r in list_releases()]
    removed = []
    for name in names[:-keep] if keep > 0 else []:
        if name in protect:
            continue
        shutil.rmtree(os.path.join(RELEASES, name), ignore_errors=True)
        removed.append(name)
    return {"removed": removed}


def op_journal():
    if ARGS.get("entry"):
        journal(ARGS["entry"])
        return {"ok": True}
    entries = []
    try:
        with open(JOURNAL) as fh:
            for line in fh:
                try:
                    entries.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    n = int(ARGS.get("last") or 0)
    return {"path": JOURNAL, "entries": entries[-n:] if n else entries}


def op_renew():
    """The controller is alive: push the guard's lease forward."""
    try:
        os.utime(os.path.join(release_dir(ARGS["name"]), "lease"), follow_symlinks=False)
        return {"renewed": True}
    except OSError:
        return {"renewed": False}


# ---- the guard: auto-rollback that survives the controller ----------------------------------
#
# Started with the new server. While the controller renews the lease, the guard only watches.
# When the release is marked (healthy, failed, interrupted) or disarmed, it exits. If the lease
# runs out first (controller killed, laptop closed, SSH dropped), the guard finishes the health
# gate itself: a healthy server stays (marked "unconfirmed": the deploy's later gates never ran);
# a dead, crashed or never-healthy one is rolled back to the previous release, patches included,
# and the journal says why.

def guard_status(name):
    return (read_json(os.path.join(release_dir(name), "release.json"), {}) or {}).get("status")


def spawn_guard(name, spec):
    d = release_dir(name)
    lease = os.path.join(d, "lease")
    touch_private(lease)
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        guard_pid = int(os.read(r, 32) or b"0")
        os.close(r)
        os.waitpid(pid, 0)
        return {"pid": guard_pid, "starttime": proc_starttime(guard_pid), "lease": lease}
    # First child: new session, fork again so the guard is reparented and outlives this SSH channel.
    os.close(r)
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.write(w, str(os.getpid()).encode())
    os.close(w)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        run_guard(name, spec, lease)
    except BaseException as exc:  # the guard must never die silently
        try:
            journal({"action": "guard.error", "release": name, "detail": "%s: %s" % (type(exc).__name__, exc)})
        except Exception:
            pass
    os._exit(0)


def run_guard(name, spec, lease):
    started = time.time()
    lease_timeout = float(spec["lease_timeout"])
    disarm = os.path.join(release_dir(name), "guard.disarm")
    previous = (spec.get("previous") or {}).get("name")

    def standing_down():
        # armed before the switch: `current` is the previous release until then
        return (os.path.exists(disarm) or guard_status(name) != "deploying"
                or current_name() not in (name, previous))

    while True:
        if standing_down():
            return
        try:
            idle = time.time() - os.path.getmtime(lease)
        except OSError:
            return
        if idle > lease_timeout:
            break
        time.sleep(1)
    journal({"action": "guard.takeover", "release": name, "who": "guard on host",
             "detail": "controller stopped renewing its lease %ds ago" % int(idle)})
    # A restart the controller began is finished by the host program: wait for it.
    marker = os.path.join(release_dir(name), "restarting")
    limit = float(spec.get("stop_grace", 30)) + 120
    while os.path.exists(marker) and time.time() - os.path.getmtime(marker) < limit:
        time.sleep(1)
    if current_name() != name:
        if previous and not server_proc():  # stopped, never switched: bring the old one back
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
    remaining = max(5.0, float(spec["health_timeout"]) - (time.time() - started))
    outcome = gate(name, int(spec["port"]), spec.get("health") or {}, spec.get("signatures") or [], remaining,
                   stop_when=lambda: os.path.exists(disarm) or guard_status(name) != "deploying")
    if outcome["state"] == "abandoned":
        return
    if outcome["state"] == "healthy":
        write_fields(name, {"status": "unconfirmed", "guard": "controller lost; server healthy, left running; "
                            "the deploy's later gates did not run"})
        journal({"action": "guard.keep", "release": name, "outcome": "unconfirmed",
                 "detail": "controller lost; release healthy (%s); left running" % outcome["reason"]})
        return
    guard_rollback(name, spec, outcome)


def write_fields(name, fields):
    path = os.path.join(release_dir(name), "release.json")
    meta = read_json(path, {}) or {}
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
            problems.append("%s %s failed" % (step["action"], step["patch"]["name"]))
    return problems


def guard_rollback(name, spec, outcome):
    owner = {"id": "guard-%d" % os.getpid(), "who": "servops guard on host", "action": "guard rollback of " + name,
             "host_pid": os.getpid(), "host_starttime": proc_starttime(os.getpid())}
    held, _age, _readable = lock_state()
    # The dead controller's lock is ours to take over: the guard acts for that deploy.
    if held is not None and held.get("id") == spec.get("lock_id"):
        os.unlink(LOCKFILE)
    took = take_lock(dict(owner, acquired_at=now_iso()))
    why = "controller lost and the release %s: %s" % (outcome["state"], outcome["reason"])
    stop_server(float(spec.get("stop_grace", 30)))
    target = spec.get("previous")
    if not target:
        write_fields(name, {"status": "failed", "failure": why + "; no earlier release: server stopped"})
        journal({"action": "guard.rollback", "release": name, "outcome": "server stopped", "detail": why})
        if took:
            os.unlink(LOCKFILE)
        return
    problems = undo_patches(spec)
    write_fields(name, {"status": "failed", "failure": why})
    switch_to(target["name"])
    start_server(target["name"], target.get("port"))
    back = gate(target["name"], int(target.get("port")), target.get("health") or {}, spec.get("signatures") or [],
                float((target.get("health") or {}).get("timeout", 1200)))
    write_fields(target["name"], {"status": "healthy" if back["state"] == "healthy" else "failed",
                                  "rolled_back_at": now_iso(), "rolled_back_by": "guard"})
    journal({"action": "guard.rollback", "release": name, "to": target["name"],
             "outcome": "rolled back" if back["state"] == "healthy" else "rollback failed: " + back["reason"],
             "detail": why + ("; " + "; ".join(problems) if problems else "")})
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
       "journal": op_journal, "renew": op_renew, "disarm": op_disarm}


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
out = run_op(ARGS["op"])
out["site"] = []
reply(out)
