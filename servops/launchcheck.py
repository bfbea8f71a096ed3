"""Launch preflight: the rendered launch, checked against the host's OWN sglang, before anything stops.

One SSH round trip (servops/remote/launch_check.py, with sglang_args.py): the host reports its
installed sglang version and parses the argv of every `when:` branch of the variant with sglang's
real parser (`ServerArgs.add_cli_args` on an argparse.ArgumentParser, as `sglang.launch_server`
builds it; never ServerArgs resolution, model config or GPUs) or, where sglang does not import,
with the same parser rebuilt from its source (a static check). The controller keeps the branch
that the host's version selects. Besides the flags: the model path exists, the port is free or
servops' own server holds it, and nvidia-smi (when present) shows at least the GPUs the launch
needs.

As stages (deploystages): read_facts is the round trip (a deploy's facts trip: the same program
with deploy_facts), resolve and verdict are pure; check_variant runs them for `invoke check`.

Refusals are one line per problem, naming the flag, the host's sglang version and, for a flag
sglang does not know, the closest flags it does know:
    --cuda-graph-max-bz: unrecognized on sglang 0.5.23; did you mean --cuda-graph-max-bs-decode, ...?
A variant whose `when:` rules refuse the host's release (its intent does not exist there) is
refused first, in its own words:
    piecewise cannot run on sglang 0.5.2: no piecewise CUDA graph before sglang 0.5.3.post2 ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import engines, hostreply, jitcache
from .errors import ServopsError
from .hostreply import shown
from .inventory import Host
from .playbooks import apply_rules, matching_rules, when_branches
from .remote_exec import run_program
from .render import Launch, render_launch
from .transport import HostSession

# Server modules that stand in for sglang (the lab's test double): they load no weights.
DOUBLE_MODULES = {"sglang_double"}
REAL_MODULE_PREFIX = "sglang."


class LaunchRefused(ServopsError):
    """The launch would fail on this host: refused before the lock is taken or anything stops."""


@dataclass
class LaunchCheck:
    host: str
    variant_name: str
    sglang_version: str | None          # the host's installed sglang (None: not installed)
    static: bool                        # True: checked by reading sglang's source, not by importing it
    parser: str | None                  # "real", "cached" (the real parser's flag table, kept on the
                                        # host), "static", or None (nothing to check against)
    rules: list[str]                    # the `when:` rules that applied, described
    variant: dict                       # the variant resolved for this host's sglang
    argv: list[str]                     # the launch argv that was checked
    ok: bool
    problems: list[str]                 # one line each; empty when ok
    warnings: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)   # model, port, gpus, gpus_needed, python
    elapsed_s: float = 0.0              # the round trip, as the controller measured it
    note: str | None = None             # why the check was static / why nothing was checked
    host_timings: dict = field(default_factory=dict)
    branches: int = 1                   # argvs the host parsed in this round trip
    server_module: str = "sglang.launch_server"
    flag_problems: list[str] = field(default_factory=list)  # the problems the host's parser found
    engine: str = "sglang"              # the variant's engine (sglang_version is then that engine's version)
    caches: jitcache.CachePlan | None = None  # the host's JIT/compile caches for this launch (jit_cache_dir)

    @property
    def checked(self) -> bool:
        return self.parser is not None

    def summary(self) -> str:
        """One line for the recap."""
        e = self.engine
        how = {"real": f"{e}'s parser", "cached": f"{e}'s parser, cached", "static": f"static check of {e}'s source",
               None: "not checked"}[self.parser]
        rules = f", {len(self.rules)} rule(s)" if self.rules else ""
        if not self.ok:
            more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            by = f" by {how}" if self.parser else ""
            return f"refused{by}: {self.problems[0]}{more}"
        if not self.sglang_version:
            return f"no {e} on the host: flags not checked ({self.server_module}); facts ok in {self.elapsed_s:.2f}s"
        return f"launch ok on {e} {self.sglang_version} ({how}{rules}) in {self.elapsed_s:.2f}s"


def launch_branches(host: Host, variant: dict) -> tuple[list[dict], dict]:
    """Every `when:` branch of the variant rendered for this host (pure): the distinct launches
    the host's parser checks in the facts round trip, whichever version it turns out to have;
    and the environment of the branch with no rule (the program runs in it). A branch that does
    not render is left out: its error is raised only if it is the host's (render, after resolve)."""
    branches: list[dict] = []
    base_env = None
    for key, _example in when_branches(variant):
        resolved, _applied = apply_rules(variant, list(key))
        try:
            launch = render_launch(host, resolved)
        except ServopsError:
            continue
        branch = _branch_of(branches, launch, add=True)
        if key == ():
            base_env = branch["env"]
    if base_env is None:
        base_env = branches[0]["env"] if branches else {}
    return branches, base_env


