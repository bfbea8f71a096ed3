"""servops tasks. Thin layer: parse flags, call into the servops package.

Run `invoke --list` for the verbs and `invoke --help VERB` for each one's flags.
"""

from invoke import Collection, task

from servops.cli import select, servops_task
from servops.fleet import run_on_hosts
from servops.output import FAILED, OK, Recap, console
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

    inv, targets = select(inventory, hosts)
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

    with Session(inv) as session:
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

    inv, targets = select(inventory, hosts)
    patches = [patchstore.find_patch(name)] if name else patchstore.all_patches()
    if not patches:
        raise patchstore.PatchError("no patches under patches/ (expected patches/<distribution>/<name>.patch)")
    rows = {}

    def op(hs):
        rows[hs.host.name] = patching.status(hs, patches)
        bad = [r["patch"] for r in rows[hs.host.name] if r["state"] == patching.CONFLICTS]
        return (FAILED, f"conflicts: {', '.join(bad)}") if bad else (OK, "")

    recap = Recap()
    with Session(inv) as session:
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

    inv, targets = select(inventory, hosts)
    patch = patchstore.find_patch(name)
    return _patch_change(inv, targets, lambda hs: patching.apply(hs, patch, dry_run, force, int(lock_timeout)), diff)


@servops_task(name="revert", positional=["name"], help=_PATCH_HELP)
def patch_revert(c, name, dry_run=False, diff=False, lock_timeout=30, hosts=None, inventory=None):
    """Revert a patch: exact restore from the host's backup, else a reverse patch(1)."""
    from servops import patching, patchstore

    inv, targets = select(inventory, hosts)
    patch = patchstore.find_patch(name)
    return _patch_change(inv, targets, lambda hs: patching.revert(hs, patch, dry_run, int(lock_timeout)), diff)


def _patch_change(inv, targets, action, show_diff):
    from servops import patching

    diffs = {}

    def op(hs):
        res = action(hs)
        diffs[hs.host.name] = res["diff"]
        return res["status"], res["message"]

    recap = Recap()
    with Session(inv) as session:
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

    inv, targets = select(inventory, hosts)
    if len(targets) != 1:
        raise ServopsError(f"patch.create reads one host's edit; pick one with -H (selected {len(targets)})")
    with Session(inv) as session:
        path, res = patching.create(session.host(targets[0]), file, name, why=why)
    console.print(f"wrote {path} and {path.with_suffix('.yml')} (diff against the {res['source']})", markup=False)


@servops_task(name="preflight", positional=["name"], help={
    "name": "Patch whose preflight check to run.",
    "expect_fail": "Succeed only if the check FAILS (proves the bug exists on a pristine host).",
})
def patch_preflight(c, name, expect_fail=False, hosts=None, inventory=None):
    """Run a patch's preflight proof on the host's python (dynamo fullgraph trace)."""
    from servops import patchstore, preflight

    inv, targets = select(inventory, hosts)
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
    with Session(inv) as session:
        run_on_hosts(session, targets, op, recap)
    return recap


_DEPLOY_HELP = {
    "variant": "Variant name: playbooks/<variant>.yml (e.g. baseline, piecewise).",
    "no_rollback": "On a failed health gate, leave the failed release in place (no automatic rollback).",
    "skip_patches": "Do not apply the variant's patches (to reproduce the crash they fix).",
    "break_lock": "Take the deploy lock even if another operator holds it.",
    "keep": "Releases to keep on the host (default: inventory keep_releases, or 5).",
    "to": "Release name to roll back to (default: the previous healthy release).",
    "gate": "Bench after the health gate; roll back unless e.g. 'output_tps@1024 >= 1.02*baseline' holds.",
    "push": "Prometheus Pushgateway URL to push the deploy event (and gate bench) to.",
    "serial": "Roll out N servers at a time; stop at the first failed batch (Ansible serial).",
    "max_fail_percentage": "With --serial: carry on while a batch's failed share stays at or below this.",
}
_BENCH_HELP = {
    "levels": "Concurrency levels, comma-separated (default 1,10,256,1024).",
    "requests": "Requests per level (default: max(2*level, 16)).",
    "input_len": "Prompt length in words for --dataset random.",
    "output_len": "Tokens to generate per request.",
    "dataset": "'random', or a local file of prompts (one per line, or JSONL with 'prompt').",
    "push": "Prometheus Pushgateway URL to push the results to.",
}


