"""servops tasks. Thin layer: parse flags, call into the servops package.

Run `invoke --list` for the verbs and `invoke --help VERB` for each one's flags.
"""

from invoke import Collection

from servops.cli import select, servops_task
from servops.fleet import run_on_hosts
from servops.output import CHANGED, FAILED, OK, Recap
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


ns = Collection(inspect)
