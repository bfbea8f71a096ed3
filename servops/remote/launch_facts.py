# Facts a launch needs on the host, whatever the engine: the model path, the port, the GPUs,
# and stdout kept clean while an engine is imported. Included by launch_check (sglang) and
# launch_check_vllm, after _common, procs and jsonl.
import shutil


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
    stops. nvidia-smi's output is decoded with replacement (a process name is any bytes), and an
    nvidia-smi that hangs is ended at its deadline: {"count": None, "error": why}."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        code, out, err = run_command_with_deadline([smi, "-L"], SMI_DEADLINE)
    except (OSError, DeadlineExceeded) as exc:
        return {"count": None, "error": "nvidia-smi -L: %s" % exc}
    listing = out.decode("utf-8", "replace")
    if code != 0:
        return {"count": None, "error": "nvidia-smi -L exited %d: %s" % (
            code, (err.decode("utf-8", "replace") or listing).strip()[:200])}
    names = [l.strip()[:200] for l in listing.splitlines() if l.strip().startswith("GPU ")]
    fact = {"count": len(names), "names": names[:16]}
    if root is not None:
        apps = gpu_apps()
        if apps is None or "error" in apps:
            fact["users_error"] = (apps or {}).get("error") or "nvidia-smi --query-compute-apps gave no answer"
        else:
            ours = our_server(root)
            fact["users"] = gpu_users(apps["apps"], gpu_indexes(listing), ours and ours["pid"])
            if apps["skipped"]:  # said, never fatal: a foreign process's row cannot refuse a deploy
                fact["users_skipped"] = {"count": len(apps["skipped"]), "rows": apps["skipped"][:3]}
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
        users.append(dict(app, name=app["name"][:80], gpu_uuid=app["gpu_uuid"][:80], gpu=indexes.get(app["gpu_uuid"]),
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
                archs = read_config_json(config).get("architectures")  # bounded: never a huge file whole
                if isinstance(archs, list) and all(isinstance(a, str) for a in archs):
                    fact["architectures"] = [a[:200] for a in archs[:8]]
            except (OSError, FileProblem, AttributeError):
                pass
        return fact
    if os.path.isfile(expanded):
        return {"path": path, "state": "file"}
    return {"path": path, "state": "missing"}
