def read_lines(path):
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read().splitlines()


def symbol_ranges(source, dotted):
    """(start, end, qualified name) of each def/class named `dotted` (`name` anywhere, or
    `Class.method`; None: every one)."""
    import ast
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        fail("cannot parse file for --symbol: %s" % exc)
    parts = dotted.split(".") if dotted is not None else None
    found = []
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

    def visit(node, path):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, kinds):
                here = path + [child.name]
                if parts is None or here[-len(parts):] == parts:
                    start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    found.append((start, child.end_lineno, ".".join(here)))
                visit(child, here)
            else:
                visit(child, path)

    visit(tree, [])
    return found


def main():
    path, site = resolve_in_site(ARGS["file"], ARGS.get("allow_outside", False))
    rel = os.path.relpath(path, site) if site else None
    lines = read_lines(path)
    total = len(lines)
    blocks = []
    mode = ARGS.get("mode", "all")
    if mode == "lines":
        start, end = ARGS["start"] or 1, ARGS["end"] or total
        if start > total:
            fail("--lines starts at %d but %s has only %d lines" % (start, rel or path, total))
        blocks.append({"start": start, "lines": lines[start - 1:min(end, total)], "matches": []})
    elif mode == "symbol":
        ranges = symbol_ranges("\n".join(lines) + "\n", ARGS["symbol"])
        if not ranges:
            import difflib
            every = symbol_ranges("\n".join(lines) + "\n", None)
            names = sorted({q for _s, _e, q in every} | {q.rsplit(".", 1)[-1] for _s, _e, q in every})
            close = difflib.get_close_matches(ARGS["symbol"], names, n=1, cutoff=0.6)
            fail("no def or class named %r in %s%s" % (ARGS["symbol"], rel or path,
                                                       "; did you mean %s?" % close[0] if close else ""))
        for start, end, qual in ranges:
            blocks.append({"start": start, "lines": lines[start - 1:end], "matches": [], "label": qual})
    elif mode == "grep":
        rx = re.compile(ARGS["pattern"])
        ctx = int(ARGS.get("context") or 0)
        hits = [i for i, l in enumerate(lines, 1) if rx.search(l)]
        spans = []
        for n in hits:
            lo, hi = max(1, n - ctx), min(total, n + ctx)
            if spans and lo <= spans[-1][1] + 1:
                spans[-1][1] = max(spans[-1][1], hi)
            else:
                spans.append([lo, hi])
        for lo, hi in spans:
            blocks.append({"start": lo, "lines": lines[lo - 1:hi], "matches": [n for n in hits if lo <= n <= hi]})
    else:
        blocks.append({"start": 1, "lines": lines, "matches": []})
    owner = owner_of(rel, site) if rel else None
    reply({"site": site_dirs(), "path": path, "rel": rel, "total_lines": total, "blocks": blocks,
           "owner": owner and {"name": owner["name"], "version": owner["version"],
                               "record_hash": owner.get("record_hash", ""),
                               "modified": bool(owner.get("record_hash")) and owner["record_hash"] != file_hash(path)}})


main()
