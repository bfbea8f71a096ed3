# What a deploy needs to know of the host besides the launch check, answered in the launch
# check's own round trip: the program "launch_check+deploy_facts" (or launch_check_vllm+...) is
# the check program with this file and the libraries it reads through (deploy_ctl, patch_core)
# placed before it (servops.remote.program). Its facts: the current release (name, status, health, recorded
# patches, the sha256 of its launch files, launch.sh for a --diff; its server running and
# healthy), the state of every patch the deploy could want, and the deploy lock.
# Read-only, as `patch.status` and `identity` are (patch status first finishes a transaction a
# killed patch run left behind, as every patch operation does).
#
# ARGS["deploy"]: {"files": [release file names to digest], "script": bool, "patches": [patch
# specs], "lock_timeout"}.
# Reply (under "deploy"): {"root", "current": release_identity() of `current` ({"name": None}:
# none), "patches": do_status() entries, "patches_recovered", "lock": the holder's record or None}


def deploy_facts(spec):
    try:
        check_root()
        require_regular(JOURNAL)
        current = release_identity(current_name(), spec.get("files") or [], script=bool(spec.get("script")))
    except FileProblem as exc:
        fail(str(exc))
    status = do_status(spec["patches"], spec.get("lock_timeout", 30)) if spec.get("patches") else {}
    return {"root": ROOT, "current": current, "patches": status.get("patches") or [],
            "patches_recovered": status.get("recovered"), "lock": lock_record()}
