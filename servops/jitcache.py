"""The JIT and compile caches of a host: where they live, what a launch can reuse, what it will
rebuild and how long that took on this host before. Pure: the facts come from the launch
check's round trip (servops/remote/cache_ledger.py), the ledger is written on the host by the
health gate and the warm-up.

With `jit_cache_dir` in the inventory, every launch of that host sets the engine's own cache
variables (its room's `jit_caches`: FlashInfer's FLASHINFER_WORKSPACE_BASE, DeepGEMM's
SGLANG_DG_CACHE_DIR / DG_JIT_CACHE_DIR, TRITON_CACHE_DIR, sglang's TVM_FFI_CACHE_DIR,
TORCHINDUCTOR_CACHE_DIR, sglang's SGLANG_CACHE_DIR and vLLM's VLLM_CACHE_ROOT, whose
torch_compile_cache holds their compiled graphs) to one directory each under it, shared by every
release on the host: the engines key their entries themselves (FlashInfer by its version and the
GPU's arch, inductor and DeepGEMM by a hash of what they compile, vLLM by its config's hash), so
releases that can share a kernel share it and the others add their own beside it.

Which launches built what is servops' ledger: one key per kind of phase, the digest of what
decides its kernels: the installed versions (torch, triton, FlashInfer, the engine and its
kernel package), the model, and the launch's flags, less those that build no kernel (NOT_KERNEL:
port, memory fraction, request caps, logging); JIT kernels also ignore the CUDA-graph and
torch.compile flags (GRAPH_WORDS), which decide capture and compile, not which kernels are
built. A key in the ledger is "reuse"; one that is not is "rebuild", with the time it took this
host the last times it built one of that kind. (That the flags left out build no kernel is a
judgement, not something read from the engines.)"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass

from .inventory import Host
from .remote.startlog import MAX_PHASE_S

KINDS = {"jit_s": "JIT kernels", "compile_s": "torch.compile"}
NOT_KERNEL = frozenset({
    "port", "host", "served-model-name", "api-key", "log-level", "log-level-http", "log-requests",
    "log-requests-level", "uvicorn-log-level", "enable-metrics", "enable-metrics-for-all-schedulers",
    "mem-fraction-static", "gpu-memory-utilization", "max-running-requests", "max-num-seqs", "watchdog-timeout",
    "show-time-cost", "enable-cache-report", "disable-log-requests", "disable-log-stats", "enable-log-requests",
    "dist-init-addr", "node-rank", "nnodes", "skip-server-warmup"})
GRAPH_WORDS = ("cuda-graph", "piecewise", "compile", "enforce-eager")


def cache_env(engine, host: Host) -> dict[str, str]:
    """The engine's cache variables, each a directory under the host's jit_cache_dir ({}: none set)."""
    root = host.get("jit_cache_dir")
    if not root:
        return {}
    return {var: f"{str(root).rstrip('/')}/{name}" for name, var, _kind in engine.jit_caches}


def facts_request(engine, host: Host) -> dict | None:
    """What the launch check's round trip reads of the caches (None: the host sets no jit_cache_dir)."""
    root = host.get("jit_cache_dir")
    return {"dir": str(root), "names": {name: name for name, _v, _k in engine.jit_caches}} if root else None


def flag_pairs(argv: list[str]) -> list[tuple[str, str]]:
    """("flag", "value words") of a launch argv (a bare flag's value is "")."""
    pairs: list[tuple[str, str]] = []
    for word in argv:
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            pairs.append((name, value if eq else ""))
        elif pairs:
            name, value = pairs[-1]
            pairs[-1] = (name, f"{value} {word}".strip())
    return pairs


def keys(engine_name: str, argv: list[str], versions: dict) -> dict[str, str]:
    """{kind: the ledger key of this launch's kernels of that kind}."""
    flags = [(f, v) for f, v in flag_pairs(argv) if f not in NOT_KERNEL]
    jit = [(f, v) for f, v in flags if not any(w in f for w in GRAPH_WORDS)]
    base = {"engine": engine_name, "versions": sorted(versions.items())}

    def digest(what: list) -> str:
        return hashlib.sha256(json.dumps(dict(base, flags=sorted(what))).encode()).hexdigest()[:16]
    return {"jit_s": digest(jit), "compile_s": digest(flags)}


