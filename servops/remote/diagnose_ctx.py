# diagnose on the host: read a release's server.log (or the log sent along), find its failures
# (logscan.py + tracebacks.py, above this file in the program), and resolve every frame to this
# host's own file: source context, owning distribution and version, servops patch marks, RECORD
# drift, and whether the source line the log shows is the code this host has. One round trip.
# Only files inside this python's site-packages and stdlib are read, unless allow_outside.
MAX_LOG = 16 << 20          # read at most the last 16 MiB of a log
MAX_CONTEXT_FINDINGS = 20   # findings whose frames get source context
_RELEASE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def release_meta(rel_dir, name):
    """A release's release.json (its status, variant, engine), {} where unreadable."""
    try:
        with open(os.path.join(rel_dir, name, "release.json")) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def release_status(rel_dir, name):
    return release_meta(rel_dir, name).get("status")


def pick_release(root, name):
    """(name, status, why). Without a name: after an automatic rollback `current` is healthy
    again, so the newest release after it that failed is the one to explain."""
    rel_dir = os.path.join(root, "releases")
    if name:
        if not _RELEASE_NAME.match(name) or ".." in name:
            fail("--release %r: give a release name as listed by `invoke releases`, not a path" % name)
        if not os.path.isdir(os.path.join(rel_dir, name)):
            fail("no release %s under %s (see invoke releases)" % (name, rel_dir))
        return name, release_status(rel_dir, name), "as asked"
    try:
        names = sorted(n for n in os.listdir(rel_dir) if os.path.isdir(os.path.join(rel_dir, n)))
    except OSError:
        names = []
    if not names:
        fail("no release deployed under %s; pass --release or --log" % root)
    try:
        current = os.path.basename(os.readlink(os.path.join(root, "current")))
    except OSError:
        current = None
    newer = names[names.index(current) + 1:] if current in names else names
    failed = [n for n in newer if release_status(rel_dir, n) == "failed"]
    if failed:
        why = "most recent failed release" + (" (current is %s)" % current if current else "")
        return failed[-1], "failed", why
    if current in names:
        return current, release_status(rel_dir, current), "current release"
    return names[-1], release_status(rel_dir, names[-1]), "newest release"


def read_log(path):
    try:
        with open(path, "rb") as fh:
            data, cut = read_tail(fh, os.fstat(fh.fileno()).st_size, MAX_LOG)
    except OSError as exc:
        fail("cannot read %s: %s" % (path, exc.strerror or exc))
    return data.decode("utf-8", "replace"), cut


_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"])


class Resolver(object):
    """A frame's file on this host, found by its path below site-packages, the stdlib, or a
    package root (`/sgl-workspace/sglang/python/sglang/srt/x.py` -> sglang/srt/x.py)."""

    def __init__(self, allow_outside):
        self.sites = site_dirs()
        self.allow_outside = allow_outside
        self.tops = set()
        for site in self.sites:
            try:
                self.tops.update(e for e in os.listdir(site) if not e.endswith((".dist-info", ".egg-info", ".pth")))
            except OSError:
                pass
        self.cache = {}

    def _in_site(self, rel):
        for site in self.sites:
            cand = os.path.realpath(os.path.join(site, rel))
            if inside(cand, site) and os.path.isfile(cand):
                return cand, site
        return None

    def locate(self, path):
        """{"host_path", "site", "rel", "how"} or {"outside": True} or None."""
        if path in self.cache:
            return self.cache[path]
        self.cache[path] = out = self._locate(path)
        return out

    def _locate(self, path):
        if not path or path.startswith("<"):
            return None
        p = path.replace("\\", "/")
        for marker in ("/site-packages/", "/dist-packages/"):
            if marker in p:
                hit = self._in_site(p.rsplit(marker, 1)[1])
                if hit:
                    return {"host_path": hit[0], "site": hit[1], "rel": os.path.relpath(hit[0], hit[1]), "how": "site"}
        m = re.search(r"/lib(?:64)?/python3\.\d+/(?!site-packages/|dist-packages/)(.+)$", p)
        if m:
            cand = os.path.realpath(os.path.join(_STDLIB, m.group(1)))
            if inside(cand, _STDLIB) and os.path.isfile(cand):
                return {"host_path": cand, "site": None, "rel": None, "how": "stdlib"}
        segs = [s for s in p.split("/") if s]
        for i in range(len(segs) - 1):
            if segs[i] in self.tops:
                hit = self._in_site("/".join(segs[i:]))
                if hit:
                    return {"host_path": hit[0], "site": hit[1], "rel": os.path.relpath(hit[0], hit[1]),
                            "how": "package root"}
        if os.path.isabs(path) and os.path.isfile(path):
            if self.allow_outside:
                return {"host_path": os.path.realpath(path), "site": None, "rel": None, "how": "as is"}
            return {"outside": True}
        return None