@servops_task(help=_DEPLOY_HELP)
def deploy(c, variant, dry_run=False, diff=False, no_rollback=False, skip_patches=False, break_lock=False,
           keep=0, gate="", push="", serial=0, max_fail_percentage=0.0, hosts=None, inventory=None):
    """Deploy a variant: new release, patches, restart, health gate, auto-rollback on failure."""
    from servops import deploy as dep
    from servops.errors import ServopsError
    from servops.fleet import run_on_groups
    from servops.gate import parse_gate
    from servops.playbooks import load_variant

    inv, targets = select(inventory, hosts)
    v = load_variant(variant)  # an unknown variant fails before any connection
    conditions = parse_gate(gate) if gate else None
    nnodes = int(v.get("nnodes") or 1)
    if len(targets) % nnodes:
        raise ServopsError(f"variant {variant} runs on {nnodes} nodes per server; select a multiple of {nnodes} "
                           f"hosts (got {len(targets)}), rank 0 first")
    groups = [targets[i:i + nnodes] for i in range(0, len(targets), nnodes)]
    recap = Recap()
    with Session(inv) as session:
        run_on_groups(session, groups, lambda nodes: dep.deploy_group(
            nodes, variant, dry_run=dry_run, diff=diff, no_rollback=no_rollback, skip_patches=skip_patches,
            break_lock=break_lock, keep=int(keep) or None, gate=conditions, push_url=push or None), recap,
            serial=int(serial) or None, max_fail_percentage=float(max_fail_percentage))
    return recap


@servops_task(help={"watch": "Refresh every SECONDS until Ctrl-C.", "json": "Print JSON for machines."})
def metrics(c, watch=0.0, json=False, hosts=None, inventory=None):
    """Scrape SGLang's /metrics on each host: requests, throughput, TTFT/ITL/e2e quantiles, GPUs."""
    import json as jsonlib
    import time

    from servops import metrics as m

    inv, targets = select(inventory, hosts)
    with Session(inv) as session:
        while True:
            rows, recap = {}, Recap()

            def op(hs):
                rows[hs.host.name] = m.scrape(hs)
                return OK, ""

            run_on_hosts(session, targets, op, recap)
            ordered = [rows[h.name] for h in targets if h.name in rows]
            if json:
                print(jsonlib.dumps(ordered, indent=1))
            else:
                m.print_metrics(ordered)
            if not watch or recap.failed:
                return recap if recap.failed else None
            try:
                time.sleep(float(watch))
            except KeyboardInterrupt:
                return None


@servops_task(help=_BENCH_HELP)
def bench(c, levels="1,10,256,1024", requests=0, input_len=128, output_len=128, dataset="random", push="",
          hosts=None, inventory=None):
    """Benchmark the running server at each concurrency level; save results under results/."""
    from servops import bench as b

    inv, targets = select(inventory, hosts)
    lv = b.parse_levels(levels)
    data = b.load_dataset(dataset)
    recap = Recap()

    def op(hs):
        result = b.run_bench(hs, lv, int(requests), int(input_len), int(output_len), data)
        b.print_result(result)
        if push:
            from servops.push import push_bench

            push_bench(push, result)
        if not result["complete"]:
            done = sum(l["completed"] for l in result["levels"])
            failed = sum(l["failed"] for l in result["levels"])
            return FAILED, f"incomplete: {done} requests done, {failed} failed; partial results in {result['path']}"
        return OK, f"saved {result['path']}"

    with Session(inv) as session:
        run_on_hosts(session, targets, op, recap, parallel=1)
    return recap


@servops_task(positional=["first", "second"], help={
    "first": "Reference variant (deltas are relative to it), e.g. baseline.",
    "second": "Variant to compare with it, e.g. piecewise.",
    "more": "Further variants, comma-separated.",
    "host": "Host whose results to compare (default: the only/first selected host).",
    "out": "PNG path for the plot (default results/<host>/compare-A-vs-B.png).",
})
def compare(c, first, second, more="", host="", out="", inventory=None):
    """Compare variants' latest bench results side by side, with deltas and a PNG plot."""
    from pathlib import Path

    from servops import compare as cmp
    from servops.bench import RESULTS_ROOT

    variants = [first, second] + [v.strip() for v in more.split(",") if v.strip()]
    h = select(inventory, host or None)[1][0]
    results = cmp.load_pair(h.name, list(variants))
    cmp.print_compare(h.name, results)
    png = Path(out) if out else RESULTS_ROOT / h.name / f"compare-{'-vs-'.join(variants)}.png"
    console.print(f"plot: {cmp.plot(h.name, results, png)}", markup=False)


@servops_task(help=_DEPLOY_HELP)
def rollback(c, to="", dry_run=False, diff=False, break_lock=False, hosts=None, inventory=None):
    """Go back to the previous healthy release (or --to RELEASE): its patches, script, restart."""
    from servops import deploy as dep

    inv, targets = select(inventory, hosts)
    recap = Recap()
    with Session(inv) as session:
        run_on_hosts(session, targets, lambda hs: dep.rollback(hs, to or None, dry_run, break_lock, diff), recap)
    return recap


