import signal
import shutil
import socket
import subprocess
import time
import urllib.request

ROOT = os.path.realpath(os.path.expanduser(ARGS.get("deploy_root", "~/.servops/deploy")))
RELEASES = os.path.join(ROOT, "releases")
CURRENT = os.path.join(ROOT, "current")
PIDFILE = os.path.join(ROOT, "server.pid")
LOCKFILE = os.path.join(ROOT, "deploy.lock")


def now_iso():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_atomic(path, text, mode=0o600):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def current_name():
    try:
        return os.path.basename(os.readlink(CURRENT))
    except OSError:
        return None


def proc_starttime(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def server_proc():
    """The server we started, from the pidfile; a reused pid (other start time) is not ours."""
    info = read_json(PIDFILE)
    if not info:
        return None
    st = proc_starttime(info["pid"])
    if st is None or st != info.get("starttime"):
        return None
    try:
        with open("/proc/%d/stat" % info["pid"]) as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
    except OSError:
        return None
    return info


def release_info(name):
    meta = read_json(os.path.join(RELEASES, name, "release.json"), {}) or {}
    meta["name"] = name
    return meta


def list_releases():
    try:
        names = sorted(n for n in os.listdir(RELEASES) if os.path.isdir(os.path.join(RELEASES, n)))
    except OSError:
        names = []
    return [release_info(n) for n in names]


def op_lock():
    os.makedirs(ROOT, mode=0o700, exist_ok=True)
    owner = dict(ARGS["owner"], acquired_at=now_iso())
    for _ in range(2):
        try:
            fd = os.open(LOCKFILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            held = read_json(LOCKFILE, {}) or {}
            replace = ARGS.get("replace_id")
            if replace and held.get("id") == replace:
                os.unlink(LOCKFILE)
                continue
            return {"acquired": False, "held": held, "root": ROOT,
                    "age": time.time() - os.path.getmtime(LOCKFILE) if os.path.exists(LOCKFILE) else 0}
        with os.fdopen(fd, "w") as fh:
            json.dump(owner, fh)
        # What a deploy reads first comes back with the lock: one round trip fewer.
        out = {"acquired": True, "root": ROOT, "home": os.path.expanduser("~"), "listing": op_releases()}
        if ARGS.get("port"):
            out["port"] = op_port_check()
        return out
    fail("could not take the deploy lock %s" % LOCKFILE)


def op_unlock():
    held = read_json(LOCKFILE, {}) or {}
    if held.get("id") == ARGS["id"]:
        os.unlink(LOCKFILE)
    return {"released": True}


def op_releases():
    cur = current_name()
    proc = server_proc()
    return {"root": ROOT, "current": cur, "releases": list_releases(), "server": proc}


def op_prepare():
    os.makedirs(RELEASES, mode=0o700, exist_ok=True)
    base = ARGS["name"]
    name, n = base, 1
    while True:
        try:
            os.mkdir(os.path.join(RELEASES, name), 0o700)
            break
        except FileExistsError:
            n += 1
            name = "%s-%d" % (base, n)
    d = os.path.join(RELEASES, name)
    for rel, spec in ARGS["files"].items():
        write_atomic(os.path.join(d, rel), spec["text"], spec.get("mode", 0o600))
    return {"name": name, "dir": d}


def op_mark():
    path = os.path.join(RELEASES, ARGS["name"], "release.json")
    meta = read_json(path, {}) or {}
    meta.update(ARGS["fields"])
    write_atomic(path, json.dumps(meta, indent=1, sort_keys=True))
    return {"ok": True}


def op_switch():
    target = os.path.join("releases", ARGS["name"])
    if not os.path.isdir(os.path.join(ROOT, target)):
        fail("release %s does not exist under %s" % (ARGS["name"], RELEASES))
    tmp = CURRENT + ".tmp-%d" % os.getpid()
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, CURRENT)  # rename(2): readers see the old or the new release, never neither
    return {"current": ARGS["name"]}


def port_in_use(port):
    """Is something listening? SO_REUSEADDR as servers set it, so TIME_WAIT leftovers don't count."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))
    except OSError:
        return True
    finally:
        s.close()
    return False


def op_port_check():
    proc = server_proc()
    busy = port_in_use(int(ARGS["port"]))
    return {"busy": busy, "ours": bool(proc), "server": proc}


def op_stop():
    proc = server_proc()
    if not proc:
        if os.path.exists(PIDFILE):
            os.unlink(PIDFILE)
        return {"stopped": False, "reason": "no server running"}
        return
    pgid = proc["pgid"]
    grace = float(ARGS.get("grace", 30))
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


def op_start():
    if server_proc():
        fail("a server is still running (pid %d); stop it first" % server_proc()["pid"])
    d = os.path.join(RELEASES, ARGS["name"])
    log_path = os.path.join(d, "server.log")
    log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    # A new session: the server outlives this SSH channel and is signalled as one group.
    proc = subprocess.Popen(["bash", os.path.join(d, "launch.sh")], cwd=d, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    info = {"pid": proc.pid, "pgid": proc.pid, "starttime": proc_starttime(proc.pid), "release": ARGS["name"],
            "port": ARGS.get("port"), "started_at": now_iso(), "started_epoch": time.time(), "log": log_path}
    write_atomic(PIDFILE, json.dumps(info))
    return {"server": info}


def http_ok(port, path, timeout=2.0):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def excerpt(lines, match_index=None):
    """From the last traceback start (at or before the match) to the end; else the tail."""
    end = len(lines)
    upto = match_index if match_index is not None else end - 1
    starts = [i for i in range(0, upto + 1) if lines[i].startswith("Traceback (most recent call last)")]
    if starts:
        return lines[starts[-1]:min(end, starts[-1] + 80)]
    return lines[max(0, end - 25):end]


def op_health():
    port = int(ARGS["port"])
    timeout = float(ARGS["timeout"])
    interval = float(ARGS.get("interval", 2))
    fatal = [re.compile(p) for p in ARGS.get("signatures", [])]
    log_path = os.path.join(RELEASES, ARGS["name"], "server.log")
    started = time.time()
    lines, pos, partial = [], 0, ""
    last_progress = 0

    def result(state, reason, ex=None):
        return ({"state": state, "reason": reason, "elapsed": round(time.time() - started, 2),
               "excerpt": ex or []})

    while True:
        try:
            with open(log_path, "rb") as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos += len(chunk)
        except OSError:
            chunk = b""
        if chunk:
            text = partial + chunk.decode("utf-8", "replace")
            new = text.split("\n")
            partial = new.pop()
            base = len(lines)
            lines.extend(new)
            for i, line in enumerate(new):
                for rx in fatal:
                    if rx.search(line):
                        time.sleep(0.3)  # let the traceback finish writing
                        try:
                            with open(log_path, "rb") as fh:
                                fh.seek(pos)
                                lines.extend((partial + fh.read().decode("utf-8", "replace")).split("\n"))
                        except OSError:
                            pass
                        return result("crashed", "crash signature %r in server.log" % rx.pattern, excerpt(lines, base + i))
        alive = server_proc() is not None
        if not alive:
            if partial:
                lines.append(partial)
            tb = any(l.startswith("Traceback (most recent call last)") for l in lines)
            return result("crashed", "server exited" + (" after a Traceback" if tb else " during startup"), excerpt(lines))
        if http_ok(port, ARGS.get("endpoint", "/health")) and (
                not ARGS.get("model_info") or http_ok(port, ARGS["model_info"])):
            return result("healthy", "%s answered 200" % ARGS.get("endpoint", "/health"))
        elapsed = time.time() - started
        if elapsed > timeout:
            return result("timeout", "not healthy after %ds" % timeout, lines[-25:])
        if time.time() - last_progress >= interval:
            last_progress = time.time()
            tail = (lines[-1] if lines else partial)[-160:]
            sys.stdout.write(json.dumps({"progress": round(elapsed, 1), "log": tail}) + "\n")
            sys.stdout.flush()
        time.sleep(min(interval, 0.5))


def op_status():
    cur = current_name()
    proc = server_proc()
    healthy = None
    if proc and proc.get("port"):
        healthy = http_ok(int(proc["port"]), ARGS.get("endpoint", "/health"))
    return ({"root": ROOT, "current": cur, "release": release_info(cur) if cur else None,
           "server": proc, "healthy": healthy, "now": time.time()})


def op_logs():
    name = ARGS.get("name") or current_name()
    if not name:
        fail("no release deployed under %s" % ROOT)
    path = os.path.join(RELEASES, name, "server.log")
    if not os.path.exists(path):
        fail("release %s has no server.log" % name)
    with open(path, "rb") as fh:
        data = fh.read().decode("utf-8", "replace").splitlines()
    return {"name": name, "path": path, "lines": data[-int(ARGS.get("lines", 100)):]}


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


OPS = {"lock": op_lock, "unlock": op_unlock, "releases": op_releases, "prepare": op_prepare, "mark": op_mark,
       "switch": op_switch, "port_check": op_port_check, "stop": op_stop, "start": op_start, "health": op_health,
       "status": op_status, "logs": op_logs, "prune": op_prune}


def op_batch():
    """Several ops in one SSH command, in order; a failing step stops the rest."""
    results = []
    common = {k: v for k, v in ARGS.items() if k not in ("op", "steps")}
    for step in ARGS["steps"]:
        ARGS.clear()
        ARGS.update(common)
        ARGS.update(step)
        results.append(OPS[step["op"]]())
    return {"results": results}


OPS["batch"] = op_batch
out = OPS[ARGS["op"]]()
out["site"] = []
reply(out)
