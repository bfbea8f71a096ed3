# audit_compile: the engine's own compile and capture pass for a variant, on a shrunk copy of
# the host's model, in a child server beside the serving one (ARGS["op"] == "audit"); and the
# probe of one engine function for a synthesised custom op (ARGS["op"] == "probe").
#
# The audit server is the release's own launch (the engine's module, the variant's resolved flags
# and capture sizes) with what keeps it small and apart overridden: the model is a copy of the
# host's config with the fewest layers that keep every layer kind (tokenizer files linked, no
# weights: dummy load), a small memory fraction, a free port on 127.0.0.1, its own session. The
# fix set's files are served to it from patched copies (audit_shim.py, as its sitecustomize),
# so the host's site-packages are never written and the serving server sees nothing of it.
# Every dynamo break the capture meets is recorded by the shim with the chain of calls and the
# arguments dynamo saw. Healthy means every prefill size was compiled and captured.
import shutil
import signal
import socket
import subprocess
import tempfile
import time

MAX_LOG_TAIL = 200                # lines of the audit server's log in the reply
MAX_BREAKS = 50                   # break records read back (a graph-breaking engine repeats them)
PROOF_DEADLINE_S = 1800           # every captured size's prefill compared, within this
MAX_SERVER_LOG = 1 << 30          # an audit server logging past this is ended (the host's disk is the serving one's)


# ---- the fix set, as patched copies the shim serves ----------------------------------------------

def patched_copies(patches, work):
    """{real path: copy path}: each file the patches touch, copied and patched with patch(1) in
    order. A patch already applied on the host (its reverse applies) leaves its files as they are."""
    overlay, refusals = {}, []
    tree = os.path.join(work, "overlay")
    for spec in patches:
        files = []
        for rel in spec["files"]:
            real = resolve_in_site(rel)[0]
            copy = overlay.get(real) or os.path.join(tree, rel)
            if real not in overlay:
                os.makedirs(os.path.dirname(copy), exist_ok=True)
                shutil.copyfile(real, copy)
                overlay[real] = copy
            files.append(rel)
        common = ["patch", "-p%d" % spec.get("strip", 1), "-F0", "-N", "-s", "-d", tree]
        text = spec["text"].encode()
        if subprocess.run(common + ["--dry-run"], input=text, capture_output=True).returncode == 0:
            subprocess.run(common, input=text, capture_output=True, check=True)
        elif subprocess.run(common + ["-R", "--dry-run"], input=text, capture_output=True).returncode != 0:
            refusals.append("%s does not apply to the host's %s" % (spec["name"], ", ".join(files)))
    return overlay, refusals


# ---- the GPUs' free memory --------------------------------------------------------------------

def gpu_memory(deadline_s=20):
    """[{index, total_mib, free_mib, model}] from nvidia-smi; None where it is absent or gives no
    answer. The model (its name, the last column: a name may hold a comma) is part of a round's key."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=index,memory.total,memory.free,name", "--format=csv,noheader,nounits"],
                             capture_output=True, timeout=deadline_s)
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.stdout.decode("utf-8", "replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and all(p.isdigit() for p in parts[:3]):
            gpus.append({"index": int(parts[0]), "total_mib": int(parts[1]), "free_mib": int(parts[2]),
                         "model": ", ".join(parts[3:]) or None})
    return gpus or None


# ---- the audit server ---------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(port, path, body=None, timeout=10):
    import urllib.request
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    with local_urlopen(req, timeout) as r:
        return r.status, r.read(8 << 20)


def session_pids(sid):
    return [pid for pid, facts in process_table().items() if facts["sid"] == sid]


def end_session(proc, grace=10):
    """The audit server and every process of its session: SIGTERM, then SIGKILL after `grace`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(proc.pid) or ([proc.pid] if proc.poll() is None else []):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (proc.poll() is None or session_pids(proc.pid)):
            time.sleep(0.2)
        if proc.poll() is not None and not session_pids(proc.pid):
            return True
    proc.wait(timeout=5)
    return not session_pids(proc.pid)


def read_breaks(work):
    records = []
    try:
        with open(os.path.join(work, "breaks.jsonl"), "rb") as f:
            for _ in range(MAX_BREAKS * 4):  # lines read, each at most 1 MiB (a record is a few kB)
                line = f.readline(1 << 20)
                if not line or len(records) >= MAX_BREAKS:
                    break
                try:
                    record = json.loads(line.decode("utf-8", "replace"))
                except (ValueError, RecursionError):
                    continue
                if isinstance(record, dict):
                    records.append(record)
    except OSError:
        pass
    return records