def _branch_of(branches: list[dict], launch: Launch, add: bool = False) -> dict | None:
    """The branch that sends exactly this launch (argv and environment); `add`: made if missing."""
    env = dict(launch.env, **launch.secret_env)
    for branch in branches:
        if branch["argv"] == list(launch.argv) and branch["env"] == env:
            return branch
    if not add:
        return None
    branches.append({"id": f"b{len(branches)}", "argv": list(launch.argv), "env": env})
    return branches[-1]


def _run(hs: HostSession, branches: list[dict], deploy_root: str, env: dict,
         program: str = "launch_check", deploy: dict | None = None, caches: dict | None = None) -> tuple[dict, float]:
    port = hs.host.get("server_port")
    args = {"branches": branches, "deploy_root": deploy_root, "port": int(port) if port else None}
    if caches:
        args["caches"] = caches
    if deploy is not None:  # the check program with deploy_facts included: one round trip still
        args["deploy"] = deploy
        program += "+deploy_facts"
    started = time.monotonic()
    res = hostreply.check(run_program(hs, program, args, env=env or None), hostreply.LAUNCH_FACTS, hs.host.name,
                          program)
    if deploy is not None:  # asked for: there, and as deploy_facts writes it
        hostreply.check(res.get("deploy"), hostreply.DEPLOY_FACTS, hs.host.name, f"{program} (its deploy facts)")
    if "engine" in res and "sglang" not in res:  # another engine's program: its facts under "engine"
        res["sglang"] = res["engine"]
    return res, time.monotonic() - started


def read_facts(hs: HostSession, variant: dict, *, deploy_root: str, deploy: dict | None = None) -> dict:
    """The facts round trip: ONE run of the engine's check program. The host reports its python,
    engine and version, port, GPUs, and its own parser's verdict (real, or the cached flag table)
    on every `when:` branch of the variant as rendered for it (launch_branches), so the check of
    whichever branch its version selects is already in the reply; `deploy` (deploy_facts' request)
    adds the current release, the patch state and the lock. Returns the reply, with the branches
    sent ("sent") and the measured round trip ("elapsed_s"): the data the pure stages read."""
    engine = engines.of_variant(variant)
    branches, env = launch_branches(hs.host, variant)
    res, elapsed = _run(hs, branches, deploy_root, env, engine.check_program, deploy,
                        jitcache.facts_request(engine, hs.host))
    res["sent"], res["elapsed_s"], res["deploy_root"] = branches, round(elapsed, 3), deploy_root
    return res


def engine_version(facts: dict) -> str | None:
    return (facts.get("sglang") or {}).get("version")


def resolve(variant: dict, facts: dict) -> tuple[dict, list[str]]:
    """The variant as it applies to this host (pure): its `when:` rules for the host's engine
    version merged over it; and the rules that applied, described."""
    return apply_rules(variant, matching_rules(variant, engine_version(facts)))


def check_missing_branch(hs: HostSession, variant: dict, facts: dict, launch: Launch) -> None:
    """The second round trip, only where the facts trip could not hold the check: the host's
    version selects a combination of `when:` rules that none of the probe versions stood for, so
    its launch was not among those sent. Its check is added to `facts`."""
    if _branch_of(facts["sent"], launch) is not None:
        return
    branch = {"id": "exact", "argv": list(launch.argv), "env": dict(launch.env, **launch.secret_env)}
    res, more = _run(hs, [branch], facts["deploy_root"], branch["env"], engines.of_variant(variant).check_program)
    facts["branches"] = dict(facts.get("branches") or {}, exact=res["branches"]["exact"])
    facts["sent"] = facts["sent"] + [branch]
    facts["elapsed_s"] = round(facts["elapsed_s"] + more, 3)


