"""servops tasks. Thin layer: parse flags, call into the servops package.

Run `invoke --list` for the verbs and `invoke --help VERB` for each one's flags.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from any subdirectory
try:
    from invoke import Collection

    from servops import cliparse
    from servops.cli import VerbRun, on_hosts, select, select_one, servops_task
    from servops.output import CHANGED, FAILED, OK, RESTORED, console, json_text
except ImportError as exc:  # not installed: one line, not a traceback
    sys.stderr.write(f"error: servops cannot load ({exc}); run `bash scripts/setup.sh`, then `. .venv/bin/activate`\n")
    sys.exit(2)
cliparse.install()  # invoke's parse errors (an unknown flag, a missing value) as servops' one-line errors


@servops_task(help={
    "file": "File path relative to the host venv's site-packages, e.g. flashinfer/jit/cpp_ext.py.",
    "lines": "sed-style line range: 60:90, 60:, :90, 60, or 60:+10.",
    "symbol": "Print one def/class (decorators + body), found by AST: get_cuda_version or Class.method.",
    "grep": "Print lines matching this Python regular expression, with line numbers.",
    "context": "Lines of context around --grep matches.",
    "verify": "Drift check (like rpm -V): distributions to compare with their RECORD hashes, comma-separated.",
    "allow_outside": "Allow --file to name a path outside site-packages (absolute or via ..).",
    "color": "Force syntax highlighting on (yes) or off (no); default: on for a terminal.",
})
def inspect(c, file="", lines="", symbol="", grep="", context=0, verify="", allow_outside=False,
            color="auto", hosts=None, inventory=None):
    """Show library source from a host's venv (one SSH round trip), or verify distributions."""
    from servops import inspect as ins

    highlight = {"yes": True, "no": False}.get(color)
    if verify:
        dists = ins.parse_dists(verify)

        def op(hs):
            res = ins.verify_dists(hs, dists)
            drift = sum(len(r["modified"]) + len(r["missing"]) for r in res)
            checked = sum(r["checked"] for r in res)
            expected = sum(len(r.get("patched") or []) for r in res)
            note = f"; {expected} changed by servops patches (expected)" if expected else ""
            if drift:
                return FAILED, f"{drift} file(s) differ from RECORD{note}", res
            return OK, f"{checked} files verified{note}", res

        run = on_hosts(inventory, hosts, op)
        for h, res in run.each():
            for r in res:
                ins.print_verify(h.name, r)
        return run.recap
    req = ins.InspectRequest(file, lines or None, symbol or None, grep or None, context, allow_outside)
    req.program_args()  # validate before connecting anywhere
    run = on_hosts(inventory, hosts, lambda hs: (OK, "", ins.inspect_file(hs, req)))
    for h, res in run.each():
        ins.print_inspect(h.name, res, highlight)
    return run.recap


@servops_task(name="status", help={"name": "Only this patch (default: every patch in patches/)."})
def patch_status(c, name="", hosts=None, inventory=None):
    """Per host: each known patch applied / not applied / conflicts / version does not match."""
    from servops import patching, patchstore

    patches = [patchstore.find_patch(name)] if name else patchstore.all_patches()
    if not patches:
        raise patchstore.PatchError("no patches under patches/ (expected patches/<distribution>/<name>.patch)")

    def op(hs):
        rows = patching.status(hs, patches)
        bad = [r["patch"] for r in rows if r["state"] == patching.CONFLICTS]
        return (FAILED, f"conflicts: {', '.join(bad)}", rows) if bad else (OK, "", rows)

    run = on_hosts(inventory, hosts, op)
    patching.print_status({h.name: rows for h, rows in run.each()})
    return run.recap


_PATCH_HELP = {
    "name": "Patch name (file stem under patches/<distribution>/), or DIST/NAME.",
    "force": "Apply even if the installed version is outside the patch's applies_to.",
    "lock_timeout": "Seconds to wait for another operation (deploy lock, venv patch lock) to finish.",
    "break_lock": "Take the deploy lock even if another operator holds it.",
}


def _patch_change(inventory, hosts, action, show_diff):
    from servops import patching

    run = on_hosts(inventory, hosts, lambda hs: (lambda r: (r["status"], r["message"], r["diff"]))(action(hs)))
    if show_diff:
        for h, diff in run.each():
            patching.print_diff(h.name, diff)
    return run.recap


def _locked(hs, action, dry_run, break_lock, lock_timeout, change):
    """A patch verb changes the host: it takes the deploy lock (never mid-deploy), waiting up to
    --lock-timeout for another holder; check mode takes none."""
    from servops.deploylock import host_lock

    if dry_run:
        return change()
    with host_lock(hs, action, break_lock, wait=lock_timeout):
        return change()