def captured_sizes(path, max_bytes=64 << 20):
    """The prefill sizes the engine logged capturing (sglang's tqdm description "Capturing num
    tokens (num_tokens=N ...)", rewritten in place with carriage returns)."""
    import re
    sizes = set()
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes)
    except OSError:
        return []
    for m in re.finditer(rb"num_tokens=(\d{1,7})(?!\d)", data):  # (num_tokens=123456789 is no size 1234567)
        sizes.add(int(m.group(1)))
    return sorted(sizes)


def log_tail(path, lines=MAX_LOG_TAIL, max_bytes=256 * 1024):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line[:2000] for line in text.splitlines()[-lines:]]


def prefill_logprobs(port, lengths, vocab, timeout, deadline_s=PROOF_DEADLINE_S):
    """The prefill's input_token_logprobs at each length (sglang's /generate), or why not. Each
    length's prompt starts differently, so no request reuses another's cached prefix. Past the
    proof's deadline (a capture list of 10^5 sizes) each size left says so: not compared is not equal."""
    out = {}
    deadline = time.monotonic() + deadline_s
    for n in lengths:
        if time.monotonic() > deadline:
            out[str(n)] = {"error": "not compared: the proof's %d s were spent on the sizes before it" % deadline_s}
            continue
        ids = [(7919 * i + 131 * n + 13) % max(vocab - 20, 1) + 10 for i in range(n)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True, "logprob_start_len": 0}
        try:
            status, data = http_json(port, "/generate", body, timeout=timeout)
            meta = json.loads(data.decode()).get("meta_info") or {}
            out[str(n)] = [row[0] for row in meta.get("input_token_logprobs") or []]
        except Exception as exc:  # noqa: BLE001 - a size the server would not answer: that size says why
            out[str(n)] = {"error": "%s: %s" % (type(exc).__name__, str(exc)[:300])}
    return out


def work_dir(prefix):
    sweep_audit_leftovers()
    work = tempfile.mkdtemp(prefix=prefix)
    os.chmod(work, 0o700)
    with open(os.path.join(work, "owner"), "w") as f:
        f.write("%d %s" % (os.getpid(), proc_starttime(os.getpid())))
    return work


def round_key(launch, config, gpus):
    """The key this round's verdict is kept under (None: none is kept: no verdicts file given)."""
    if not ARGS.get("verdicts"):
        return None
    inputs = {"launch": launch, "config": config, "patches": ARGS.get("patches") or [], "shim": ARGS.get("shim"),
              "files": ARGS.get("server_files") or {}, "device": ARGS.get("device", "cuda"),
              "gpus_needed": ARGS.get("gpus_needed"),
              "gpus": [(g["model"], g["total_mib"]) for g in gpus or []]}
    return verdict_key(inputs, site_dirs(), ARGS.get("packages") or [])


def reply_kept(started, key, gpus):
    """Reply with the kept verdict of this round's key, where reuse is asked and one is kept (a
    proof round always runs: it needs the server's logprobs). True: replied."""
    if not key or not ARGS.get("reuse") or ARGS.get("compare"):
        return False
    kept = lookup(ARGS["verdicts"], key)
    if not kept:
        return False
    result = {"state": kept["state"], "exit_code": None, "gpus": gpus, "captured": kept["captured"],
              "breaks": kept["breaks"], "log_tail": [], "elapsed_s": round(time.monotonic() - started, 2),
              "kept": {"at": kept.get("at"), "elapsed_s": kept.get("elapsed_s")}}
    journal_round(result, " (as the audit of the same launch at %s found: not run again)" % kept.get("at"))
    reply(result)
    return True


def journal_round(result, note=""):
    """The round's entry in the host's journal (a problem writing it is said in the reply)."""
    if not ARGS.get("journal"):
        return
    breaks = result["breaks"]
    try:
        append_journal(ARGS["journal"], dict(ARGS.get("journal_entry") or {}, outcome=result["state"], detail=(
            "%d break(s): %s" % (len(breaks), str(breaks[0].get("message") or "").strip().split("\n")[0][:200])
            if breaks else "%d prefill size(s) compiled and captured" % len(result["captured"])) + note))
    except (OSError, ValueError, FileProblem) as exc:  # the audit's answer is not lost to its journal
        result["journal_problem"] = "journal %s not written: %s" % (ARGS["journal"], exc)


