"""servops tasks. Thin layer: parse flags, call into the servops package.

Run `invoke --list` for the verbs and `invoke --help VERB` for each one's flags.
"""

from invoke import Collection

from servops.cli import select, servops_task
from servops.fleet import run_on_hosts
from servops.output import CHANGED, FAILED, OK, Recap, console
from servops.transport import Session


@servops_task(help={
    "file": "File path relative to the host venv's site-packages, e.g. flashinfer/jit/cpp_ext.py.",
    "lines": "sed-style line range: 60:90, 60:, :90, 60, or 60:+10.",
    "symbol": "Print one def/class (decorators + body), found by AST: get_cuda_version or Class.method.",
    "grep": "Print lines matching this Python regular expression, with line numbers.",
    "context": "Lines of context around --grep matches.",
    "verify": "Drift check (like rpm -V): compare a distribution's files with its RECORD hashes.",
    "allow_outside": "Allow --file to name a path outside site-packages (absolute or via ..).",
    "color": "Force syntax highlighting on (yes) or off (no); default: on for a terminal.",
})
def inspect(c, file="", lines="", symbol="", grep="", context=0, verify="", allow_outside=False,
            color="auto", hosts=None, inventory=None):
    """Show library source from a host's venv (one SSH round trip), or verify a distribution."""
    from servops import inspect as ins

    _, targets = select(inventory, hosts)
    highlight = {"yes": True, "no": False}.get(color)
    req = None if verify else ins.InspectRequest(file, lines or None, symbol or None, grep or None,
                                                 int(context), allow_outside)
    if req:
        req.program_args()  # validate before connecting anywhere
    recap = Recap()
    results = {}

    def op(hs):
        if verify:
            res = ins.verify_dist(hs, verify)
            results[hs.host.name] = res
            drift = len(res["modified"]) + len(res["missing"])
            return (FAILED, f"{drift} file(s) differ from RECORD") if drift else (OK, f"{res['checked']} files verified")
        results[hs.host.name] = ins.inspect_file(hs, req)
        return OK, ""

    with Session() as session:
        run_on_hosts(session, targets, op, recap)
    for host in targets:
        if host.name not in results:
            continue
        if verify:
            ins.print_verify(host.name, results[host.name])
        else:
            ins.print_inspect(host.name, results[host.name], highlight)
    if len(targets) > 1 or recap.failed or verify:
        return recap
    return None


@servops_task(name="status", help={"name": "Only this patch (default: every patch in patches/)."})
def patch_status(c, name="", hosts=None, inventory=None):
    """Per host: each known patch applied / not applied / conflicts / version does not match."""
    from servops import patching, patchstore

    _, targets = select(inventory, hosts)
    patches = [patchstore.find_patch(name)] if name else patchstore.all_patches()
    if not patches:
        raise patchstore.PatchError("no patches under patches/ (expected patches/<distribution>/<name>.patch)")
    rows = {}

    def op(hs):
        rows[hs.host.name] = patching.status(hs, patches)
        bad = [r["patch"] for r in rows[hs.host.name] if r["state"] == patching.CONFLICTS]
        return (FAILED, f"conflicts: {', '.join(bad)}") if bad else (OK, "")

    recap = Recap()
    with Session() as session:
        run_on_hosts(session, targets, op, recap)
    patching.print_status({h.name: rows[h.name] for h in targets if h.name in rows})
    return recap


_PATCH_HELP = {
    "name": "Patch name (file stem under patches/<distribution>/), or DIST/NAME.",
    "force": "Apply even if the installed version is outside the patch's applies_to.",
    "lock_timeout": "Seconds to wait for another patch operation on the same venv.",
}


@servops_task(name="apply", positional=["name"], help=_PATCH_HELP)
def patch_apply(c, name, dry_run=False, diff=False, force=False, lock_timeout=30, hosts=None, inventory=None):
    """Apply a versioned patch to site-packages: atomic, idempotent, recorded on the host."""
    from servops import patching, patchstore

    _, targets = select(inventory, hosts)
    patch = patchstore.find_patch(name)
    return _patch_change(targets, lambda hs: patching.apply(hs, patch, dry_run, force, int(lock_timeout)), diff)


@servops_task(name="revert", positional=["name"], help=_PATCH_HELP)
def patch_revert(c, name, dry_run=False, diff=False, lock_timeout=30, hosts=None, inventory=None):
    """Revert a patch: exact restore from the host's backup, else a reverse patch(1)."""
    from servops import patching, patchstore

    _, targets = select(inventory, hosts)
    patch = patchstore.find_patch(name)
    return _patch_change(targets, lambda hs: patching.revert(hs, patch, dry_run, int(lock_timeout)), diff)


def _patch_change(targets, action, show_diff):
    from servops import patching

    diffs = {}

    def op(hs):
        res = action(hs)
        diffs[hs.host.name] = res["diff"]
        return res["status"], res["message"]

    recap = Recap()
    with Session() as session:
        run_on_hosts(session, targets, op, recap)
    if show_diff:
        for host in targets:
            patching.print_diff(host.name, diffs.get(host.name, ""))
    return recap


@servops_task(name="create", help={
    "file": "The edited file, relative to site-packages (e.g. flashinfer/jit/cpp_ext.py).",
    "name": "Name for the new patch (patches/<distribution>/<name>.patch).",
    "why": "The failure this patch fixes (goes into the metadata).",
})
def patch_create(c, file, name, why="", hosts=None, inventory=None):
    """Capture a hand edit on the host as a patch + metadata skeleton under patches/."""
    from servops import patching
    from servops.errors import ServopsError

    _, targets = select(inventory, hosts)
    if len(targets) != 1:
        raise ServopsError(f"patch.create reads one host's edit; pick one with -H (selected {len(targets)})")
    with Session() as session:
        path, res = patching.create(session.host(targets[0]), file, name, why=why)
    console.print(f"wrote {path} and {path.with_suffix('.yml')} (diff against the {res['source']})", markup=False)


@servops_task(name="preflight", positional=["name"], help={
    "name": "Patch whose preflight check to run.",
    "expect_fail": "Succeed only if the check FAILS (proves the bug exists on a pristine host).",
})
def patch_preflight(c, name, expect_fail=False, hosts=None, inventory=None):
    """Run a patch's preflight proof on the host's python (dynamo fullgraph trace)."""
    from servops import patchstore, preflight

    _, targets = select(inventory, hosts)
    patch = patchstore.find_patch(name)

    def op(hs):
        res = preflight.run_preflight(hs, patch)
        passed = res["result"] == "pass"
        text = (f"{patch.preflight['call']} compiles under torch.compile(fullgraph=True) (torch {res['torch']})"
                if passed else f"{res['error_type']}: {res['message']}")
        console.print(f"{hs.host.name}: preflight {res['result']}: {text}", markup=False)
        if passed != (not expect_fail):
            return FAILED, f"preflight {res['result']}" + ("" if passed else f": {res['error_type']}")
        return OK, f"preflight {res['result']}" + (" (expected)" if expect_fail else "")

    recap = Recap()
    with Session() as session:
        run_on_hosts(session, targets, op, recap)
    return recap


patch_ns = Collection("patch", patch_status, patch_apply, patch_revert, patch_create, patch_preflight)
ns = Collection(inspect, patch_ns)
