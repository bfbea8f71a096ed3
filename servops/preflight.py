"""patch.preflight: prove a patch's fix on the host's own python before a server depends on it.

`dynamo_fullgraph` compiles, with torch.compile(fullgraph=True), a function that calls the
patched entry point (e.g. is_cuda_version_at_least("12.8")). On the pristine flashinfer file
dynamo raises Unsupported (the nvcc subprocess); on the patched one it compiles and runs.

`dynamo_call_site` compiles the ENGINE's call site, the function a capture crash's "from user
code:" frames name (sglang's FP8 block-scale linear), with tensors of the model's real shapes on the
host's GPU: pristine it must fail with dynamo's Unsupported, with the fix set (the patch and its
`with:` patches, applied to copies, nothing on the host changed) it must compile AND give the eager
result. Where that cannot run (no GPU, another GPU generation) the answer is "unproven", never a pass.
"""

from __future__ import annotations

from . import hostreply, patchstore
from .hostreply import shown
from .patchstore import Patch, PatchError
from .remote_exec import run_program
from .transport import HostSession


def host_env(hs: HostSession) -> dict[str, str]:
    env = hs.host.get("env") or {}
    if not isinstance(env, dict):
        raise PatchError(f"{hs.host.source}: host '{hs.host.name}' var 'env' must be a mapping")
    return {str(k): str(v) for k, v in env.items()}


def fix_set(patch: Patch) -> list[Patch]:
    """The patches a call-site proof applies together: the patch's `with:` list, then the patch."""
    names = list((patch.preflight or {}).get("with") or [])
    return [patchstore.find_patch(n) for n in names if n != patch.name] + [patch]


def call_site_args(hs: HostSession, patch: Patch) -> dict:
    pf = patch.preflight
    return {"check": "dynamo_call_site", "module": pf["module"], "call": pf["call"], "args": pf.get("args"),
            "backend": pf.get("backend", "eager"), "device": pf.get("device", "cuda"),
            "model_path": hs.host.get("model_path"), "patches": [p.remote_spec() for p in fix_set(patch)]}


# The proof's time on the host (inventory `preflight_timeout`): its children (the imports, the
# compiles) share it and are ended at it with their process groups; the controller waits a little
# longer, so the host's own answer ("unproven: ... did not finish") comes back rather than a timeout.
DEFAULT_PREFLIGHT_TIMEOUT = 600.0
REPLY_MARGIN = 30


def run_preflight(hs: HostSession, patch: Patch) -> dict:
    if not patch.preflight:
        raise PatchError(f"patch {patch.name} has no 'preflight' in {patch.path.with_suffix('.yml')}")
    pf = patch.preflight
    budget = float(hs.host.get("preflight_timeout") or DEFAULT_PREFLIGHT_TIMEOUT)
    if pf["check"] == "dynamo_call_site":
        args = call_site_args(hs, patch)
    else:
        args = {"module": pf["module"], "call": pf["call"], "args": pf.get("args") or [],
                "backend": pf.get("backend", "eager")}
    res = run_program(hs, "preflight_dynamo", dict(args, deadline_s=budget), env=host_env(hs),
                      timeout=int(budget) + REPLY_MARGIN)
    return hostreply.check(res, hostreply.PREFLIGHT, hs.host.name, "preflight_dynamo")


def _state_line(label: str, res: dict) -> str:
    if res.get("result") == "pass":
        cases = res.get("cases") or []
        return f"{label}: compiles under torch.compile(fullgraph=True), equal to eager ({len(cases)} call(s))"
    detail = " ".join(shown(part, 500) for part in (res.get("error_type"), res.get("message")) if part)
    return f"{label}: {res.get('result')}" + (f": {detail}" if detail else "")


def describe(patch: Patch, res: dict) -> list[str]:
    """What a preflight proved, as lines for people (the call site, each state, the shapes used)."""
    pf = patch.preflight
    if pf["check"] != "dynamo_call_site":
        if res["result"] == "pass":
            return [f"{pf['call']} compiles under torch.compile(fullgraph=True) (torch {res.get('torch', '?')})"]
        return [f"{shown(res.get('error_type') or res['result'], 200)}: {shown(res.get('message') or '', 500)}"]
    names = ", ".join(p.name for p in fix_set(patch))
    fixed = res.get("fixed") or {}
    lines = [f"call site {res.get('call_site')} on {fixed.get('device') or 'no GPU'} "
             f"(torch {fixed.get('torch', '?')}); fix set: {names}"]
    if res.get("message"):  # nothing could run (the model's shapes, the fix set's copies): said once
        lines.append(f"not run: {shown(res['message'], 500)}")
    else:
        lines += [_state_line("pristine", res.get("pristine") or {}), _state_line("with the fix set", fixed)]
    lines += [f"  shapes: {shown(case.get('what') or '?', 300)}" for case in fixed.get("cases") or []]
    verdict = {"pass": "proven: pristine crashes as the server does, the fix set compiles and matches eager",
               "unproven": "NOT proven on this host (see above): nothing was shown either way",
               "not-needed": "pristine already compiles here: this host does not need the fix",
               "fail": "the fix set does not make the call site compile cleanly"}
    lines.append(verdict.get(res["result"], res["result"]))
    return lines