@servops_task(name="apply", positional=["name"], help=_PATCH_HELP, changes="patch.apply")
def patch_apply(c, name, dry_run=False, diff=False, force=False, lock_timeout=30, break_lock=False, hosts=None,
                inventory=None):
    """Apply a versioned patch to site-packages: atomic, idempotent, recorded on the host."""
    from servops import patching, patchstore

    patch = patchstore.find_patch(name)
    return _patch_change(inventory, hosts, lambda hs: _locked(
        hs, f"patch.apply {patch.name}", dry_run, break_lock, lock_timeout,
        lambda: patching.apply(hs, patch, dry_run, force, lock_timeout)), diff)


@servops_task(name="revert", positional=["name"], help=_PATCH_HELP, changes="patch.revert")
def patch_revert(c, name, dry_run=False, diff=False, lock_timeout=30, break_lock=False, hosts=None, inventory=None):
    """Revert a patch: exact restore from the host's backup, else a reverse patch(1)."""
    from servops import patching, patchstore

    patch = patchstore.find_patch(name)
    return _patch_change(inventory, hosts, lambda hs: _locked(
        hs, f"patch.revert {patch.name}", dry_run, break_lock, lock_timeout,
        lambda: patching.revert(hs, patch, dry_run, lock_timeout)), diff)


@servops_task(name="create", help={
    "file": "The edited file, relative to site-packages (e.g. flashinfer/jit/cpp_ext.py).",
    "name": "Name for the new patch (patches/<distribution>/<name>.patch).",
    "why": "The failure this patch fixes (goes into the metadata).",
})
def patch_create(c, file, name, why="", hosts=None, inventory=None):
    """Capture a hand edit on the host as a patch + metadata skeleton under patches/."""
    from servops import patching

    inv, host = select_one(inventory, hosts, "patch.create")
    run = on_hosts(inventory, host.name, lambda hs: (OK, "", patching.create(hs, file, name, why=why)))
    for h, (path, res) in run.each():
        run.recap.mark(h.name, CHANGED, f"wrote {path} and {path.with_suffix('.yml')} (diff against the {res['source']})")
    return run.recap


@servops_task(name="preflight", positional=["name"], help={
    "name": "Patch whose preflight check to run.",
    "expect_fail": "Succeed only if the check FAILS (proves the bug exists on a pristine host).",
})
def patch_preflight(c, name, expect_fail=False, hosts=None, inventory=None):
    """Run a patch's preflight proof on the host's python (dynamo fullgraph trace)."""
    from servops import patchstore, preflight

    patch = patchstore.find_patch(name)

    def op(hs):
        res = preflight.run_preflight(hs, patch)
        for line in preflight.describe(patch, res):
            console.print(f"{hs.host.name}: preflight {res['result']}: {hs.redactor(line)}", markup=False)
        if res["result"] == "unproven":  # never a green that proved nothing
            return FAILED, "preflight unproven (see above: nothing was shown either way)"
        if patch.preflight["check"] == "dynamo_call_site":
            # --expect-fail: the pristine call site crashes; else the crash AND the fix must be shown
            passed = (res["pristine"]["result"] == "unsupported") if expect_fail else res["result"] == "pass"
            return (OK if passed else FAILED), f"preflight {res['result']}" + (" (expected)" if expect_fail else "")
        passed = res["result"] == "pass"
        if passed != (not expect_fail):
            return FAILED, f"preflight {res['result']}" + ("" if passed else f": {res.get('error_type') or res.get('message')}")
        return OK, f"preflight {res['result']}" + (" (expected)" if expect_fail else "")

    return on_hosts(inventory, hosts, op).recap


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
    "force": "Deploy even when the release would equal the current one (same launch, env, secrets, patches) "
             "and its server is healthy; without it such a deploy restarts nothing.",
    "fix": "For a launch that compiles: where the audit finds a break no stored patch covers, synthesise, prove "
           "and store its patch (invoke audit --fix), then deploy with it (without: such a break refuses the deploy).",
    "skip_audit": "Deploy without auditing the compiled region first (a break then crashes the new server at "
                  "start, and the deploy rolls back).",
}
_BENCH_HELP = {
    "levels": "Concurrency levels, comma-separated (default 1,10,256,1024); with --request-rate each level's "
              "concurrency cap.",
    "requests": "Requests per level, warmup not counted (default: max(2*level, 16)).",
    "input_len": "Prompt length for the random datasets: tokens with --tokenizer, else words (the result says which).",
    "output_len": "Tokens to generate per request (the server's usage counts them); 0: 128, or for sharegpt each "
                  "answer's length.",
    "dataset": "random (words, or tokens with --tokenizer), random-ids (token ids via /generate, exact lengths), "
               "sharegpt or prompts (with --dataset-path); a file path alone also works.",
    "dataset_path": "Local file for --dataset sharegpt (JSON list of conversations) or prompts (one per line, "
                    "or JSONL with 'prompt').",
    "range_ratio": "Random lengths uniform in [ratio*len, len], as bench_serving's --random-range-ratio "
                   "(default 1: exact lengths; bench_serving's default is 0).",
    "tokenizer": "Hugging Face tokenizer directory (or tokenizer.json) ON THE HOST: lengths in tokens; needs the "
                 "tokenizers package in the host venv.",
    "request_rate": "Requests per second arriving as a Poisson process (gamma with --burstiness), capped at each "
                    "level's concurrency; inf (default): fixed concurrency.",
    "burstiness": "Gamma shape of the arrivals: 1 is Poisson, below 1 burstier, above 1 more regular.",
    "max_concurrency": "One level with this concurrency cap (instead of --levels), as bench_serving's flag.",
    "warmup": "Warm-up before each level, left out of its results: auto (default: waves at the level's concurrency "
              "and lengths until their TTFT settles, bounded), 0 (none) or N requests.",
    "flush_cache": "POST /flush_cache before each level (default on; --no-flush-cache skips it); a refusal is "
                   "noted in the results.",
    "seed": "Random seed for prompts, lengths and arrival times (same seed, same requests).",
    "slo": "Goodput SLOs in ms, e.g. ttft:500,tpot:50 (keys ttft, tpot, e2el): goodput and SLO attainment.",
    "repeat": "Run each level N times: the mean with a 95% interval (gates compare noise-aware).",
    "push": "Prometheus Pushgateway URL to push the results to.",
    "keep_text": "Keep each request's whole generated text in the results (default: its first 1,000 characters).",
}