@servops_task(help={"variant": "Variant to render.", "host": "Inventory host whose vars fill the template."})
def render(c, variant, host="", inventory=None):
    """Print the launch script a variant renders to for a host, without touching the host."""
    from servops.cli import select_one
    from servops.playbooks import load_variant
    from servops.redact import Redactor
    from servops.releases import deploy_root, release_name
    from servops.render import render_launch

    h = select_one(inventory, host)
    v = load_variant(variant)
    root = deploy_root(h)
    name = release_name(variant)
    text = render_launch(h, v, name, f"{root}/releases/{name}")
    import sys

    sys.stdout.write(Redactor.for_host(h)(text))


@servops_task
def status(c, hosts=None, inventory=None):
    """Current release, variant, patches, server pid, health and uptime per host."""
    from servops import ops

    inv, targets = select(inventory, hosts)
    recap = Recap()
    rows = {}
    with Session(inv) as session:
        run_on_hosts(session, targets, lambda hs: ops.status(hs, rows), recap)
    ops.print_status([rows[h.name] for h in targets if h.name in rows])
    return recap


@servops_task(help={"lines": "How many lines from the end.", "follow": "Keep printing new lines (Ctrl-C stops).",
                    "release": "A release other than current."})
def logs(c, lines=100, follow=False, release="", hosts=None, inventory=None):
    """Show the server log of the current (or given) release."""
    from servops import ops

    inv, targets = select(inventory, hosts)
    with Session(inv) as session:
        for host in targets:
            ops.logs(session.host(host), int(lines), follow, release or None, prefix=len(targets) > 1)


@servops_task(help={"grace": "Seconds between SIGTERM and SIGKILL (default: the release's stop_grace)."})
def stop(c, grace=0.0, dry_run=False, hosts=None, inventory=None):
    """Stop the server (SIGTERM to its process group, SIGKILL after the grace period)."""
    from servops import ops

    inv, targets = select(inventory, hosts)
    recap = Recap()
    with Session(inv) as session:
        run_on_hosts(session, targets, lambda hs: ops.stop(hs, float(grace) or None, dry_run), recap)
    return recap


@servops_task(name="releases")
def releases_(c, hosts=None, inventory=None):
    """List the releases on each host: variant, status, patches, which is current."""
    from servops import ops

    inv, targets = select(inventory, hosts)
    listings = {}
    recap = Recap()
    with Session(inv) as session:
        run_on_hosts(session, targets, lambda hs: ops.list_releases(hs, listings), recap)
    ops.print_releases({h.name: listings[h.name] for h in targets if h.name in listings})
    return recap if recap.failed else None


@servops_task(help={
    "release": "Release whose server.log to read (default: current).",
    "log": "A local log file instead (frames are still resolved on the host).",
    "explain": "Show the call chain from the capture entry point to the failing call.",
    "context": "Source lines shown around each frame.",
})
def diagnose(c, release="", log="", explain=False, context=3, hosts=None, inventory=None):
    """Explain crashes: tracebacks in the log, source of every frame, known-issue matches."""
    from pathlib import Path

    from servops import diagnose as dg

    inv, targets = select(inventory, hosts)
    issues = dg.known_issues()
    log_text = None
    if log:
        if not Path(log).is_file():
            raise dg.DiagnoseError(f"--log {log!r}: no such local file")
        log_text = Path(log).read_text(errors="replace")
    results = {}
    recap = Recap()

    def op(hs):
        results[hs.host.name] = dg.diagnose(hs, release or None, log_text, int(context))
        return OK, f"{len(results[hs.host.name]['tracebacks'])} traceback(s)"

    with Session(inv) as session:
        run_on_hosts(session, targets, op, recap)
    for h in targets:
        if h.name in results:
            dg.print_report(h.name, results[h.name], issues, explain)
    return recap


@task(name="up", help={"hosts": "How many lab hosts (127.0.0.2 upwards, port 2222)."})
def lab_up(c, hosts=1):
    """Start the lab of inventory/lab.yml here: real sshd on 127.0.0.x:2222, the test venv."""
    import sys

    sys.path.insert(0, "tests")
    from harness import lab

    started = lab.up(int(hosts))
    print(f"lab up ({', '.join(started) or 'already running'}); try: invoke deploy --variant baseline -H lab1")


@task(name="down")
def lab_down(c):
    """Stop the lab's sshd servers (stop the servers first: invoke stop -H lab)."""
    import sys

    sys.path.insert(0, "tests")
    from harness import lab

    print(f"stopped sshd on: {', '.join(lab.down()) or 'none running'}")


patch_ns = Collection("patch", patch_status, patch_apply, patch_revert, patch_create, patch_preflight)
lab_ns = Collection("lab", lab_up, lab_down)
ns = Collection(lab_ns, inspect, deploy, rollback, render, status, logs, stop, releases_, metrics, bench, compare, diagnose, patch_ns)