@dataclass
class KindPlan:
    kind: str                    # jit_s or compile_s
    caches: list[str]            # the cache directories of that kind
    reuse: bool
    key: str
    built_by: dict | None        # the ledger's entry of this key (reuse)
    history: list[float]         # seconds this host took for the other builds of this kind

    @property
    def expected_s(self) -> float | None:
        if self.reuse:
            return (self.built_by or {}).get("warm_s")
        return statistics.median(self.history) if self.history else None

    def text(self) -> str:
        what = f"{KINDS[self.kind]} ({', '.join(self.caches)})"
        if self.reuse:
            b = self.built_by or {}
            warm = f"; its latest start spent {b['warm_s']:.1f}s there" if b.get("warm_s") is not None else ""
            return f"{what}: reuse, built by {b.get('release', '?')} at {b.get('at', '?')}{warm}"
        if not self.history:
            return f"{what}: rebuild, no earlier build on this host to time it by"
        return (f"{what}: rebuild, expected ~{self.expected_s:.0f}s (the median of this host's "
                f"{len(self.history)} earlier build{'s' if len(self.history) > 1 else ''})")


@dataclass
class CachePlan:
    dir: str
    kinds: list[KindPlan]
    damaged: str | None = None

    @property
    def rebuild(self) -> list[KindPlan]:
        return [k for k in self.kinds if not k.reuse]

    def lines(self) -> list[str]:
        out = [f"caches in {self.dir}: " + k.text() for k in self.kinds]
        if self.damaged:
            out.append(f"cache ledger not read ({self.damaged}): every cache counts as rebuilt")
        return out

    def record_spec(self) -> dict:
        """What the health gate and the warm-up record on the host after a healthy start."""
        return {"dir": self.dir, "keys": {k.kind: k.key for k in self.kinds},
                "jit_dirs": [name for k in self.kinds if k.kind == "jit_s" for name in k.caches]}

    def expected_rebuild_s(self) -> float | None:
        times = [k.expected_s for k in self.rebuild]
        return None if not times or None in times else sum(times)


def plan(engine, argv: list[str], facts: dict | None) -> CachePlan | None:
    """The caches a launch (its argv) finds on the host, from the check's `caches` facts."""
    if not facts:
        return None
    ledger = facts.get("ledger") or {}
    found = ledger.get("kinds") if isinstance(ledger.get("kinds"), dict) else {}
    launch_keys = keys(engine.name, argv, facts.get("versions") or {})
    kinds = []
    for kind in KINDS:
        names = [name for name, _var, k in engine.jit_caches if k == kind]
        if not names:
            continue
        entries = found.get(kind) if isinstance(found.get(kind), dict) else {}
        key = launch_keys[kind]
        entry = entries.get(key) if isinstance(entries.get(key), dict) else None
        if entry is not None and not _plausible(entry.get("warm_s")):
            entry = {k: v for k, v in entry.items() if k != "warm_s"}
        history = [float(e["seconds"]) for k, e in entries.items()
                   if k != key and isinstance(e, dict) and _plausible(e.get("seconds"))]
        kinds.append(KindPlan(kind, names, entry is not None, key, entry, history))
    return CachePlan(str(facts.get("dir")), kinds, ledger.get("damaged"))


def _plausible(seconds) -> bool:
    """A build time a ledger may hold (the host's file: NaN, Infinity, -5 or 1e308 are not one)."""
    return isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds <= MAX_PHASE_S


def warmup_wanted(cache_plan: CachePlan | None, host: Host, nodes: int = 1) -> str | None:
    """Why a deploy pre-builds its kernels before the old server stops, or None: caches to
    rebuild, the host not opted out (jit_warmup: false), a single-node server."""
    if cache_plan is None or not cache_plan.rebuild or host.get("jit_warmup") is False or nodes > 1:
        return None
    return ", ".join(KINDS[k.kind] for k in cache_plan.rebuild) + " to build"
