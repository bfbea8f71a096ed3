# The server process servops started, and ports: shared by the host programs (deploy_ctl,
# launch_check) and the lab. Standard library only; importable as a module too.
import json as _json
import os as _os
import socket as _socket


def read_json(path, default=None):
    try:
        with open(path) as fh:
            return _json.load(fh)
    except (OSError, ValueError):
        return default


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
