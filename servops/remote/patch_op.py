# patch.status / apply / revert / create on this python's site-packages (library: patch_core).
# Every operation first finishes or undoes a transaction a killed run left behind.


def journal_change(result, action, patch):
    """A change made by a patch verb goes into the host's journal (deploy appends its own)."""
    path = ARGS.get("journal")
    if path and result.get("result") == "changed" and not ARGS.get("dry_run"):
        try:
            append_journal(path, {"action": "patch." + action, "patch": patch["name"], "dist": patch["dist"],
                                  "outcome": result["message"], "who": ARGS.get("operator")})
        except (OSError, FileProblem) as exc:  # the change is made: say so, and that it is not journaled
            result["message"] += " (not journaled: %s)" % exc


def busy_dependent():
    """A deploy in its health gate on another deploy root that uses this venv (each root registers
    when it makes a release here): (root, release, lock holder) or None. Changing patches then
    would leave that deploy a healthy release whose patches are not on disk. (Outside a gate, a
    release whose patch set is gone is refused at its next start, and re-planned by deploy and
    rollback.)"""
    own = os.path.realpath(os.path.expanduser(ARGS.get("deploy_root") or "~/.servops/deploy"))
    for root in read_dependents():
        if os.path.realpath(root) == own:
            continue
        releases = os.path.join(root, "releases")
        try:
            names = sorted(os.listdir(releases))
        except OSError:
            continue
        for name in names:
            meta = read_json(os.path.join(releases, name, "release.json"))
            guard = read_json(os.path.join(releases, name, "guard.pid"))
            if not (isinstance(meta, dict) and meta.get("status") == "deploying" and isinstance(guard, dict)):
                continue
            if guard.get("starttime") and proc_starttime(guard.get("pid") or 0) == guard["starttime"]:
                held = read_json(os.path.join(root, "deploy.lock"))
                return root, name, held if isinstance(held, dict) else {}
    return None


def main():
    op = ARGS["op"]
    timeout = ARGS.get("lock_timeout", 30)
    if op in ("apply", "revert") and not ARGS.get("dry_run"):
        busy = busy_dependent()
        if busy:
            root, name, held = busy
            fail("this venv (%s) is also used by the deploy root %s, where %s is deploying %s (in its health "
                 "gate%s): changing its patches now would change the code under it; wait for it to finish"
                 % (sys.prefix, root, held.get("who") or "a deploy", name,
                    (", lock since %s" % held["acquired_at"]) if held.get("acquired_at") else ""))
    if op == "status":
        return do_status(ARGS["patches"], timeout)
    if op == "apply":
        res = do_apply(ARGS["patch"], ARGS.get("dry_run"), ARGS.get("expect_version"), timeout)
        journal_change(res, "apply", ARGS["patch"])
        return res
    if op == "revert":
        res = do_revert(ARGS["patch"], ARGS.get("dry_run"), timeout)
        journal_change(res, "revert", ARGS["patch"])
        return res
    if op == "pristine":
        return do_pristine(ARGS["file"])
    if op == "recover":
        with Lock(timeout):
            return {"site": site_dirs(), "recovered": recover(), "state_root": PATCH_ROOT}
    fail("unknown patch op %r" % op)


reply(main())
