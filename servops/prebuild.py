"""A deploy's kernels built before the old server stops (issue #46.4): where the new launch's
JIT or compile caches must be rebuilt (servops.jitcache's plan), the new release's server is
started beside the serving one on a spare port, with the same cache directories, until it is
healthy, then ended (deploy_ctl's warmup op): the restart that follows finds its kernels built,
so the downtime is weights and capture, not the builds.

The warm-up's launch is the release's own, with the port `jit_warmup_port` (default: the
server's port + 100) and the host's `jit_warmup_args` over its server_args (e.g.
`{mem-fraction-static: 0.3}`, where the serving server leaves too little GPU memory for a second
one). A warm-up that fails (the GPU too full, a crash) changes nothing: the deploy goes on and
its restart builds the kernels, as without a warm-up; the line says so. `jit_warmup: false` on a
host turns it off."""

from __future__ import annotations

from dataclasses import replace

from . import releases, startup
from .bringup import health_timeout, signatures
from .inventory import Host
from .jitcache import CachePlan
from .progress import Phases
from .errors import RemoteError
from .render import Launch, render_launch
from .transport import HostSession

WARMUP_PORT_OFFSET = 100


def warmup_port(host: Host) -> int:
    """The host's jit_warmup_port, else the server's port + 100 (- 100 where + 100 is past 65535:
    port 65500's warm-up on 65600 raised OverflowError in the host program and failed the deploy)."""
    if host.get("jit_warmup_port"):
        return int(host.get("jit_warmup_port"))
    port = int(host.require("server_port"))
    return port + WARMUP_PORT_OFFSET if port + WARMUP_PORT_OFFSET <= 65535 else port - WARMUP_PORT_OFFSET


def warmup_launch(host: Host, resolved: dict) -> Launch:
    """The release's launch on the warm-up port, the host's jit_warmup_args over its server_args."""
    warm_host = replace(host, vars=dict(host.vars, server_port=warmup_port(host)))
    args = dict(resolved["server_args"], **(host.get("jit_warmup_args") or {}))
    return render_launch(warm_host, dict(resolved, server_args=args))


def run(hs: HostSession, release: str, resolved: dict, meta: dict, cache_plan: CachePlan, why: str,
        phases: Phases) -> dict:
    """The warm-up of `release` (prepared, its patches applied, the old server still serving);
    returns the host's outcome. A failure is a warning line, never the deploy's failure."""
    port = warmup_port(hs.host)
    expected = cache_plan.expected_rebuild_s()
    phases.step("prebuild", f"{hs.host.name}: {why}: starting {release} beside the serving server on port {port}"
                            + (f" (expected ~{expected:.0f}s)" if expected else ""))
    timeout = health_timeout(hs, meta["health"])
    try:
        with phases.wait(f"pre-build of {release}", timeout) as wait:
            res = releases.ctl(hs, "warmup", ssh_timeout=int(timeout) + 120,
                               on_progress=lambda p: wait.update(p["progress"], p.get("log", "")),
                               name=release, port=port, script=warmup_launch(hs.host, resolved).script,
                               health=meta["health"], timeout=timeout, signatures=signatures(meta),
                               caches=cache_plan.record_spec())
    except RemoteError as exc:  # the host program refused or failed: a warm-up that could not run changes nothing
        phases.step("warning", f"{hs.host.name}: pre-build could not run ({exc}); the restart builds the kernels")
        return {"state": "failed", "reason": str(exc)}
    ended = res.get("ended") or {}
    if ended.get("survivors"):
        phases.step("warning", f"{hs.host.name}: warm-up processes {ended['survivors']} survived SIGKILL")
    if res["state"] == "healthy":
        phases.step("prebuild", f"{hs.host.name}: built in {res['elapsed']:.1f}s, the old server serving "
                                f"throughout ({startup.text(startup.clean(res.get('start')))}); warm-up ended")
    else:
        phases.step("warning", f"{hs.host.name}: pre-build {res['state']}: {res.get('reason')}; the restart "
                               f"builds the kernels instead (its log: {res.get('log')})")
    if res.get("cache_problem"):
        phases.step("warning", f"{hs.host.name}: {res['cache_problem']}")
    return res
