"""What to do next about a failure `diagnose` found: a known issue's `action:`, else its category's,
worded for the host it happened on - the flag that host's own sglang parser takes (never a
deprecated alias), the whole fix set its release's piecewise variant carries, its engine's way to
keep a graph capture out of the way.

Two actions of the knowledge base are intents that only the host's release can word:
`audit the compiled region` (a dynamo failure no patch covers: `invoke audit --fix` on the failed
variant, else the release's workaround flag) and `disable CUDA graphs` (a capture the CUDA stream
refused). A known issue that suggests a variant (the seed's crash) names that variant's fix set for
the host's release.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AUDIT = "audit the compiled region"
NO_CUDA_GRAPHS = "disable CUDA graphs"
# What a known issue (or a category) may name as the operator's next step.
ACTION = re.compile(r"^(?:apply patch [A-Za-z0-9][\w.-]*|change flag (?:--[a-z][\w-]*|\(the one the message names\))|"
                    r"restart|free GPU memory|drain host|fix the model path|fix the install|"
                    + re.escape(AUDIT) + "|" + re.escape(NO_CUDA_GRAPHS) + r")$")
CATEGORY_ACTIONS = {
    "dynamo-trace": AUDIT, "cuda-oom": "change flag --mem-fraction-static",
    "nccl": "drain host", "illegal-memory-access": "change flag --attention-backend", "jit-build": "fix the install",
    "arch-unsupported": "fix the install", "model-load": "fix the model path", "port-in-use": "change flag --port",
    "triton-resources": "change flag --attention-backend", "quantization": "change flag --quantization",
    "config": "change flag (the one the message names)", "install": "fix the install", "host-limits": "drain host",
    "engine-death": "restart"}
_ENGINE_IN_PATH = re.compile(r"[\\/](sglang|vllm)[\\/]")


@dataclass(frozen=True)
class HostFacts:
    """What the next step depends on: the engine (the failed release's, else the one the log's
    frames run in), the host's installed sglang, and the failed release's variant."""
    engine: str | None = None
    sglang: str | None = None
    variant: str | None = None

    @classmethod
    def of(cls, result: dict, frames: list[str] = ()) -> "HostFacts":
        """From diagnose's host reply (offline: none) and the frame paths of the log's findings."""
        engine = result.get("release_engine")
        if engine is None:
            seen = {m.group(1) for path in frames for m in [_ENGINE_IN_PATH.search(path)] if m}
            engine = seen.pop() if len(seen) == 1 else None
        return cls(engine, (result.get("versions") or {}).get("sglang"), result.get("release_variant"))


def _audit(facts: HostFacts) -> str:
    """The audit with its fix loop; else the flag that keeps the graph out of dynamo, as the host's
    release spells it (the engine's room knows it: servops/engines)."""
    from . import engines

    if facts.engine == "vllm":
        return engines.get("vllm").workaround(None)
    on = f" (sglang {facts.sglang})" if facts.sglang else ""
    return (f"run invoke audit --fix --variant {facts.variant or '<variant>'}; or "
            f"{engines.get('sglang').workaround(facts.sglang)}{on}")


def _no_cuda_graphs(facts: HostFacts) -> str:
    return {"vllm": "change flag --enforce-eager", "sglang": "change flag --disable-cuda-graph"}.get(
        facts.engine, "change flag --enforce-eager (vLLM) or --disable-cuda-graph (SGLang)")


def _fix_set(entry: dict, facts: HostFacts) -> str:
    """The variant that carries a known issue's whole fix set, and that set on the host's release."""
    from . import playbooks

    suggest = entry.get("suggest") or {}
    patch = suggest.get("patch")
    name, patches = suggest["variant"], []
    for candidate in [v for v in (facts.variant, suggest["variant"]) if v]:
        try:
            resolved, _ = playbooks.resolve(playbooks.load_variant(candidate), facts.sglang)
        except Exception:  # a variant not in this checkout, a version no rule can read: the suggestion stands
            continue
        if patch in (resolved.get("patches") or []):
            name, patches = candidate, list(resolved["patches"])
            break
    if facts.sglang and patches:
        return f"deploy --variant {name} (its fix set on sglang {facts.sglang}: {' + '.join(patches)})"
    return f"apply patch {patch}; the whole fix set of the host's release: deploy --variant {name}"


def action_of(entry: dict | None, category: str | None = None, facts: HostFacts = HostFacts()) -> str | None:
    """What to do next for a known issue (its `action:`, else the patch it names, else its
    category's), or for a category alone, worded for the host."""
    if entry is not None:
        if (entry.get("suggest") or {}).get("variant") and (entry.get("suggest") or {}).get("patch"):
            return _fix_set(entry, facts)
        patch = (entry.get("suggest") or {}).get("patch")
        action = entry.get("action") or (f"apply patch {patch}" if patch else CATEGORY_ACTIONS[entry["category"]])
    else:
        action = CATEGORY_ACTIONS.get(category or "")
    if action == AUDIT:
        return _audit(facts)
    if action == NO_CUDA_GRAPHS:
        return _no_cuda_graphs(facts)
    return action