def _problem_lines(result: dict, version: str | None, static: bool, engine: str = "sglang") -> list[str]:
    on = f"on {engine} {version}" + (" (static check)" if static else "")
    lines = []
    for p in result.get("problems") or []:
        flag, kind, msg, sugg = p.get("flag") or "", p.get("kind"), p.get("message") or "", p.get("suggestions") or []
        if kind == "unrecognized" and msg == "unrecognized":
            text = f"{flag}: unrecognized {on}" + (f"; did you mean {', '.join(sugg)}?" if sugg else "")
        elif kind == "unrecognized":
            text = f"{flag}: {msg} {on}"
        elif kind == "ambiguous":
            text = f"{flag}: ambiguous {on}; it could be {', '.join(sugg)}: spell the one you mean"
        elif kind == "required":
            text = f"{flag}: required {on}"
        else:  # a bad value (invalid choice, wrong type, missing argument) or argparse's own words
            text = f"{flag}: {msg} {on}" if flag else f"{msg} {on}"
        lines.append(text)
    return lines


def refusal_line(variant_name: str, version: str | None, resolved: dict, engine: str = "sglang") -> str | None:
    """A `when:` rule's refusal (the host's release lacks what the variant is for), as the
    first problem line, naming the variant and the version; None when no rule refused."""
    if not resolved.get("refuse"):
        return None
    return f"{variant_name} cannot run on {engine} {version}: {resolved['refuse']}"


def _fact_problems(check: LaunchCheck, result: dict, res: dict) -> list[str]:
    problems = []
    double = check.server_module in DOUBLE_MODULES
    facts = result.get("facts") or {}
    model = facts.get("model")
    if model and model.get("state") == "missing" and not double:
        problems.append(f"model path {model['path']} does not exist on the host")
    port = res.get("port")
    if port and port.get("state") == "busy":
        problems.append(f"port {port['port']} is already in use by a process servops did not start; "
                        f"free it or change server_port")
    gpus, needed = res.get("gpus"), facts.get("gpus_needed")
    if gpus and gpus.get("count") is not None and needed and not double:
        visible = _visible_gpus(gpus["count"], check.facts.get("cuda_visible_devices"))
        if needed > visible:
            problems.append(f"needs {needed} GPUs (tp x pp per node), nvidia-smi shows {visible}"
                            + (" visible (CUDA_VISIBLE_DEVICES)" if visible != gpus["count"] else ""))
    return problems


def gpu_fact_warnings(gpus: dict | None) -> list[str]:
    """What nvidia-smi could not tell (it failed or hung and was ended: "GPU facts unknown"; rows of
    its process list that did not parse, skipped): warnings, never a refusal, whoever's rows."""
    gpus = gpus or {}
    out = []
    if gpus.get("error"):
        out.append(f"GPU facts unknown: {shown(gpus['error'])}")
    elif gpus.get("users_error"):
        out.append(f"GPU memory holders unknown: {shown(gpus['users_error'])}")
    skipped = gpus.get("users_skipped")
    if skipped:
        rows = "; ".join(repr(shown(r, 60)) for r in skipped["rows"][:3])
        out.append(f"nvidia-smi listed {skipped['count']} process row(s) that do not parse (a pid that is not a "
                   f"number): skipped ({rows}{', ...' if skipped['count'] > 3 else ''})")
    return out


def gpu_user_warnings(users: list[dict]) -> list[str]:
    """The GPU memory holders servops did not start (launch_facts.gpu_users), as warnings: the
    new server gets that much less memory than its memory fraction assumes."""
    def listed(group: list[dict]) -> str:
        shown = [f"pid {u['pid']}{' ' + u['name'] if u.get('name') else ''} on GPU "
                 f"{u['gpu'] if u.get('gpu') is not None else '?'}"
                 + (f" ({u['used_mib']:,.0f} MiB)" if u.get("used_mib") is not None else "") for u in group[:4]]
        more = f" and {len(group) - 4} more" if len(group) > 4 else ""
        total = sum(u["used_mib"] for u in group if u.get("used_mib") is not None)
        return ", ".join(shown) + more + (f"; {total / 1024:,.1f} GiB in all" if total else "")

    foreign = [u for u in users if u.get("ours") is False]
    unseen = [u for u in users if u.get("ours") is None]
    out = []
    if foreign:
        out.append(f"GPU memory is held by {len(foreign)} process(es) servops did not start: {listed(foreign)}; "
                   f"the new server gets that much less than its memory fraction assumes (stop them, or lower "
                   f"--mem-fraction-static)")
    if unseen:
        out.append(f"GPU memory is held by {len(unseen)} process(es) this host's /proc cannot see (another "
                   f"container's pids?): {listed(unseen)}")
    return out


