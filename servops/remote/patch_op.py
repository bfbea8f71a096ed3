# patch.status / apply / revert / create on this python's site-packages (library: patch_core).
# Every operation first finishes or undoes a transaction a killed run left behind.


def journal_change(result, action, patch):
    """A change made by a patch verb goes into the host's journal (deploy appends its own)."""
    path = ARGS.get("journal")
    if path and result.get("result") == "changed" and not ARGS.get("dry_run"):
        append_journal(path, {"action": "patch." + action, "patch": patch["name"], "dist": patch["dist"],
                              "outcome": result["message"], "who": ARGS.get("operator")})


def main():
    op = ARGS["op"]
    timeout = ARGS.get("lock_timeout", 30)
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
            return {"site": site_dirs(), "recovered": recover(), "state_root": ROOT}
    fail("unknown patch op %r" % op)


reply(main())