@servops_task(help=_DEPLOY_HELP, bounds={"max_fail_percentage": (0, 100)}, changes="deploy")
def deploy(c, variant, dry_run=False, diff=False, no_rollback=False, skip_patches=False, break_lock=False,
           keep=0, gate=None, push=None, serial=0, max_fail_percentage=0.0, force=False, fix=False, skip_audit=False,
           hosts=None, inventory=None):
    """Deploy a variant: new release, patches, restart, health gate, auto-rollback on failure.

    A deploy that would change nothing (the current release has the same launch script, env,
    secrets and patch set, and its server is healthy) ends `ok - unchanged` and restarts nothing."""
    from servops import deploy as dep
    from servops.gate import parse_gate
    from servops.multinode import server_groups
    from servops.playbooks import load_variant

    inv, targets = select(inventory, hosts)
    v = load_variant(variant)  # an unknown variant fails before any connection
    conditions = parse_gate(gate) if gate is not None else None  # --gate '' is an error, not "no gate"
    groups = server_groups(v, targets)
    return VerbRun(inv, targets).run(lambda nodes: dep.deploy_group(
        nodes, v, dry_run=dry_run, diff=diff, no_rollback=no_rollback, skip_patches=skip_patches,
        break_lock=break_lock, keep=keep or None, gate=conditions, push_url=push, force=force, fix=fix,
        skip_audit=skip_audit),
        groups=groups, serial=serial or None, max_fail_percentage=max_fail_percentage).recap


@servops_task(help={"watch": "Refresh every SECONDS until Ctrl-C.", "json": "Print JSON for machines."})
def metrics(c, watch=0.0, json=False, hosts=None, inventory=None):
    """Scrape SGLang's /metrics on each host: requests, throughput, TTFT/ITL/e2e quantiles, GPUs."""
    from servops import metrics as m

    def scrape_all():
        run = on_hosts(inventory, hosts, m.scrape_host)
        run.recap.machine_output = json
        return [row for _h, row in run.each()], run.recap

    return m.watch(scrape_all, watch, json)