def _norm(code):
    return " ".join(code.split())


def resolve_frames(frames, resolver, files, patched, ctx):
    for frame in frames:
        where = resolver.locate(frame["path"])
        if not where:
            continue
        if where.get("outside"):
            frame["outside"] = True
            continue
        real = where["host_path"]
        if real not in files:
            try:
                with open(real, encoding="utf-8", errors="replace") as fh:
                    lines = fh.read().splitlines()
            except OSError:
                continue
            info = {"lines": lines, "rel": where["rel"], "how": where["how"], "modified": False, "dist": None,
                    "version": None, "patch": None, "patch_drift": False}
            mark = patched.get(where["rel"]) if where["rel"] else None
            if mark:
                # patched_files() (in _common) gives (patch name, hash the patch left the file with)
                name, after = mark if isinstance(mark, (tuple, list)) else (mark, None)
                info["patch"] = name
                info["patch_drift"] = bool(after) and sha256_hex(real) != after
            if where["rel"]:
                owner = owner_of(where["rel"], where["site"])
                if owner:
                    info["dist"], info["version"] = owner["name"], owner["version"]
                    # a patched file differs from RECORD by design: drift is judged against the patch
                    info["modified"] = (not info["patch"] and bool(owner.get("record_hash"))
                                        and owner["record_hash"] != file_hash(real))
            files[real] = info
        info = files[real]
        frame["host_path"] = real
        for key in ("rel", "how", "dist", "version", "patch", "patch_drift", "modified"):
            frame[key] = info[key]
        lines = info["lines"]
        n = frame["line"]
        if frame.get("code"):
            host_line = lines[n - 1] if 0 < n <= len(lines) else ""
            frame["same_code"] = _norm(host_line) == _norm(frame["code"])
            if not frame["same_code"]:
                want = _norm(frame["code"])
                found = [k + 1 for k, line in enumerate(lines) if _norm(line) == want]
                frame["moved_to"] = min(found, key=lambda k: abs(k - n)) if found else None
        if ctx is not None:
            at = frame.get("moved_to") or n
            lo, hi = max(1, at - ctx), min(len(lines), at + ctx)
            frame["source"] = {"start": lo, "lines": lines[lo - 1:hi], "at": at}


def finding_frames(f):
    frames = []
    for exc in f["chain"]:
        frames.extend(exc["frames"])
        frames.extend(exc["user_frames"])
    if f.get("fatal"):
        for t in f["fatal"]["threads"]:
            frames.extend(t["frames"])
    return frames


def main():
    out = {"site": site_dirs(), "python": sys.version.split()[0]}
    if ARGS.get("log_text") is not None:
        text, truncated = ARGS["log_text"], bool(ARGS.get("log_truncated"))
        out["source"] = ARGS.get("log_name") or "local file"
    else:
        root = os.path.realpath(os.path.expanduser(ARGS["deploy_root"]))
        name, status, why = pick_release(root, ARGS.get("release"))
        meta = release_meta(os.path.join(root, "releases"), name)
        # what the next step depends on: the failed release's variant and engine (sglang's releases
        # record none), the host's installed engines
        out.update(release=name, release_status=status, why=why, release_variant=meta.get("variant"),
                   release_engine=meta.get("engine") or ("sglang" if meta.get("variant") else None))
        out["source"] = os.path.join(root, "releases", name, "server.log")
        if not os.path.isfile(out["source"]):
            fail("release %s has no server.log (%s)" % (name, out["source"]))
        text, truncated = read_log(out["source"])
    out["truncated"] = truncated
    out["versions"] = {name: (find_dist(name) or {}).get("version") for name in ("sglang", "vllm")}
    result = scan(text)
    resolver = Resolver(bool(ARGS.get("allow_outside")))
    patched = patched_files()
    files = {}
    ctx = int(ARGS.get("context", 3))
    for k, f in enumerate(result["findings"]):
        resolve_frames(finding_frames(f), resolver, files, patched, ctx if k < MAX_CONTEXT_FINDINGS else None)
    out["scan"] = result
    reply(out)


main()
