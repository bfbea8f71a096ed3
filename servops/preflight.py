"""patch.preflight: prove a patch's fix on the host's own python before a server depends on it.

`dynamo_fullgraph` compiles, with torch.compile(fullgraph=True), a function that calls the
patched entry point (e.g. is_cuda_version_at_least("12.8")). On the pristine flashinfer file
dynamo raises Unsupported (the nvcc subprocess); on the patched one it compiles and runs.
"""

from __future__ import annotations

from .patchstore import Patch, PatchError
from .remote_exec import run_program
from .transport import HostSession


def host_env(hs: HostSession) -> dict[str, str]:
    env = hs.host.get("env") or {}
    if not isinstance(env, dict):
        raise PatchError(f"{hs.host.source}: host '{hs.host.name}' var 'env' must be a mapping")
    return {str(k): str(v) for k, v in env.items()}


def run_preflight(hs: HostSession, patch: Patch, timeout: int = 600) -> dict:
    if not patch.preflight:
        raise PatchError(f"patch {patch.name} has no 'preflight' in {patch.path.with_suffix('.yml')}")
    pf = patch.preflight
    args = {"module": pf["module"], "call": pf["call"], "args": pf.get("args") or [],
            "backend": pf.get("backend", "eager")}
    return run_program(hs, "preflight_dynamo", args, env=host_env(hs), timeout=timeout)