@servops_task(help=_BENCH_HELP, bounds={"repeat": (1, None), "input_len": (1, None), "range_ratio": (0, 1)})
def bench(c, levels="1,10,256,1024", requests=0, input_len=128, output_len=128, dataset="random", dataset_path="",
          range_ratio=1.0, tokenizer="", request_rate="inf", burstiness=1.0, max_concurrency=0, warmup="auto",
          flush_cache=True, seed=42, slo="", repeat=1, push="", keep_text=False, hosts=None, inventory=None):
    """Benchmark the running server with bench_serving's metrics; one JSONL line per level under results/."""
    from servops import bench as b
    from servops.errors import ServopsError

    if max_concurrency and levels != "1,10,256,1024":
        raise ServopsError("give either --levels or --max-concurrency (one level), not both")
    lv = [int(max_concurrency)] if max_concurrency else b.parse_levels(levels)
    rate = b.parse_rate(request_rate)
    warmup = b.parse_warmup(warmup)
    b.check_counts(requests, input_len, output_len, warmup, repeat)
    if not burstiness > 0:
        raise ServopsError(f"--burstiness {burstiness}: must be more than 0")
    slos = b.parse_slo(slo)
    if push:
        from servops.push import validate_url

        validate_url(push)
    data = b.load_dataset(dataset, dataset_path, seed)

    def op(hs):
        result = b.run_bench(hs, lv, requests, input_len, output_len, data, request_rate=rate, burstiness=burstiness,
                             warmup=warmup, flush_cache=flush_cache, seed=seed, range_ratio=range_ratio,
                             tokenizer=tokenizer or None, slo=slos, repeat=repeat, keep_text=keep_text)
        b.print_result(result)
        if push:
            from servops.push import push_bench

            push_bench(push, result)
        if not result["complete"]:
            done = sum(l["completed"] for l in result["levels"])
            failed = sum(l["failed"] for l in result["levels"])
            # a bench changes nothing on the host: its failure is "failed, host as before" (exit 4), not bad input
            return RESTORED, f"incomplete: {done} requests done, {failed} failed; partial results in {result['path']}"
        return OK, f"saved {result['path']}"

    return on_hosts(inventory, hosts, op, parallel=1).recap


@servops_task(positional=["first", "second"], help={
    "first": "Reference variant (deltas are relative to it), e.g. baseline.",
    "second": "Variant to compare with it, e.g. piecewise.",
    "more": "Further variants, comma-separated.",
    "out": "PNG path for the plot (default results/<host>/compare-A-vs-B.png).",
})
def compare(c, first, second, more="", out="", hosts=None, inventory=None):
    """Compare variants' latest bench results side by side (local results/), with deltas and a PNG plot."""
    from pathlib import Path

    from servops import compare as cmp
    from servops.bench import RESULTS_ROOT

    variants = [first, second] + [v.strip() for v in more.split(",") if v.strip()]
    inv, targets = select(inventory, hosts)

    def op(h):  # local files only: no connection
        results = cmp.load_pair(h.name, list(variants))
        cmp.print_compare(h.name, results)
        png = Path(out) if out and len(targets) == 1 else RESULTS_ROOT / h.name / f"compare-{'-vs-'.join(variants)}.png"
        return OK, f"plot: {cmp.plot(h.name, results, png)}"

    return VerbRun(inv, targets).local(op).recap


@servops_task(help=_DEPLOY_HELP, changes="rollback")
def rollback(c, to="", dry_run=False, diff=False, break_lock=False, hosts=None, inventory=None):
    """Go back to the previous healthy release (or --to RELEASE): its patches, script, restart."""
    from servops import deploy as dep

    return on_hosts(inventory, hosts, lambda hs: dep.rollback(hs, to or None, dry_run, break_lock, diff)).recap


@servops_task(help={"variant": "Variant to render."})
def render(c, variant, hosts=None, inventory=None):
    """Print the launch script a variant renders to for each host, exactly as deploy would write it."""
    from servops import deploy as dep
    from servops.playbooks import load_variant

    v = load_variant(variant)
    run = on_hosts(inventory, hosts, lambda hs: (OK, "", dep.render_preview(hs, v)))
    run.recap.machine_output = True  # stdout is exactly the script deploy writes
    for h, text in run.each():
        if len(run.targets) > 1:
            sys.stdout.write(f"# ---- {h.name} ----\n")
        sys.stdout.write(text)
    sys.stdout.flush()
    return run.recap


