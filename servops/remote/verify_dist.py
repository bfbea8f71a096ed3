def main():
    meta = find_dist(ARGS["dist"])
    if meta is None:
        fail("distribution %r is not installed in %s" % (ARGS["dist"], sys.executable))
    site = meta["site"]
    modified, missing, checked = [], [], 0
    for row in record_rows(meta["dist_info"]):
        rel = row[0]
        expected = row[1] if len(row) > 1 else ""
        if not expected:
            continue  # RECORD itself and generated files carry no hash
        path = os.path.normpath(os.path.join(site, rel))
        checked += 1
        if not os.path.exists(path):
            missing.append(rel)
        elif file_hash(path) != expected:
            modified.append(rel)
    reply({"site": site_dirs(), "name": meta["name"], "version": meta["version"], "checked": checked,
           "modified": modified, "missing": missing})


main()
