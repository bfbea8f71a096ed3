# Shared helpers for servops' remote programs. Standard library only: this runs on the
# host's python (any 3.8+), before and without importing the packages being inspected.
# Modules only some programs need are imported where used: each program starts afresh.
import json
import os
import re
import sys
import sysconfig

# The runner prepends `_SERVOPS_ARGS = "<json>"` to the program, so arguments travel on stdin
# with the code: no argv length limit, and nothing (an env secret, say) visible in `ps`.
ARGS = json.loads(globals().get("_SERVOPS_ARGS", "{}"))


def reply(obj):
    sys.stdout.write(json.dumps(obj))
    sys.stdout.flush()


LAST_FAILURE = []  # the message of the last fail(), for a program that carries on (the host guard)


def fail(message):
    LAST_FAILURE[:] = [message]
    reply({"error": message})
    sys.exit(3)


_SITE_DIRS = []


def site_dirs():
    if not _SITE_DIRS:  # computed once: sysconfig expands every install path each call
        paths = sysconfig.get_paths()
        for key in ("purelib", "platlib"):
            d = os.path.realpath(paths[key])
            if d not in _SITE_DIRS and os.path.isdir(d):
                _SITE_DIRS.append(d)
    return list(_SITE_DIRS)


def inside(path, root):
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_in_site(rel, allow_outside=False, must_exist=True):
    """Map a path relative to site-packages to a real path; refuse escapes unless allowed."""
    if "\0" in rel:
        fail("file path contains a NUL byte")
    sites = site_dirs()
    if os.path.isabs(rel) or rel.startswith("~"):
        if not allow_outside:
            fail("absolute path %r: give a path relative to site-packages, or pass --allow-outside" % rel)
        path = os.path.realpath(os.path.expanduser(rel))
        if must_exist and not os.path.isfile(path):
            fail("no such file on the host: %s" % path)
        site = next((s for s in sites if inside(path, s)), None)
        return path, site
    for site in sites:
        path = os.path.realpath(os.path.join(site, rel))
        if not inside(path, site) and not allow_outside:
            fail("%r resolves outside site-packages (%s); pass --allow-outside to read it anyway" % (rel, site))
        if os.path.isfile(path) or not must_exist:
            return path, site
    fail("%s not found in site-packages of %s (%s)" % (rel, sys.executable, ", ".join(sites)))


