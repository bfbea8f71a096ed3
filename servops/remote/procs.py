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


def our_server(root):
    """servops' server from <deploy_root>/server.pid; a reused pid (another start time) is not ours."""
    info = read_json(_os.path.join(root, "server.pid"))
    if not isinstance(info, dict) or "pid" not in info:
        return None
    if proc_starttime(info["pid"]) != info.get("starttime"):
        return None
    return info


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