@servops_task(help={
    "variant": "Variant to check: playbooks/<variant>.yml (e.g. baseline, piecewise).",
    "json": "Print one JSON object per host (version, rules, argv, problems, facts, timings).",
    "verbose": "Each host's full detail (the default for one host; several get one compact table).",
})
def check(c, variant, json=False, verbose=False, hosts=None, inventory=None):
    """Launch preflight, read-only: the variant's launch parsed by the host's own sglang, model path, port, GPUs."""
    from servops import launchcheck as lc
    from servops.multinode import variants_per_host
    from servops.playbooks import load_variant
    from servops.redact import remember, variant_secrets
    from servops.releases import deploy_root

    inv, targets = select(inventory, hosts)
    v = load_variant(variant)  # an unknown variant fails before any connection
    for h in targets:  # its secrets (HF_TOKEN, --api-key) print as ***
        remember(variant_secrets(v, h.get("secret_vars") or ()))
    per_host = variants_per_host(v, targets)  # multi-node: each node's rank flags, as deploy sets them

    def op(hs):
        res = lc.check_variant(hs, per_host[hs.host.name], deploy_root=deploy_root(hs.host))
        return (OK if res.ok else FAILED), res.summary(), res

    run = VerbRun(inv, targets).run(op)
    run.recap.machine_output = json
    checks = [res for _h, res in run.each()]
    if json:
        for res in checks:
            print(json_text({**{k: getattr(res, k) for k in (
                "host", "variant_name", "sglang_version", "parser", "static", "rules", "argv", "ok", "problems",
                "warnings", "facts", "note", "elapsed_s", "host_timings")},
                "caches": res.caches.lines() if res.caches else None}, indent=1, default=str))
    elif checks:
        lc.print_checks(checks, verbose)
    return run.recap


@servops_task(help={"variant": "Variant name: playbooks/<variant>.yml, as deploy would resolve it for each host.",
                    "fix": "Synthesise a patch for each break no stored patch covers (the boundary call made an "
                           "opaque torch.library custom op), prove it (the audit passes with it and the compiled "
                           "prefill equals the eager one at every captured size) and store it in patches/.",
                    "rounds": "At most N audit rounds (each a start of the audit server).",
                    "tolerance": "Largest |compiled - eager| input-token logprob a proof accepts (nats).",
                    "json": "Print JSON for machines."},
              bounds={"rounds": (1, 20), "tolerance": (0, 10)})
def audit(c, variant, fix=False, rounds=4, tolerance=0.02, json=False, hosts=None, inventory=None):
    """Find every dynamo break of a variant's compiled region before the restart; --fix writes the fixes.

    The engine's own compile and capture pass for the variant's resolved flags and ALL its prefill
    capture sizes, on a shrunk copy of the host's model
    (same architecture and quantization, the fewest layers that keep every layer kind, dummy weights),
    in a child server beside the serving one. Reports each dynamo break (reason, frames, the boundary
    call) and whether a stored patch covers it; --fix writes and proves the fixes. Nothing on the
    host changes (the fix set is served to the audit server from patched copies); each round is in
    the host's history. A host with no GPU, or too little free GPU memory, says "NOT audited"."""
    from servops import auditstage
    from servops.playbooks import load_variant

    inv, targets = select(inventory, hosts)
    v = load_variant(variant)  # an unknown variant fails before any connection
    run = VerbRun(inv, targets).run(lambda hs: auditstage.audit_host(hs, v, fix=fix, rounds=rounds,
                                                                      tolerance=tolerance))
    run.recap.machine_output = json
    for _h, data in run.each():
        if not data:
            continue
        if json:
            print(json_text(data, indent=1, default=str))
        else:
            auditstage.print_breaks(data)
    return run.recap


@servops_task(help={"check": "Fail (exit 1) for a host whose current release is not up and healthy."})
def status(c, check=False, hosts=None, inventory=None):
    """Current release, variant, patches, server pid, health and uptime per host.

    A current release whose server is down (after a reboot, a stop) or unhealthy is said so, with
    the command that brings it back; --check makes that host's line a failure."""
    from servops import ops

    run = on_hosts(inventory, hosts, lambda hs: ops.status(hs, check))
    ops.print_status([row for _h, row in run.each()])
    return run.recap


@servops_task(help={"lines": "How many lines from the end.", "follow": "Keep printing new lines (Ctrl-C stops).",
                    "release": "A release other than current (a name from invoke releases)."})
def logs(c, lines=100, follow=False, release="", hosts=None, inventory=None):
    """Show the server log of the current (or given) release."""
    from servops import ops

    inv, targets = select(inventory, hosts)
    if follow and len(targets) > 1:
        from servops.errors import ServopsError

        raise ServopsError(f"logs -f follows one host; pick one with -H (selected: {', '.join(h.name for h in targets)})")
    run = on_hosts(inventory, hosts, lambda hs: ops.logs(hs, lines, release or None))
    run.recap.machine_output = True  # stdout is the log itself: the recap goes to stderr
    for h, res in run.each():
        ops.print_logs(h.name, res, prefix=len(targets) > 1)
    if follow and not run.recap.failed:
        ops.follow(inv, targets[0], run.results[targets[0].name])
    return run.recap