def _visible_gpus(count: int, cvd: str | None) -> int:
    if cvd is None:
        return count
    listed = [d for d in str(cvd).split(",") if d.strip()]
    return min(count, len(listed))


def check_variant(hs: HostSession, variant: dict, *, deploy_root: str) -> LaunchCheck:
    """Validate the variant's launch on this host (see the module doc): the facts round trip,
    then resolve, render and the verdict, as a deploy runs them."""
    facts = read_facts(hs, variant, deploy_root=deploy_root)
    resolved, applied = resolve(variant, facts)
    launch = render_launch(hs.host, resolved)  # raises the host's branch's own render error
    check_missing_branch(hs, variant, facts, launch)
    return verdict(hs.host, variant, resolved, applied, launch, facts, hs.redactor)


def verdict(host: Host, variant: dict, resolved: dict, applied: list[str], launch: Launch, facts: dict,
            redact=lambda text: text) -> LaunchCheck:
    """The launch check's verdict (pure): the host's parser's result on this launch, read from
    the facts, with the `when:` refusal, the model path, the port and the GPUs; problem and
    warning lines passed through `redact`."""
    engine = engines.of_variant(variant)
    res = facts
    info = res.get("sglang") or {}
    version = info.get("version")
    branch = _branch_of(res["sent"], launch)
    if branch is None:
        raise ServopsError(f"{host.name}: the facts hold no check of this launch (check_missing_branch runs first)")
    result = (res.get("branches") or {}).get(branch["id"]) or {}
    parser = info.get("parser")
    static = parser == "static"
    module = engine.server_module(host)
    e = engine.name
    check = LaunchCheck(
        host=host.name, variant_name=str(variant.get("name", "?")), sglang_version=version, static=static,
        parser=parser, rules=applied, variant=resolved, argv=list(branch["argv"]), ok=True, problems=[],
        elapsed_s=res.get("elapsed_s", 0.0), note=info.get("note"), host_timings=res.get("timings") or {},
        branches=len(res["sent"]), server_module=module, engine=e)
    facts = result.get("facts") or {}
    check.facts = {"python": res.get("python"), "python_version": res.get("python_version"),
                   "model": facts.get("model"), "port": res.get("port"), "gpus": res.get("gpus"),
                   "gpus_needed": facts.get("gpus_needed"),
                   "cuda_visible_devices": (branch.get("env") or {}).get("CUDA_VISIBLE_DEVICES"),
                   "values": result.get("values") or {}, "parser_actions": info.get("actions"),
                   "prog": info.get("prog"), "parser_cache": info.get("cache")}
    problems: list[str] = []
    warnings: list[str] = []
    refused = refusal_line(check.variant_name, version, resolved, e)
    if refused:
        problems.append(refused)
    if version is None:
        if module.startswith(REAL_MODULE_PREFIX) or e != "sglang":
            problems.append(f"{e} is not installed for {res.get('python')} (server_module {module})")
        else:
            check.note = f"no sglang installed for {res.get('python')}: nothing to check against; {module} parses its own flags"
    elif parser is None:
        warnings.append(f"{e} {version}'s flags were not checked: {info.get('note') or 'no parser'}")
    else:
        check.flag_problems = _problem_lines(result, version, static, e)
        problems.extend(check.flag_problems)
        used = {a.split("=", 1)[0] for a in check.argv if a.startswith("--")}
        for w in result.get("warnings") or []:
            warnings.append(f"{w['flag']}: {w['message']} ({e} {version})")
        unchecked = sorted(used & set(info.get("unchecked") or []))
        if static and unchecked:
            warnings.append(f"static check: values of {', '.join(unchecked)} were not checked (computed at run time)")
        skipped = info.get("skipped") or []
        if static and skipped:
            warnings.append(f"static check: {len(skipped)} flag registration(s) of {e} {version} could not be "
                            f"read ({skipped[0]}{', ...' if len(skipped) > 1 else ''}); a flag reported "
                            f"unrecognized may still exist there")
    missing = (facts.get("model") or {}).get("missing_architectures")
    if missing and version and module not in DOUBLE_MODULES and e == "sglang":
        warnings.append(f"model architecture {', '.join(missing)} (its config.json) is not among sglang {version}'s "
                        f"models: the launch fails unless something else serves it (--model-impl transformers, "
                        f"an external model package)")
    problems.extend(_fact_problems(check, result, res))
    unsafe = (res.get("caches") or {}).get("unsafe") if isinstance(res.get("caches"), dict) else None
    if unsafe:  # refused before anything stops: the inventory's jit_cache_dir is fixed first
        problems.append(f"jit_cache_dir: {str(unsafe)[:300]}; fix the directory or the inventory's jit_cache_dir")
    warnings.extend(gpu_fact_warnings(res.get("gpus")))
    if module not in DOUBLE_MODULES:
        warnings.extend(gpu_user_warnings((res.get("gpus") or {}).get("users") or []))
    check.problems = [redact(p) for p in problems]
    check.warnings = [redact(w) for w in warnings]
    check.ok = not problems
    check.caches = jitcache.plan(engine, check.argv, res.get("caches"))
    return check


