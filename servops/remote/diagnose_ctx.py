def locate(path):
    """A frame's file on this host: as is, else by its path below site-packages / the stdlib."""
    if os.path.isfile(path):
        return os.path.realpath(path)
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            rel = path.split(marker, 1)[1]
            for site in site_dirs():
                cand = os.path.join(site, rel)
                if os.path.isfile(cand):
                    return os.path.realpath(cand)
    m = re.search(r"/lib/python3\.\d+/(.+)$", path)
    if m:
        cand = os.path.join(sysconfig.get_paths()["stdlib"], m.group(1))
        if os.path.isfile(cand):
            return os.path.realpath(cand)
    return None


def patched_files():
    """rel path -> servops patch name, from this venv's patch state."""
    sites = site_dirs()
    venv_id = hashlib.sha256(sites[0].encode()).hexdigest()[:12]
    path = os.path.join(os.path.expanduser(ARGS["state_dir"]), "patches", venv_id, "state.json")
    try:
        with open(path) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return {}
    return {rel: name for name, rec in state.get("applied", {}).items() for rel in rec.get("files", {})}


def main():
    if ARGS.get("log_text") is not None:
        text, source = ARGS["log_text"], "local file"
    else:
        root = os.path.realpath(os.path.expanduser(ARGS["deploy_root"]))
        name = ARGS.get("release")
        if not name:
            try:
                name = os.path.basename(os.readlink(os.path.join(root, "current")))
            except OSError:
                fail("no release deployed under %s; pass --release or --log" % root)
        source = os.path.join(root, "releases", name, "server.log")
        try:
            with open(source, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError:
            fail("cannot read %s" % source)
    tbs = extract_tracebacks(text)
    ctx = int(ARGS.get("context", 3))
    patched = patched_files()
    cache = {}
    for tb in tbs:
        for frame in tb["frames"] + tb["user_frames"]:
            real = locate(frame["path"])
            frame["host_path"] = real
            if not real:
                continue
            if real not in cache:
                with open(real, encoding="utf-8", errors="replace") as fh:
                    lines = fh.read().splitlines()
                site = next((s for s in site_dirs() if inside(real, s)), None)
                rel = os.path.relpath(real, site) if site else None
                info = {"lines": lines, "rel": rel, "patch": patched.get(rel) if rel else None, "modified": False}
                if rel:
                    owner = owner_of(rel, site)
                    if owner:
                        info["dist"] = "%s %s" % (owner["name"], owner["version"])
                        info["modified"] = bool(owner.get("record_hash")) and owner["record_hash"] != file_hash(real)
                cache[real] = info
            info = cache[real]
            lo = max(1, frame["line"] - ctx)
            hi = min(len(info["lines"]), frame["line"] + ctx)
            frame["source"] = {"start": lo, "lines": info["lines"][lo - 1:hi]}
            for key in ("rel", "patch", "modified", "dist"):
                frame[key] = info.get(key)
    reply({"site": site_dirs(), "source": source, "tracebacks": tbs})


main()