@servops_task(help={"grace": "Seconds between SIGTERM and SIGKILL (default: the release's stop_grace).",
                    "break_lock": "Stop even if another operator holds the deploy lock."}, changes="stop")
def stop(c, grace=0.0, dry_run=False, break_lock=False, hosts=None, inventory=None):
    """Stop the server and every process of its release (SIGTERM, SIGKILL after the grace); never mid-deploy.

    Children deaf to SIGTERM, a child still serving after its leader died, a setsid() escapee:
    all found (session, group, descendants, the release's mark) and ended; the port is checked
    free, and on a GPU host nvidia-smi's compute apps too."""
    from servops import deploy as dep

    return on_hosts(inventory, hosts, lambda hs: dep.stop(hs, grace or None, dry_run, break_lock)).recap


_RESTART_HELP = {"break_lock": "Take the deploy lock even if another operator holds it.",
                 "allow_drift": "Run the release even where its launch files were edited on the host since servops "
                                "wrote them (refused by default, naming each file)."}


@servops_task(help=_RESTART_HELP, changes="start")
def start(c, dry_run=False, break_lock=False, allow_drift=False, hosts=None, inventory=None):
    """Bring the current release's server up where it is down (after a reboot or a stop), health-gated.

    No new release: its launch script and patch set as deployed (patches re-applied if they went).
    Already running and healthy: ok, nothing done. A crash at start rolls back to the previous
    healthy release, as a deploy does."""
    from servops import deploy as dep

    return on_hosts(inventory, hosts, lambda hs: dep.restart_current(hs, "start", dry_run, break_lock,
                                                                     allow_drift)).recap


@servops_task(help=_RESTART_HELP, changes="restart")
def restart(c, dry_run=False, break_lock=False, allow_drift=False, hosts=None, inventory=None):
    """Stop and start the current release, health-gated; a crash rolls back to the previous healthy release."""
    from servops import deploy as dep

    return on_hosts(inventory, hosts, lambda hs: dep.restart_current(hs, "restart", dry_run, break_lock,
                                                                     allow_drift)).recap


@servops_task(name="run", positional=["command"], changes="run", help={
    "command": "Shell command to run on each selected host, e.g. 'nvidia-smi'.",
    "sudo": "Run it with sudo -n (non-interactive: a password prompt fails instead of hanging).",
    "timeout": "Seconds the command may take on each host (default 60).",
}, bounds={"timeout": (1, 86400)})
def run_(c, command, sudo=False, timeout=60, hosts=None, inventory=None):
    """Run an ad-hoc command on the selected hosts (Ansible's -a): output per host, its exit status in the recap."""
    from servops import ops
    from servops.errors import ServopsError

    if not command.strip() or "\0" in command:
        raise ServopsError("run: give the command to run, e.g. invoke run 'nvidia-smi' -H gpus")
    run = on_hosts(inventory, hosts, lambda hs: ops.run_command(hs, command, sudo, int(timeout)))
    for h, out in run.each():
        ops.print_command(h.name, out)
    return run.recap


@servops_task(help={"json": "Print JSON lines for machines.", "last": "Only the last N entries (default: all)."})
def history(c, json=False, last=0, hosts=None, inventory=None):
    """Every change servops made to each host, from the append-only journal on the host.

    Deploys, rollbacks (automatic or not, and why), patch apply/revert, stops, guard actions and
    tune trials: who (local user and machine), when, what, and the outcome."""
    from servops import ops

    run = on_hosts(inventory, hosts, lambda hs: ops.history(hs, last))
    run.recap.machine_output = json
    for h, entries in run.each():
        if json:
            for e in entries:
                print(json_text(dict(e, host=h.name), sort_keys=True))
        else:
            ops.print_history(h.name, entries)
    return run.recap


@servops_task(name="releases", help={
    "pin": "Pin this release (a name from the listing): never pruned, whatever keep_releases says.",
    "unpin": "Unpin this release (with --why: only that reason).",
    "why": "The reason shown for a pin (default: pinned by hand).",
})
def releases_(c, pin="", unpin="", why="", hosts=None, inventory=None):
    """List the releases on each host: variant, status, patches, and why each is kept.

    Never pruned: the current release, the previous healthy one, the release current when a
    campaign started, a campaign's base and best, and any release pinned with --pin."""
    from servops import ops
    from servops.errors import ServopsError

    if pin and unpin:
        raise ServopsError("give --pin or --unpin, not both")
    if pin or unpin:
        if not hosts:
            from servops.cli import require_hosts

            require_hosts("releases --pin", inventory)
        return on_hosts(inventory, hosts, lambda hs: ops.pin(hs, pin or unpin, why or None, bool(unpin))).recap
    run = on_hosts(inventory, hosts, ops.list_releases)
    ops.print_releases({h.name: listing for h, listing in run.each()})
    return run.recap