def host_sglang_version(hs: HostSession) -> str | None:
    """The host's installed sglang version (None: not installed), read from its distribution
    metadata without importing it: one quick round trip, for `render` to pick the `when:` rules."""
    res = run_program(hs, "launch_check", {"version_only": True})
    return (res.get("sglang") or {}).get("version")


def raise_if_refused(check: LaunchCheck, host_name: str) -> None:
    """A refused check as ONE line: the host, the variant, the host's sglang, the first problem."""
    if check.ok:
        return
    more = (f" (+{len(check.problems) - 1} more: invoke check --variant {check.variant_name} -H {host_name})"
            if len(check.problems) > 1 else "")
    # a flag's problem names the host's sglang version (and "static check" where that applies)
    raise LaunchRefused(f"{host_name}: launch of {check.variant_name} refused: {check.problems[0]}{more}")


def _fact_rows(check: LaunchCheck) -> list[tuple[str, str]]:
    f = check.facts
    rows = []
    ver = check.sglang_version or "not installed"
    how = {"real": f"real parser ({f.get('parser_actions')} flags, prog {f.get('prog')!r})",
           "cached": f"real parser's cached flag table ({f.get('parser_actions')} flags, prog {f.get('prog')!r})",
           "static": f"STATIC check of its source ({f.get('parser_actions')} flags)", None: "not checked"}[check.parser]
    rows.append((check.engine, f"{ver}: {how}"))
    if f.get("parser_cache"):
        rows.append(("parser cache", shown(f["parser_cache"])))
    rows.append(("python", f"{f.get('python')} ({f.get('python_version')})"))
    model = f.get("model")
    if model:
        state = {"dir": "directory" + ("" if model.get("config") else " (no config.json)"), "file": "file",
                 "missing": "MISSING", "hub-id": "not a local path (hub id)"}.get(model.get("state"), model.get("state"))
        if model.get("state") == "missing" and check.server_module in DOUBLE_MODULES:
            state += f" (not needed by {check.server_module})"
        rows.append(("model path", f"{model['path']}: {state}"))
    port = f.get("port")
    if port:
        rows.append(("port", f"{port['port']}: " + {"free": "free", "ours": f"servops' server (pid {port.get('pid')})",
                                                      "busy": "IN USE by another process"}[port["state"]]))
    gpus = f.get("gpus")
    needed = f.get("gpus_needed")
    if gpus is None:
        rows.append(("GPUs", f"{needed or '?'} needed; no nvidia-smi on the host"))
    elif gpus.get("count") is None:
        rows.append(("GPUs", f"{needed or '?'} needed; GPU facts unknown: {shown(str(gpus.get('error')))}"))
    else:
        users = gpus.get("users")
        held = ("" if users is None else "; GPU memory: " + (
            "no process holds any" if not users else
            f"{sum(u.get('ours') is True for u in users)} of servops' server, "
            f"{sum(u.get('ours') is not True for u in users)} other process(es)"))
        rows.append(("GPUs", f"{needed or '?'} needed; nvidia-smi shows {gpus['count']}{held}"))
    timings = check.host_timings
    detail = ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in timings.items() if isinstance(v, (int, float)))
    rows.append(("round trip", f"{check.elapsed_s:.2f}s, 1 SSH command, {check.branches} argv(s) parsed"
                 + (f" (host: {detail})" if detail else "")))
    return rows