def run_audit():
    started = time.monotonic()
    launch = ARGS["launch"]
    config, why = read_config(ARGS["model_path"])
    if config is None:
        reply({"state": "not-audited", "why": why})
        return
    wanted = int(ARGS.get("gpus_needed") or 1)
    fraction, overhead = float(ARGS.get("mem_fraction") or 0.05), int(ARGS.get("overhead_mib") or 3072)
    gpus, mem = None, "%g" % fraction
    if ARGS.get("device", "cuda") == "cuda":
        gpus = gpu_memory()
        if not gpus:
            reply({"state": "not-audited", "why": "no GPU on this host (nvidia-smi absent or silent): the engine's "
                   "capture runs on %d GPU(s) with %.0f%% of each one's memory plus ~%d MiB" % (
                       wanted, fraction * 100, overhead)})
            return
    key = round_key(launch, config, gpus)
    if reply_kept(started, key, gpus):
        return  # the same launch's verdict, kept: no server to start, whatever memory is free now
    if gpus:
        shrunk, shrink_info = shrink_config(config)
        weights = shrunk_weight_bytes(ARGS["model_path"], shrink_info["kept"]) if shrunk else None
        sized = audit_memory(gpus[:wanted], fraction, overhead, launch.get("mem_of") or "total",
                             None if weights is None else weights / wanted / (1 << 20))
        if sized["short"] or len(gpus) < wanted:
            reply({"state": "not-audited", "gpus": gpus,
                   "why": "too little free GPU memory: the audit needs %d GPU(s) with %s; %s" % (
                       wanted, ", ".join("%d MiB free on GPU %d (it has %d)" % (sized["need_mib"], g["index"],
                                                                                 g["free_mib"])
                                         for g in (sized["short"] or gpus)[:8]),
                       "free memory, or set audit_mem_fraction lower" if sized["short"] else
                       "the host has %d" % len(gpus))})
            return
        mem = sized["value"]
    work = work_dir("servops-audit-")
    proc = None
    try:
        model, info = shrunk_model(ARGS["model_path"], config, work)
        if model is None:
            reply({"state": "not-audited", "why": info})
            return
        overlay, refusals = patched_copies(ARGS.get("patches") or [], work)
        if refusals:
            reply({"state": "not-audited", "why": "; ".join(refusals)})
            return
        with open(os.path.join(work, "overlay.json"), "w") as f:
            json.dump(overlay, f)
        with open(os.path.join(work, "sitecustomize.py"), "w") as f:
            f.write(ARGS["shim"])
        for name, text in (ARGS.get("server_files") or {}).items():
            with open(os.path.join(work, os.path.basename(name)), "w") as f:
                f.write(text)
        port = free_port()
        argv = [{"{SERVOPS_AUDIT_MODEL}": model, "{SERVOPS_AUDIT_PORT}": str(port),
                 "{SERVOPS_AUDIT_MEM}": mem}.get(a, a) for a in launch["argv"]]
        env = dict(os.environ)
        env.update(launch.get("env") or {})
        env["PYTHONPATH"] = work + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["SERVOPS_AUDIT_DIR"] = work
        env["PYTHONUNBUFFERED"] = "1"
        log_path = os.path.join(work, "server.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", launch["module"]] + argv, cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        deadline = time.monotonic() + float(ARGS.get("timeout_s") or 900)
        state, broke_at = "timeout", None
        health = launch.get("health") or "/health"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                state = "exited"
                break
            if os.path.getsize(log_path) > int(ARGS.get("max_log_bytes") or MAX_SERVER_LOG):
                state = "flooded its log"
                break
            if read_breaks(work):
                broke_at = broke_at or time.monotonic()
                if time.monotonic() - broke_at > float(ARGS.get("after_break_s") or 30):
                    state = "broke"  # the engine did not end on its own: enough was seen
                    break
            try:
                if http_json(port, health, timeout=3)[0] == 200:
                    state = "healthy"
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(1)
        result = {"state": state, "exit_code": proc.poll(), "port": port, "shrunk": info, "gpus": gpus,
                  "argv": argv, "overlay": sorted(overlay), "captured": captured_sizes(log_path)}
        compare = ARGS.get("compare")
        if state == "healthy" and compare:
            lengths = result["captured"] if compare["lengths"] == "captured" else compare["lengths"]
            text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
            vocab = _int(text.get("vocab_size"), 32000)
            # a prompt and its one new token must fit the context the server was given
            longest = _int(compare.get("context_length") or text.get("max_position_embeddings"), 1 << 30) - 1
            result["logprobs"] = prefill_logprobs(port, [n for n in lengths if 2 <= n <= longest], vocab,
                                                  float(compare.get("timeout_s") or 60),
                                                  float(compare.get("deadline_s") or PROOF_DEADLINE_S))
            result["compare_skipped"] = [n for n in lengths if n > longest]
        result["ended"] = end_session(proc)
        result["breaks"] = read_breaks(work)
        result["log_tail"] = log_tail(log_path)
        result["elapsed_s"] = round(time.monotonic() - started, 2)
        if key and keepable(result):
            try:
                record(ARGS["verdicts"], key, result, replace_with)
            except OSError as exc:  # the audit's answer is not lost to its cache
                result["journal_problem"] = "audit verdicts %s not written: %s" % (ARGS["verdicts"], exc)
        journal_round(result)
        reply(result)
    finally:
        if proc is not None and proc.poll() is None:
            end_session(proc, grace=3)
        if not ARGS.get("keep"):
            shutil.rmtree(work, ignore_errors=True)