@servops_task(help={
    "release": "Release NAME as `invoke releases` lists it (default: after an automatic rollback the most "
               "recent failed release, else the current one).",
    "log": "A local log file instead of a release's server.log (its frames are still resolved on the host).",
    "offline": "With --log: diagnose here, without a host (no source context or version checks).",
    "json": "Print one JSON object per failure (verdict: explained by a known issue or unexplained; category: a known "
            "issue's, else the evidence's above its threshold, else null with `leans`; confidence and evidence lines; "
            "action; entry, root/final exception, frames, ranks); the verdict line goes to stderr.",
    "explain": "Show the call chain from the entry point (e.g. the graph capture) to the failing call.",
    "context": "Source lines shown around each frame.",
    "allow_outside": "Also read frame files outside the host venv's site-packages and stdlib.",
}, bounds={"context": (0, 200)})
def diagnose(c, release="", log="", offline=False, json=False, explain=False, context=3, allow_outside=False,
             hosts=None, inventory=None):
    """Explain crashes: failures in the log, each frame's host source, known issues, else a category from the evidence (shown above the held-out threshold, else uncategorised); the next action for the host's release; with several hosts, one row per distinct failure. Exit 0 only when the log shows no failure, 1 a failure (explained or not)."""
    from invoke import Exit

    from servops import diagnose as dg

    code = dg.run(release=release, log=log, offline=offline, as_json=json, explain=explain, context=context,
                  allow_outside=allow_outside, hosts=hosts, inventory=inventory)
    if code:
        raise Exit(code=code)


@servops_task
def disconnect(c, hosts=None, inventory=None):
    """End the persistent SSH connections (connection agents) to the hosts, like `ssh -O exit`."""
    from servops import connagent

    inv, targets = select(inventory, hosts)
    run = VerbRun(inv, targets)
    for h in targets:
        pids = connagent.disconnect(h)
        run.recap.mark(h.name, CHANGED if pids else OK, f"closed (agent pid {', '.join(map(str, pids))})" if pids
                       else "no persistent connection")
    return run.recap


@servops_task(name="up")
def lab_up(c, hosts=None, inventory=None):
    """Start the lab on this machine: real sshd for each lab host of inventory/lab.yml, the lab venv."""
    from servops.lab import manage

    inv, targets = select(inventory, hosts)
    run = VerbRun(inv, targets)
    started = manage.up(targets)
    for h in targets:
        addr = f"{h.ssh_host}:{h.ssh_port}"
        run.recap.mark(h.name, CHANGED if addr in started else OK, f"sshd {'started' if addr in started else 'running'} on {addr}")
    console.print(f"lab up; try: invoke deploy --variant baseline -H {targets[0].name}", markup=False)
    return run.recap


@servops_task(name="down")
def lab_down(c, hosts=None, inventory=None):
    """Stop the lab: each lab host's server (from its deploy_root), then its sshd. Idempotent."""
    from servops.lab import manage

    inv, targets = select(inventory, hosts)
    run = VerbRun(inv, targets)
    servers, sshds = manage.down(targets)
    for h in targets:
        mine = [s for s in servers if s.startswith(f"{h.name} ")] + \
               [f"sshd {a}" for a in sshds if a == f"{h.ssh_host}:{h.ssh_port}"]
        run.recap.mark(h.name, CHANGED if mine else OK, ("stopped " + ", ".join(mine)) if mine else "nothing running")
    return run.recap