def print_checks(checks: list[LaunchCheck], verbose: bool = False) -> None:
    """What `invoke check` shows: each host's detail for one host (or with --verbose); for several,
    one compact row per host."""
    if len(checks) == 1 or verbose:
        for check in checks:
            print_check(check)
        return
    from rich.text import Text

    from .output import console, print_table, table

    t = table(f"launch check of {checks[0].variant_name} on {len(checks)} hosts (--verbose: each host's detail)",
              ["host", "sglang", "flags", "model", "port", "GPUs", "verdict"])
    for check in checks:
        t.add_row(*_compact_row(check),
                  Text("ok" if check.ok else f"REFUSED: {check.problems[0]}"
                       + (f" (+{len(check.problems) - 1} more)" if len(check.problems) > 1 else ""),
                       style="green" if check.ok else "bold red"))
    print_table(t)
    for check in checks:
        for w in check.warnings:
            console.print(f"{check.host}: warning: {w}", markup=False, highlight=False)
        for line in check.caches.lines() if check.caches else []:
            console.print(f"{check.host}: {line}", markup=False, highlight=False)
    console.file.flush()


def _compact_row(check: LaunchCheck) -> list[str]:
    """host, sglang, flags, model, port, GPUs: each in a few words."""
    f = check.facts
    sglang = f"{check.sglang_version} ({check.parser or 'not checked'})" if check.sglang_version else "not installed"
    flags = sum(1 for a in check.argv if a.startswith("--"))
    if not check.checked:
        flag_text = f"{flags} not checked"
    elif check.flag_problems:
        flag_text = f"{len(check.flag_problems)} of {flags} refused"
    else:
        flag_text = f"{flags} ok"
    model = f.get("model") or {}
    model_text = (f"{model.get('path')}: " + {"dir": "ok", "file": "ok", "missing": "MISSING", "hub-id": "hub id"}
                  .get(model.get("state"), str(model.get("state")))) if model else "-"
    if model.get("state") == "missing" and check.server_module in DOUBLE_MODULES:
        model_text = f"{model.get('path')}: not needed"
    port = f.get("port") or {}
    port_text = (f"{port['port']} " + {"free": "free", "ours": "servops'", "busy": "IN USE"}.get(port.get("state"), "?")
                 if port else "-")
    gpus = f.get("gpus")
    seen = "no nvidia-smi" if gpus is None else (gpus.get("count") if gpus.get("count") is not None else "?")
    gpu_text = f"{f.get('gpus_needed') or '?'} needed, {seen}" + ("" if gpus is None else " seen")
    return [check.host, sglang, flag_text, model_text, port_text, gpu_text]


def print_check(check: LaunchCheck) -> None:
    """What `invoke check` shows for one host. User text is printed with markup off."""
    from rich.text import Text

    from .output import console, print_table, table

    t = table(f"{check.host}: launch check of {check.variant_name}", ["check", "result"])
    for name, value in _fact_rows(check):
        t.add_row(name, value)
    for rule in check.rules or ["none (the variant's own server_args)"]:
        t.add_row("when rule", rule)
    if check.note:
        t.add_row("note", check.note)
    t.add_row("argv", " ".join(check.argv))
    for p in check.problems:
        t.add_row(Text("PROBLEM", style="bold red"), Text(p))
    for w in check.warnings:
        t.add_row(Text("warning", style="yellow"), Text(w))
    for line in check.caches.lines() if check.caches else []:
        t.add_row("caches", Text(line))
    print_table(t)
    console.file.flush()
