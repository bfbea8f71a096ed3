def verify(dist):
    meta = find_dist(dist)
    if meta is None:
        fail("distribution %r is not installed in %s" % (dist, sys.executable))
    site = meta["site"]
    expected_patches = patched_files(site)
    modified, missing, patched, outside, checked = [], [], [], [], 0
    for row in record_rows(meta["dist_info"]):
        rel = row[0]
        expected = row[1] if len(row) > 1 else ""
        if not expected:
            continue  # RECORD itself and generated files carry no hash
        path = os.path.normpath(os.path.join(site, rel))
        if not inside(path, site):
            # console scripts (../../bin/sglang): installed beside the venv's python, or not at
            # all under `pip --target`; not the library, so not its drift
            if not os.path.exists(path):
                outside.append(rel)
            elif file_hash(path) != expected:
                modified.append(rel)
            continue
        checked += 1
        if not os.path.exists(path):
            missing.append(rel)
            continue
        actual = file_hash(path)
        if actual == expected:
            continue
        by = expected_patches.get(rel)
        # A file an applied, recorded patch changed is expected, if it holds exactly what the patch wrote.
        if by and sha256_hex(path) == by[1]:
            patched.append({"file": rel, "patch": by[0]})
        else:
            modified.append(rel)
    return {"name": meta["name"], "version": meta["version"], "checked": checked, "modified": modified,
            "missing": missing, "patched": patched, "outside_missing": outside}


reply({"site": site_dirs(), "dists": [verify(d) for d in ARGS["dists"]]})