@servops_task(name="run", positional=["campaign"], changes="tune", help={
    "campaign": "Campaign name (campaigns/<name>.yml) or a path to one.",
    "resume": "Continue a campaign that was interrupted: finished trials are not repeated.",
    "restart": "Start over: the campaign's earlier trials.jsonl is moved aside.",
    "verbose": "Also print what each deploy and bench prints (phase lines, the health wait, crash excerpts).",
    "storage": "search: random/tpe: the Optuna study's database URL (postgresql://user@host/db) to share one "
               "study between controllers; default: study.db beside the campaign's trials.jsonl.",
    "serial": "Several hosts: leave the winner deployed N hosts at a time (default: all at once).",
    "warm_start": "search: random/tpe: ask first the best points of earlier campaigns (this objective) that ran "
                  "on the same engine, engine version and model; the report says where each came from.",
})
def tune_run(c, campaign, resume=False, restart=False, verbose=False, dry_run=False, hosts=None,  # noqa: D417
             inventory=None, storage=None, serial=0, warm_start=False):
    """Run a tuning campaign on one host, or on several alike hosts at once: deploy, bench, diagnose each trial.

    Every trial is journaled here and on the host; a crash whose known issue names a patch is
    retried with it (auto_patch); the best feasible trial (or the base) is left deployed. With
    several hosts (-H gpu1,gpu2): one trial per host at a time, one study, the hosts checked alike
    first; the winner is left deployed on every host (--serial N: N at a time). Resumable."""
    from servops import tune
    from servops.campaign import load_campaign
    from servops.errors import ServopsError

    camp = load_campaign(campaign)  # one-line errors naming file and key, before any connection
    if resume and restart:
        raise ServopsError("--resume continues a campaign, --restart starts it over: choose one")
    if storage:
        from servops.study import check_url

        if camp.search == "grid":
            raise ServopsError(f"--storage: campaign {camp.name} is a grid (search: grid); the study's database "
                               "is for search: random or tpe")
        check_url(storage)
        from servops.study import open_study

        open_study(camp.name, storage, camp.search, camp.objective.sense, camp.seed, camp.max_trials)  # reachable?
    if warm_start and camp.search == "grid":
        raise ServopsError(f"--warm-start: campaign {camp.name} is a grid (search: grid), which runs every point "
                           "anyway; warm start is for search: random or tpe")
    inv, targets = select(inventory, hosts)
    if warm_start and len(targets) > 1:
        raise ServopsError("--warm-start: give one host (-H); a fleet campaign's study starts from its own trials")
    if dry_run:
        run = on_hosts(inventory, ",".join(h.name for h in targets), lambda hs: (lambda rows: (
            CHANGED, f"would run {sum(r['state'] == 'would run' for r in rows)} trial(s) (check mode)", rows))(
            tune.plan_campaign(hs, camp)))
        for h, rows in run.each():
            tune.print_plan(h.name, camp, rows)
        return run.recap
    if serial and len(targets) == 1:
        raise ServopsError("--serial: a campaign on one host changes one host; give several with -H")
    if restart:
        for h in targets:
            tune.archive_log(h.name, camp.name)
    if len(targets) > 1:
        from servops import tunefleet

        if restart:
            tunefleet.archive(camp.name)
        return tunefleet.run_fleet(inv, targets, camp, resume, verbose, storage, serial or None)
    host = targets[0]
    def finished(s: dict) -> tuple:
        if not s["changed"]:  # --resume of a campaign that had finished: nothing ran now
            return OK, f"campaign finished earlier (winner {s['winner'] or 'none'}); deployed now: {s['current']}", s
        return CHANGED, f"winner {s['winner'] or 'none'}, deployed: {s['current']}; log {s['log']}", s

    run = on_hosts(inventory, host.name, lambda hs: finished(tune.run_campaign(hs, camp, resume, verbose, storage,
                                                                                   warm_start)))
    return run.recap


@servops_task(name="report", positional=["campaign"], help={
    "campaign": "Campaign name (campaigns/<name>.yml) or a path to one.",
})
def tune_report(c, campaign, hosts=None, inventory=None):
    """Write a campaign's report: Markdown and a self-contained HTML page with embedded plots.

    Read from results/<host>/campaigns/<name>/trials.jsonl only: no connection. Several hosts that
    ran the campaign together (-H gpu1,gpu2): one report in results/_fleet/<name>/, a host column."""
    from servops import tunereport
    from servops.campaign import load_campaign

    camp = load_campaign(campaign)
    inv, targets = select(inventory, hosts)
    from servops.tunefleet import fleet_hosts

    fleet = fleet_hosts(camp.name, [h.name for h in targets])
    if fleet:  # the hosts ran it together: one report, with the host of each trial
        md, html = tunereport.write_report(fleet[0], camp, fleet=fleet)
        return VerbRun(inv, targets).local(lambda h: (OK, f"wrote {md} and {html} (the fleet's report)")).recap
    return VerbRun(inv, targets).local(
        lambda h: (lambda md, html: (OK, f"wrote {md} and {html}"))(*tunereport.write_report(h.name, camp))).recap


tune_ns = Collection("tune")
tune_ns.add_task(tune_run, default=True)
tune_ns.add_task(tune_report)
patch_ns = Collection("patch", patch_status, patch_apply, patch_revert, patch_create, patch_preflight)
lab_ns = Collection("lab", lab_up, lab_down)
ns = Collection(lab_ns, inspect, deploy, rollback, render, status, logs, stop, start, restart, run_, releases_, metrics,
                bench, compare, diagnose, history, check, audit, disconnect, patch_ns, tune_ns)
