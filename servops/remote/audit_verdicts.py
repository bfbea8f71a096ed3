# audit_verdicts: what an audit round found, kept on the host by what decides it, so that a deploy
# of a launch audited before is not audited again (on an H100 an 8B launch's rounds took 45-150 s
# before every deploy of it). The key is a digest of everything the round's outcome follows from:
# the launch (module, argv with the audit's placeholders, env), the fix set's texts, the shim and the
# files served beside the launch, the model's config, the GPUs' model, the python, every installed
# distribution (name, its RECORD's size and times: a reinstall changes them) and every file of the
# engine's own packages but its bytecode (size, mtime and ctime: a hand edit changes them, and one
# that puts the mtime back with `touch -r` still moves the ctime, which no user can set). Only an outcome that follows from
# those is kept: healthy (every size captured) or a dynamo break; never a crash, a timeout or a flood.
# Standard library only: a library of audit_compile.py, importable as servops.remote.audit_verdicts.
import hashlib
import importlib.util
import json
import os
import sys
import time

MAX_VERDICTS = 64                 # kept per host, the oldest dropped
MAX_VERDICTS_BYTES = 8 << 20      # the file; a verdict that would pass it is not kept
MAX_PACKAGE_FILES = 200000        # files stat'ed per engine package (sglang has ~9,000)


def _feed(h, obj):
    h.update(json.dumps(obj, sort_keys=True, default=str).encode("utf-8", "surrogateescape"))
    h.update(b"\0")


def installed_fingerprint(h, sites, packages):
    """Every distribution of the python (its RECORD's stat) and every file of the engine's packages
    (size, mtime, ctime), fed into `h`."""
    for site in sites:
        try:
            names = sorted(n for n in os.listdir(site) if n.endswith(".dist-info"))
        except OSError:
            continue
        for name in names:
            try:
                st = os.stat(os.path.join(site, name, "RECORD"))
                _feed(h, [site, name, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
            except OSError:
                _feed(h, [site, name, None])
    for package in packages:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        roots = list(spec.submodule_search_locations or []) if spec and spec.submodule_search_locations else \
            ([spec.origin] if spec and spec.origin else [])
        seen = 0
        for root in roots:
            if os.path.isfile(root):
                st = os.stat(root)
                _feed(h, [package, root, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
                continue
            for dirpath, dirnames, filenames in os.walk(root):
                # bytecode is written by whoever imports first (the audit server itself): not an input
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
                for f in sorted(n for n in filenames if not n.endswith((".pyc", ".pyo"))):
                    seen += 1
                    if seen > MAX_PACKAGE_FILES:
                        _feed(h, [package, "more files", time.time()])  # too many to vouch for: no reuse
                        return
                    try:
                        st = os.lstat(os.path.join(dirpath, f))
                    except OSError:
                        continue
                    _feed(h, [os.path.relpath(os.path.join(dirpath, f), root), st.st_size, st.st_mtime_ns,
                           st.st_ctime_ns])


def verdict_key(inputs, sites, packages):
    """The digest of a round's inputs (a JSON-able dict) and of the installation it runs on."""
    h = hashlib.sha256()
    _feed(h, {"inputs": inputs, "python": sys.executable})
    installed_fingerprint(h, sites, packages)
    return h.hexdigest()


def _read(path):
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_VERDICTS_BYTES + 1)
    except OSError:
        return {}
    if len(data) > MAX_VERDICTS_BYTES:
        return {}
    try:
        entries = json.loads(data.decode("utf-8")).get("entries")
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
        return {}  # a damaged file is no verdict: the round runs, and the file is written anew
    return entries if isinstance(entries, dict) else {}


def lookup(path, key):
    """The kept verdict for `key`: {at, state, captured, breaks, elapsed_s}; None where there is none."""
    entry = _read(path).get(key)
    if not (isinstance(entry, dict) and entry.get("state") in ("healthy", "broke")
            and isinstance(entry.get("captured"), list) and isinstance(entry.get("breaks"), list)):
        return None
    return entry


def keepable(result):
    """Does this round's outcome follow from its inputs alone (healthy, or a dynamo break)?"""
    return (result.get("state") == "healthy" and not result.get("breaks")) or bool(result.get("breaks"))


def record(path, key, result, replace_with):
    """Keep the round's verdict under `key` (the newest MAX_VERDICTS; a file past its bound is not
    written). replace_with: _common's atomic writer."""
    entries = _read(path)
    entries[key] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "state": "healthy" if result.get("state") == "healthy" and not result.get("breaks") else "broke",
                    "captured": list(result.get("captured") or []), "breaks": list(result.get("breaks") or []),
                    "elapsed_s": result.get("elapsed_s")}
    newest = sorted(entries.items(), key=lambda kv: str(kv[1].get("at") if isinstance(kv[1], dict) else ""))
    data = json.dumps({"entries": dict(newest[-MAX_VERDICTS:])}, sort_keys=True)
    if len(data) > MAX_VERDICTS_BYTES:
        return False
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    replace_with(path, data)
    return True
