"""A deploy's pure stages: each takes data and returns data, never a host session, so each is
unit-tested from fixture facts (tests/test_deploy_stages.py). deploy.deploy_group runs them, each
once, top to bottom:

    validate     deploy.validate: local input only (bad input: one line, the host untouched)
    facts        launchcheck.read_facts: ONE round trip (the engine's check program, with
                 deploy_facts: the current release, the patch state, the lock); facts_request
                 says what it asks for
    resolve      launchcheck.resolve: the variant's `when:` rules for the host's engine version
    render       render.render_launch: the launch script and argv
    check        launchcheck.verdict: the host parser's result on that launch, from the facts
    plan         plan: "unchanged" (nothing to restart) or what changes (release files, patches)
    transaction  deploy._deploy_locked: lock, release, patches, restart, gate, conclude
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from . import engines, jitcache, patching, patchplan, patchstore
from .errors import ServopsError
from .inventory import Host
from .provenance import REPO
from .render import Launch

# The files of a release the server runs from: what decides "unchanged" (release.json and
# variant.yml hold timestamps and metadata: they restart nothing), besides the server files.
LAUNCH_FILES = ("launch.sh", "secrets.env")


def facts_request(host: Host, variant: dict, store: list[patchstore.Patch], script: bool = False) -> dict:
    """What the facts round trip asks deploy_facts for: the digests of the current release's
    launch files (its launch.sh text too, for a --diff) and the state of every patch in the
    store: a plan reverts whatever is applied and not wanted, so each counts, not only those the
    variant and its `when:` rules name."""
    names = set(LAUNCH_FILES) | {Path(f).name for f in engines.of_variant(variant).server_files(host)}
    return {"files": sorted(names), "script": script, "patches": [p.remote_spec() for p in store]}


def launch_files(host: Host, variant: dict, launch: Launch) -> dict[str, dict]:
    """The release files the server runs from, as deploy writes them: launch.sh, secrets.env
    (0600; only with secrets), the engine's server files (e.g. the lab's SGLang double)."""
    files = {"launch.sh": {"text": launch.script, "mode": 0o700}}
    if launch.secret_env:
        files["secrets.env"] = {"text": launch.secrets_file(), "mode": 0o600}
    for local in engines.of_variant(variant).server_files(host):
        path = Path(local) if Path(local).is_absolute() else REPO / local
        if not path.is_file():
            raise ServopsError(f"{host.source}: server_files entry {local!r} does not exist locally")
        files[path.name] = {"text": path.read_text(encoding="utf-8")}
    return files


def digests(files: dict[str, dict]) -> dict[str, str]:
    """name -> "sha256=<hex>" of each file's text, as the host's release_identity writes them."""
    return {name: "sha256=" + hashlib.sha256(spec["text"].encode()).hexdigest() for name, spec in files.items()}


@dataclass
class Plan:
    """What a deploy would do on one host."""
    current: str | None                 # the release `current` names now (None: no release yet)
    unchanged: str | None               # `current`, when deploying would change nothing
    actions: list = field(default_factory=list)   # (action, patch): the patch set made the release's
    caches: jitcache.CachePlan | None = None      # the JIT/compile caches the launch finds (jit_cache_dir)
    prebuild: str | None = None                   # why its kernels are built before the old server stops

    def text(self, variant_name: str) -> str:
        """Check mode's line."""
        summary = ", ".join(f"{a} {p.name}" for a, p in self.actions)
        return (f"would deploy {variant_name} (replacing {self.current or 'nothing'})"
                + (f"; patches: {summary}" if summary else "") + self.caches_text() + " (check mode)")

    def caches_text(self) -> str:
        if self.caches is None:
            return ""
        told = "; ".join(f"{jitcache.KINDS[k.kind]} {'reuse' if k.reuse else 'rebuild'}" for k in self.caches.kinds)
        expected = self.caches.expected_rebuild_s()
        when = ("" if not self.caches.rebuild else
                "; built before the old server stops" if self.prebuild else "; built during the restart")
        return f"; caches: {told}" + (f" (~{expected:.0f}s)" if expected else "") + when


def plan(host: Host, facts: dict, resolved: dict, launch: Launch, wanted: list[str],
         store: list[patchstore.Patch], nodes: int = 1) -> Plan:
    """From the facts (deploy_facts' part), the resolved variant and its launch: the patch
    actions that make the host's applied set `wanted` (refusing a required patch that conflicts,
    is not installed or does not match), and whether the deploy changes nothing: the current
    release has the same launch files, the same patch set (recorded, and on disk: no actions)
    and its server is up and healthy; and the caches it finds (whether its kernels are built
    before the old server stops: a single-node server, `nodes` 1)."""
    found = facts["deploy"]
    ours = digests(launch_files(host, resolved, launch))  # a server file missing here refuses now
    actions = patchplan.actions(host.name, store, patching.status_rows(host.name, store, found["patches"]), wanted)
    cur = found.get("current") or {}
    caches = jitcache.plan(engines.of_variant(resolved), launch.argv, facts.get("caches"))
    serving = bool(cur.get("name") and cur.get("healthy"))  # with nothing serving, a pre-build saves no downtime
    result = Plan(current=cur.get("name"), unchanged=None, actions=actions, caches=caches,
                  prebuild=jitcache.warmup_wanted(caches, host, nodes) if serving else None)
    if actions or not cur.get("name") or not cur.get("healthy") or cur.get("status") not in ("healthy", "unconfirmed"):
        return result
    if list(cur.get("patches") or []) != list(wanted):
        return result
    if any((cur.get("files") or {}).get(n) != ours.get(n) for n in set(ours) | set(LAUNCH_FILES)):
        return result
    result.unchanged = cur["name"]
    return result