# ---- the probe ----------------------------------------------------------------------------------

def where_defined(path):
    """The function's file as a patch names it: relative to site-packages, its distribution and
    version, and the last lines a diff that appends to it needs as context."""
    real = os.path.realpath(path)
    site = next((s for s in site_dirs() if inside(real, s)), None)
    if site is None:
        return {"outside_site": real}
    rel = real[len(site.rstrip(os.sep)) + 1:]
    owner = owner_of(rel, site) or {}
    with open(real, "rb") as f:
        data = f.read()
    text = data.decode("utf-8", "surrogateescape")
    lines = text.splitlines()
    return {"rel": rel, "dist": owner.get("name"), "dist_version": owner.get("version"), "line_count": len(lines),
            "tail": lines[-3:], "ends_with_newline": data.endswith(b"\n"), "sha256": sha_bytes(data)}


MAX_PROBE_OUTPUT = 64 << 20       # what a probe (the host's function, called) may print before it is ended


def watch_probe(proc, paths, timeout_s):
    """Wait for the probe; why it was ended (None: it exited): its deadline, or output past
    MAX_PROBE_OUTPUT (a function that prints without end must not fill the host's disk)."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return "did not end in %s s" % ARGS.get("timeout_s", 300)
        if sum(os.path.getsize(p) for p in paths) > MAX_PROBE_OUTPUT:
            return "printed more than %d MiB: ended" % (MAX_PROBE_OUTPUT >> 20)
        time.sleep(0.1)
    return None


def file_tail(path, max_bytes=1 << 20):
    """The last MiB of a file (the probe's answer is its last line)."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - max_bytes))
        return f.read()


def run_probe():
    work = work_dir("servops-probe-")
    try:
        overlay, refusals = patched_copies(ARGS.get("patches") or [], work)
        if refusals:
            fail("; ".join(refusals))
        with open(os.path.join(work, "overlay.json"), "w") as f:
            json.dump(overlay, f)
        shim = os.path.join(work, "audit_shim.py")
        with open(shim, "w") as f:
            f.write(ARGS["shim"])
        request = os.path.join(work, "request.json")
        with open(request, "w") as f:
            json.dump(ARGS["request"], f)
        env = dict(os.environ)
        env.update(ARGS.get("env") or {})
        env["SERVOPS_AUDIT_DIR"] = work
        out_path, err_path = os.path.join(work, "probe.out"), os.path.join(work, "probe.err")
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            proc = subprocess.Popen([sys.executable, shim, "probe", request], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, start_new_session=True)
        why = watch_probe(proc, [out_path, err_path], float(ARGS.get("timeout_s") or 300))
        end_session(proc, grace=3)  # its session too: a worker it forked holds nothing open past it
        if why:
            fail("the probe of %s %s" % (ARGS["request"]["qualname"], why))
        out, err = file_tail(out_path), file_tail(err_path)
        lines = out.decode("utf-8", "replace").strip().splitlines()
        try:
            data = json.loads(lines[-1])
        except (ValueError, IndexError):
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
            fail("the probe ended without an answer (exit %s): %s" % (proc.returncode, tail[0][:500]))
        if "file" in data:
            data.update(where_defined(data["file"]))
        reply(data)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if ARGS.get("op") == "probe":
    run_probe()
else:
    run_audit()
