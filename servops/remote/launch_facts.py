# Facts a launch needs on the host, whatever the engine: the model path, the port, the GPUs,
# and stdout kept clean while an engine is imported. Included by launch_check (sglang) and
# launch_check_vllm, after _common and procs.
import json as _json
import shutil
import subprocess


def _stdout_to_stderr():
    """Whatever sglang prints while it is imported must not mix with the reply on stdout."""
    saved = os.dup(1)
    os.dup2(2, 1)
    return saved


def _restore_stdout(saved):
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)


def port_fact(port, root):
    if not port:
        return None
    ours = our_server(root)
    if not port_in_use(port):
        return {"port": int(port), "state": "free"}
    if ours:
        return {"port": int(port), "state": "ours", "pid": ours.get("pid")}
    return {"port": int(port), "state": "busy"}


def gpu_fact(root=None):
    """The GPUs nvidia-smi lists; with a deploy root, also who holds GPU memory now ("users"):
    a process servops did not start there (another job, a notebook) leaves the new server less
    memory than its --mem-fraction-static assumes, so the launch check names it before anything
    stops."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"count": None, "error": "nvidia-smi: %s" % exc}
    if out.returncode != 0:
        return {"count": None, "error": "nvidia-smi -L exited %d: %s" % (out.returncode, (out.stderr or out.stdout).strip()[:200])}
    names = [l.strip() for l in out.stdout.splitlines() if l.strip().startswith("GPU ")]
    fact = {"count": len(names), "names": names[:16]}
    if root is not None:
        apps = gpu_apps()
        if apps is None:
            fact["users_error"] = "nvidia-smi --query-compute-apps gave no answer"
        else:
            ours = our_server(root)
            fact["users"] = gpu_users(apps, gpu_indexes(out.stdout), ours and ours["pid"])
    return fact


def gpu_indexes(listing):
    """{GPU UUID: index} from `nvidia-smi -L` ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)")."""
    indexes = {}
    for line in listing.splitlines():
        line = line.strip()
        head, sep, rest = line.partition(":")
        if not sep or not head.startswith("GPU ") or "(UUID: " not in rest:
            continue
        try:
            indexes[rest.rsplit("(UUID: ", 1)[1].rstrip(")").strip()] = int(head[4:])
        except ValueError:
            continue
    return indexes


def gpu_users(apps, indexes, our_pid):
    """Each GPU memory holder (procs.gpu_apps) with its GPU's index and whether it is servops'
    server: in the session the server leads (its TP workers are its children, never a session
    of their own). ours None: this /proc cannot see the pid (nvidia-smi reports pids of another
    pid namespace in a container)."""
    users = []
    for app in apps[:64]:
        fields = _proc_stat(app["pid"])
        users.append(dict(app, name=app["name"][:80], gpu=indexes.get(app["gpu_uuid"]),
                          ours=None if fields is None else bool(our_pid) and fields[3] == str(our_pid)))
    return users


def model_fact(path):
    if not path:
        return None
    expanded = os.path.expanduser(str(path))
    local = os.path.isabs(expanded) or str(path).startswith((".", "~")) or os.path.exists(expanded)
    if not local:
        # org/name: sglang resolves it through the model hub (or its cache) at load time
        return {"path": path, "state": "hub-id"}
    if os.path.isdir(expanded):
        config = os.path.join(expanded, "config.json")
        fact = {"path": path, "state": "dir", "config": os.path.isfile(config)}
        if fact["config"]:
            try:
                with open(config, encoding="utf-8") as fh:
                    archs = _json.load(fh).get("architectures")
                if isinstance(archs, list) and all(isinstance(a, str) for a in archs):
                    fact["architectures"] = archs[:8]
            except (OSError, ValueError, AttributeError):
                pass
        return fact
    if os.path.isfile(expanded):
        return {"path": path, "state": "file"}
    return {"path": path, "state": "missing"}
