# The server process servops started, and ports: shared by the host programs (deploy_ctl,
# launch_check) and the lab. Standard library only; importable as a module too.
import json as _json
import os as _os
import socket as _socket


def read_json(path, default=None):
    """A small JSON file servops wrote (server.pid, release.json, the lock), or `default`: never
    through a symlink, never blocking on a FIFO planted there, never a directory's error."""
    import stat as _stat
    try:
        fd = _os.open(path, _os.O_RDONLY | _os.O_NOFOLLOW | _os.O_NONBLOCK)
    except OSError:
        return default
    try:
        if not _stat.S_ISREG(_os.fstat(fd).st_mode):
            return default
        with _os.fdopen(fd, "rb", closefd=False) as fh:
            return _json.loads(fh.read(4 << 20))
    except (OSError, ValueError, RecursionError):
        return default
    finally:
        _os.close(fd)


def proc_starttime(pid):
    """The kernel's start time of a live (not zombie) process; None when it is gone."""
    try:
        with open("/proc/%d/stat" % int(pid)) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, ValueError, TypeError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _proc_stat(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return None


def our_server(root):
    """servops' server from <deploy_root>/server.pid, or None.

    The pidfile is only a claim (a reused pid, or one a compromised server or another program
    wrote): the process must be what servops starts, checked in /proc. It has the recorded start
    time, leads its own session and process group (start_new_session), and runs in its release's
    directory under this deploy root (the launch script cds there). Its pgid is the kernel's,
    never the file's: `stop` signals only that group."""
    info = read_json(_os.path.join(root, "server.pid"))
    if not isinstance(info, dict) or "pid" not in info:
        return None
    try:
        pid = int(info["pid"])
    except (TypeError, ValueError):
        return None
    release = info.get("release")
    if pid <= 1 or not isinstance(release, str) or not release or "/" in release or release.startswith("."):
        return None
    fields = _proc_stat(pid)
    if not fields or fields[0] == "Z" or fields[19] != info.get("starttime"):
        return None
    if fields[2] != str(pid) or fields[3] != str(pid):  # pgrp, session
        return None
    try:
        cwd = _os.path.realpath("/proc/%d/cwd" % pid)
    except OSError:
        return None
    if cwd != _os.path.realpath(_os.path.join(root, "releases", release)):
        return None
    return dict(info, pid=pid, pgid=pid)


def port_in_use(port):
    """Is something listening? SO_REUSEADDR as servers set it, so TIME_WAIT leftovers don't count."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", int(port)))
    except OSError:
        return True
    finally:
        s.close()
    return False


# ---- every process of a release -----------------------------------------------------------
#
# A server is a process tree: sglang's TP schedulers and detokenizer, vLLM's EngineCore and
# workers. Children can ignore SIGTERM (a scheduler stuck in NCCL), outlive their leader and go
# on serving the port, or leave the session with setsid(). servops starts every server with
# RELEASE_ENV naming its release directory; a process belongs to a release when it carries that
# mark, lives in the leader's session or process group, descends from it, or runs (cwd or exe)
# inside the release directory detached: without a terminal, and a session leader or an orphan
# (what setsid() or a double fork leaves). An operator's shell or `tail -f` cd'd there is none.

RELEASE_ENV = "SERVOPS_RELEASE_DIR"


def _inside(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def _environ_mark(pid):
    return environ_value(pid, RELEASE_ENV)


def environ_value(pid, name):
    """The value of env var `name` in process `pid` (its first MiB of environment), or None."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            data = fh.read(1 << 20)
    except OSError:
        return None
    key = name.encode() + b"="
    for item in data.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode("utf-8", "replace")
    return None


def _link(pid, what):
    try:
        return _os.path.realpath("/proc/%d/%s" % (pid, what))
    except OSError:
        return None


def _comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def process_table():
    """pid -> facts of every live (non-zombie) process of this user, from /proc."""
    me = _os.getuid()
    table = {}
    for entry in _os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        fields = _proc_stat(pid)
        if not fields or fields[0] in ("Z", "X"):
            continue
        try:
            if _os.stat("/proc/%d" % pid).st_uid != me:
                continue
        except OSError:
            continue
        table[pid] = {"pid": pid, "ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3]),
                      "tty": int(fields[4]), "starttime": fields[19], "state": fields[0]}
    return table


def _ancestors(pid, table):
    seen = set()
    while pid in table and pid not in seen:
        seen.add(pid)
        pid = table[pid]["ppid"]
    return seen


def release_processes(releases_dir, leaders=(), table=None):
    """{pid: facts + "release" + "why"} of every process belonging to a release under
    `releases_dir` (see above). `leaders`: the recorded server leaders, each (pid, release)."""
    table = process_table() if table is None else table
    releases_dir = _os.path.realpath(releases_dir)
    spare = _ancestors(_os.getpid(), table) | {1}
    found = {}

    def take(pid, release, why):
        if pid not in spare and pid not in found and pid in table:
            found[pid] = dict(table[pid], release=release, why=why)

    for pid, release in leaders:
        # the leader leads its session and group (setsid at start): its members are found by
        # that id even once the leader itself is gone
        if pid in table and table[pid]["sid"] == pid:
            take(pid, release, "server leader")
        for other in table.values():
            if other["sid"] == pid or other["pgid"] == pid:
                take(other["pid"], release, "in the server's session")
    for pid, facts in table.items():
        if pid in found or pid in spare:
            continue
        mark = _environ_mark(pid)
        if mark and _inside(_os.path.realpath(mark), releases_dir):
            take(pid, _os.path.basename(mark.rstrip("/")), "marked as a process of the release")
            continue
        detached = facts["sid"] == pid or facts["ppid"] == 1 or facts["ppid"] not in table
        if facts["tty"] == 0 and detached:
            for what in ("cwd", "exe"):
                path = _link(pid, what)
                if path and _inside(path, releases_dir) and path != releases_dir:
                    rel = path[len(releases_dir) + 1:].split("/", 1)[0]
                    take(pid, rel, "runs in the release directory (%s)" % what)
                    break
    # descendants of anything found (a child that changed its cwd and environment)
    grew = True
    while grew:
        grew = False
        for pid, facts in table.items():
            if pid not in found and pid not in spare and facts["ppid"] in found:
                take(pid, found[facts["ppid"]]["release"], "child of %d" % facts["ppid"])
                grew = True
    sessions = {pid for pid, _r in leaders}
    for pid, facts in found.items():
        facts["name"] = _comm(pid)
        if sessions and facts["why"] != "server leader" and facts["sid"] not in sessions:
            facts["escaped"] = True  # left the server's session (setsid): found by the same rules
    return found


def listener_inodes(port):
    """Socket inodes listening on this TCP port (IPv4 and IPv6), from /proc/net."""
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == int(port):
                        inodes.add(f[9])
        except (OSError, StopIteration, ValueError):
            continue
    return inodes


def port_holders(port, pids=None):
    """Pids (of this user, or among `pids`) holding a listening socket on `port`."""
    wanted = {"socket:[%s]" % i for i in listener_inodes(port)}
    if not wanted:
        return set()
    holders = set()
    for pid in (pids if pids is not None else [int(p) for p in _os.listdir("/proc") if p.isdigit()]):
        try:
            for fd in _os.listdir("/proc/%d/fd" % pid):
                if _os.readlink("/proc/%d/fd/%s" % (pid, fd)) in wanted:
                    holders.add(pid)
                    break
        except OSError:
            continue
    return holders


# ---- children with a deadline -----------------------------------------------------------------
#
# What a host program runs on the host's behalf (nvidia-smi, patch(1), an import of the engine in
# a proof) can hang: a driver call, a FIFO where a file should be, an import that waits forever.
# Each such child gets a deadline and a process group of its own, and is ended with that whole
# group (SIGKILL) at the deadline: a grandchild holding the child's pipes open would otherwise
# keep the host program waiting past any timeout of its own.

SMI_DEADLINE = 20  # seconds for one nvidia-smi query


class DeadlineExceeded(Exception):
    """A child ran past its deadline; it was ended with its process group."""


class ControllerGone(SystemExit):
    """The controller that reads this program's reply is gone (its SSH channel closed, a Ctrl-C):
    the children were ended and the program exits (a SystemExit: `finally` blocks still clean up)."""


def end_group(pgid):
    """SIGKILL every process of group `pgid` (its leader not yet reaped, so the id is not reused)."""
    import signal as _signal
    try:
        _os.killpg(pgid, _signal.SIGKILL)
    except OSError:
        pass  # already empty


def _controller_gone():
    """Whether this program's stdout, its reply channel, was closed by the reader (sshd, once the
    controller is gone): the write end of a pipe or socket then polls as an error or hang-up."""
    import select as _select
    poller = _select.poll()
    poller.register(1, _select.POLLERR | _select.POLLHUP)
    return any(ev & (_select.POLLERR | _select.POLLHUP) for _fd, ev in poller.poll(0))


def run_command_with_deadline(argv, deadline_s, stdin=None, env=None, cwd=None):
    """(returncode, stdout bytes, stderr bytes) of `argv` run in a session of its own; past
    `deadline_s` seconds the whole session's group is killed and DeadlineExceeded raised."""
    import subprocess as _subprocess
    proc = _subprocess.Popen(argv, stdin=_subprocess.PIPE if stdin is not None else _subprocess.DEVNULL,
                             stdout=_subprocess.PIPE, stderr=_subprocess.PIPE, env=env, cwd=cwd,
                             start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=deadline_s)
    except _subprocess.TimeoutExpired:
        end_group(proc.pid)
        try:
            proc.communicate(timeout=5)
        except _subprocess.TimeoutExpired:  # its pipes held by something that left the group
            proc.kill()
        raise DeadlineExceeded("%s did not finish within %.0fs: ended with its process group"
                               % (_os.path.basename(argv[0]), deadline_s)) from None
    return proc.returncode, out, err


def run_child_with_deadline(fn, deadline_s, what="the child", cap=16 << 20):
    """fn() in a forked child leading a process group of its own; its JSON answer (a dict, at most
    `cap` bytes), or {"result": "timeout"|"error", "message"} when it ran past `deadline_s`
    seconds or ended without one. The child's whole group is killed when it is done, at the
    deadline, or when the controller goes away (then ControllerGone is raised here): nothing it
    started outlives it. The child's stdout goes to stderr, so nothing it prints mixes with the
    program's reply."""
    import select as _select
    import time as _time
    read_end, write_end = _os.pipe()
    pid = _os.fork()
    if pid == 0:  # the child: answer on the pipe, never return into the caller's code
        code = 0
        try:
            _os.setpgid(0, 0)
            _os.close(read_end)
            _os.dup2(2, 1)
            try:
                answer = fn()
            except BaseException as exc:  # noqa: BLE001 - the child's answer, whatever happened
                answer = {"result": "error", "error_type": type(exc).__name__, "message": str(exc)[:500]}
            data = _json.dumps(answer).encode()
            view = memoryview(data)
            while view:
                view = view[_os.write(write_end, view):]
        except BaseException:  # noqa: BLE001 - not even an answer could be written
            code = 1
        finally:
            _os._exit(code)
    _os.close(write_end)
    try:
        _os.setpgid(pid, pid)  # also here: the group exists before the deadline can need it
    except OSError:
        pass
    _os.set_blocking(read_end, False)
    deadline = _time.monotonic() + deadline_s
    chunks, size, outcome, exited = [], 0, None, False
    try:
        while outcome is None:
            left = deadline - _time.monotonic()
            if left <= 0:
                outcome = {"result": "timeout", "message": "%s did not finish within %.0fs: ended with its process "
                           "group" % (what, deadline_s)}
                break
            if exited or _select.select([read_end], [], [], min(left, 0.5))[0]:
                try:
                    chunk = _os.read(read_end, 1 << 16)
                except BlockingIOError:
                    if exited:  # all the exited child wrote is read: a grandchild that inherited the
                        break   # pipe (a forked worker) must not hold the answer back until the deadline
                    continue
                if not chunk:
                    break
                size += len(chunk)
                if size > cap:
                    outcome = {"result": "error", "message": "%s answered more than %d bytes: ended" % (what, cap)}
                    break
                chunks.append(chunk)
            elif _controller_gone():
                raise ControllerGone(1)
            else:  # exited, not yet reaped (WNOWAIT): its pid and group id cannot be reused before end_group
                exited = _os.waitid(_os.P_PID, pid, _os.WEXITED | _os.WNOHANG | _os.WNOWAIT) is not None
    finally:
        end_group(pid)
        _os.close(read_end)
        _, status = _os.waitpid(pid, 0)
    if outcome is not None:
        return outcome
    try:
        answer = _json.loads(b"".join(chunks))
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        how = ("killed by signal %d" % _os.WTERMSIG(status) if _os.WIFSIGNALED(status)
               else "exit status %d" % _os.WEXITSTATUS(status))
        return {"result": "error", "message": "%s ended without an answer (%s)" % (what, how)}
    return answer


def gpu_apps():
    """{"apps": [{pid, gpu_uuid, used_mib, name}], "skipped": [rows that did not parse]} of
    nvidia-smi's compute apps, or {"error": why} where nvidia-smi gives no answer (it failed, or
    hung and was ended at SMI_DEADLINE); None where there is no nvidia-smi."""
    import shutil
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        code, out, err = run_command_with_deadline([smi, "--query-compute-apps=pid,gpu_uuid,used_memory,process_name",
                                                    "--format=csv,noheader,nounits"], SMI_DEADLINE)
    except (OSError, DeadlineExceeded) as exc:
        return {"error": "nvidia-smi --query-compute-apps: %s" % exc}
    if code != 0:
        return {"error": "nvidia-smi --query-compute-apps exited %d: %s" % (
            code, (err or out).decode("utf-8", "replace").strip()[:200])}
    apps, skipped = parse_gpu_apps(out.decode("utf-8", "replace"))
    return {"apps": apps, "skipped": skipped}


def parse_gpu_apps(text):
    """(apps, skipped) from rows of --query-compute-apps=pid,gpu_uuid,used_memory,process_name
    (csv, noheader, nounits). The name is the workload's and may hold commas (and any byte: the
    caller decodes with replacement): it is the last column, taken whole. used_mib None where the
    driver reports none ([N/A], [Insufficient Permissions]). Lines that are no row (blank, a
    header, "No running processes found") are passed over; a row whose pid is not a pid is
    skipped and returned, cut to 120 characters, so the caller can say so."""
    apps, skipped = [], []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or parts[0] == "pid":
            continue
        pid = int(parts[0]) if parts[0].isascii() and parts[0].isdigit() else 0
        if not 0 < pid < 1 << 22:  # Linux's largest pid_max
            skipped.append(line.strip()[:120])
            continue
        try:
            used = float(parts[2])
        except ValueError:
            used = None
        apps.append({"pid": pid, "gpu_uuid": parts[1], "used_mib": used if used == used and used not in (
            float("inf"), float("-inf")) else None, "name": ",".join(parts[3:])})
    return apps, skipped


AUDIT_WORK_PREFIXES = ("servops-audit-", "servops-probe-")


def sweep_audit_leftovers(prefixes=AUDIT_WORK_PREFIXES):
    """Work directories of audit programs that were killed (their `owner` pid no longer runs the
    program that made them; SIGKILL or a dropped session's SIGHUP skip its `finally`): removed,
    with any process still running in them. The audit sweeps before it starts, and every
    deploy_ctl command too: a host whose next command is no audit is not left holding them."""
    import shutil
    import signal
    import tempfile
    import time

    # (where mkdtemp puts them; never tempfile.gettempdir() itself, which writes a probe file in
    # each candidate: on a full disk it raises, and this sweep must never fail the command it precedes)
    root = tempfile.tempdir or next((_os.environ[v] for v in ("TMPDIR", "TEMP", "TMP") if _os.environ.get(v)),
                                    "/tmp")
    try:
        names = _os.listdir(root)
    except OSError:
        return []
    swept = []
    for name in names:
        path = _os.path.join(root, name)
        if not name.startswith(prefixes) or _os.path.islink(path) or not _os.path.isdir(path):
            continue
        try:
            if _os.stat(path).st_uid != _os.getuid():
                continue
            with open(_os.path.join(path, "owner")) as f:
                pid, start = f.read().split()
            if proc_starttime(int(pid)) == start:
                continue  # its audit still runs
        except (OSError, ValueError):
            try:
                if time.time() - _os.stat(path).st_mtime < 60:
                    continue  # being made right now (its owner file not written yet)
            except OSError:
                continue
        for pid in process_table():
            try:
                if _os.readlink("/proc/%d/cwd" % pid).startswith(path):
                    _os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        shutil.rmtree(path, ignore_errors=True)
        swept.append(name)
    return swept