def normalise_dist(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_infos(site):
    try:
        entries = os.listdir(site)
    except OSError:
        return []
    return sorted(os.path.join(site, e) for e in entries if e.endswith(".dist-info"))


def dist_meta(dist_info):
    name = version = None
    try:
        with open(os.path.join(dist_info, "METADATA"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Name:") and name is None:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("Version:") and version is None:
                    version = line.split(":", 1)[1].strip()
                elif not line.strip():
                    break
    except OSError:
        pass
    return {"name": name, "version": version, "dist_info": dist_info}


def find_dist(name, sites=None):
    want = normalise_dist(name)
    for site in sites or site_dirs():
        for di in dist_infos(site):
            meta = dist_meta(di)
            if meta["name"] and normalise_dist(meta["name"]) == want:
                meta["site"] = site
                return meta
    return None


def record_rows(dist_info):
    import csv
    try:
        with open(os.path.join(dist_info, "RECORD"), newline="", encoding="utf-8") as fh:
            return [row for row in csv.reader(fh) if row]
    except OSError:
        return []


def owner_of(rel_in_site, site):
    """The distribution whose RECORD lists this file, checking likely candidates first."""
    top = rel_in_site.split("/", 1)[0]
    infos = dist_infos(site)

    def top_levels(di):
        try:
            with open(os.path.join(di, "top_level.txt")) as fh:
                return {l.strip() for l in fh if l.strip()}
        except OSError:
            return set()

    ordered = sorted(infos, key=lambda di: top not in top_levels(di))
    # Paths with commas are csv-quoted in RECORD, so they are looked up both ways.
    prefixes = [p.encode("utf-8", "surrogateescape") for p in (rel_in_site + ",", '"%s",' % rel_in_site.replace('"', '""'))]
    for di in ordered:
        rest = record_line(di, prefixes)
        if rest is not None:
            meta = dist_meta(di)
            meta["record_hash"] = rest.split(",")[0].strip()
            return meta
    return None


def record_line(dist_info, prefixes):
    """The rest of RECORD's first line that starts with one of `prefixes` (bytes), or None.
    A search of the mapped file: csv-parsing every RECORD, or reading it line by line (13,000
    lines for flashinfer), would dominate inspect's remote time."""
    import mmap

    try:
        with open(os.path.join(dist_info, "RECORD"), "rb") as fh, \
                mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as record:
            hits = [(0, p) for p in prefixes if record[:len(p)] == p]
            hits += [(at + 1, p) for p in prefixes for at in (record.find(b"\n" + p),) if at >= 0]
            if not hits:
                return None
            start, prefix = min(hits)
            end = record.find(b"\n", start)
            return record[start + len(prefix):end if end >= 0 else len(record)].decode("utf-8", "replace")
    except (OSError, ValueError):  # unreadable, or empty (a 0-byte file cannot be mapped)
        return None


def file_hash(path):
    """As RECORD writes it: sha256=<urlsafe base64, unpadded> (binascii: no base64 module to load)."""
    import binascii
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    b64 = binascii.b2a_base64(h.digest(), newline=False).rstrip(b"=").translate(bytes.maketrans(b"+/", b"-_"))
    return "sha256=" + b64.decode()


def sha_bytes(data):
    """Content hash as patch state records it (None for an absent file)."""
    import hashlib

    return None if data is None else "sha256=" + hashlib.sha256(data).hexdigest()


def sha256_hex(path):
    try:
        with open(path, "rb") as fh:
            return sha_bytes(fh.read())
    except OSError:
        return None


def patch_state_root():
    """Where this python's patch state lives, keyed to the environment's REAL path, not to any
    inventory setting: inside the venv itself (shared by every inventory entry and operator that
    uses it), or for a python outside a venv, under ~/.servops/venvs/<hash of its site-packages>."""
    import hashlib

    if sys.prefix != getattr(sys, "base_prefix", sys.prefix):
        return os.path.join(os.path.realpath(sys.prefix), ".servops")
    site = site_dirs()[0]
    return os.path.join(os.path.expanduser("~/.servops/venvs"), hashlib.sha256(site.encode()).hexdigest()[:16])


def load_patch_state(root=None):
    try:
        with open(os.path.join(root or patch_state_root(), "state.json")) as fh:
            state = json.load(fh)
        if isinstance(state, dict) and isinstance(state.get("applied"), dict):
            return state
    except (OSError, ValueError):
        pass
    return {"version": 2, "applied": {}}


def dependents_path():
    return os.path.join(patch_state_root(), "dependents.json")


def read_dependents():
    """Deploy roots that made releases on this python (their patch set lives here)."""
    try:
        with open(dependents_path()) as fh:
            data = json.load(fh)
        return [r for r in data if isinstance(r, str)] if isinstance(data, dict) else []
    except (OSError, ValueError):
        return []


def register_dependent(root):
    roots = read_dependents()
    if root not in roots:
        os.makedirs(patch_state_root(), mode=0o700, exist_ok=True)
        replace_with(dependents_path(), json.dumps({r: True for r in roots + [root]}))


def patched_files(site=None):
    """rel path -> (servops patch name, hash the patch left the file with), per the patch state."""
    out = {}
    for name, rec in load_patch_state()["applied"].items():
        for rel, hashes in (rec.get("files") or {}).items():
            out[rel] = (name, hashes.get("after"))
    return out


def append_journal(path, entry):
    """Append one chained JSON line to a host journal (0600; servops.remote.jsonl): programs that
    write the journal include that library."""
    import time as _time
    entry = dict(entry)
    entry.setdefault("at", _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime()))
    path = os.path.expanduser(path)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    return append_entry(path, entry)


def local_urlopen(target, timeout):
    """urlopen for the server on this host (http://127.0.0.1:PORT), never through a proxy. GPU
    hosts often carry http_proxy (/etc/environment, or the inventory's env for the engine's
    downloads) with a no_proxy that lacks 127.0.0.1; urllib would then send the health gate, the
    first request and the /metrics scrape to a proxy that cannot reach this host's loopback."""
    import urllib.request
    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(target, timeout=timeout)


def replace_with(path, data, mode=0o600, tmp=None):
    """Make `path` hold `data` (bytes or text): a synced temp file renamed over it, so a reader
    sees the old or the new content, never half; the temp file goes if anything fails."""
    tmp = tmp or "%s.tmp-%d" % (path, os.getpid())
    if isinstance(data, str):
        data = data.encode()
    try:
        if os.path.lexists(tmp):  # a leftover of a killed run, or something planted: never written through
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def open_private(path, flags, mode=0o600):
    """os.open for a file servops owns (a journal, a log, a marker): never through a symlink, so
    one planted in its place (by a compromised server, say) cannot point servops' writes at
    another file. The error names the file."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if os.path.islink(path):
            fail("%s is a symlink (to %s); servops does not write through it: remove it"
                 % (path, os.readlink(path)))
        raise
