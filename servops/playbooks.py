"""Deploy variants: `playbooks/<variant>.yml`, inheriting with `extends`.

Merging a child over its parent: mappings (server_args, env, health) merge key by key, with
`null` deleting a key; `patches` and `crash_signatures` are unions in order; scalars override.

Version-aware variants: a variant states its intent once in `server_args`, and `when:` maps it to
the flags of particular engine releases, chosen by the host's installed engine (PEP 440
specifiers; a rule is keyed on the variant's engine, `sglang:` or `vllm:`):

    when:
      - sglang: ">=0.5.15,<0.5.23"
        note: piecewise is the tc_piecewise prefill backend
        server_args: {enable-piecewise-cuda-graph: null, cuda-graph-backend-prefill: tc_piecewise}

Every rule whose specifier contains the host's version is merged over the variant in order, with
the same rules as `extends` (maps merge, `null` drops a key); rules may set `server_args`, `env`
and `health`. Where a variant's intent does not exist on some releases, a rule says so and the
launch preflight refuses there, in one line naming the host's version:

    when:
      - sglang: "<0.5.3.post2"
        refuse: no piecewise CUDA graph before sglang 0.5.3.post2

(`resolve()` leaves the text in the variant's `refuse` key; the last refusing rule wins.)
A child's rules come after its parent's, so they win. With no engine installed on the host
(the lab's double), no rule applies. A vLLM variant keys its rules on vLLM's version:

    when:
      - vllm: "<0.10"
        refuse: no V1 engine before vllm 0.10
 `resolve()` does the merge; `when_branches()` lists every
combination of rules some version could select (the launch preflight checks them all at once).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from . import engines
from .errors import ServopsError, did_you_mean
from .schema import FLAG, VARIANT, load_mapping

PLAYBOOK_ROOT = Path(os.environ.get("SERVOPS_PLAYBOOKS") or Path(__file__).resolve().parent.parent / "playbooks")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

_MAPS = ("server_args", "env", "health")
_LISTS = ("patches", "crash_signatures")
# No default timeout here: a variant's health.timeout wins, else the inventory's health_timeout,
# else 1200 s (servops.bringup.health_timeout).
ENGINE_KEYS = tuple(engines.ENGINES)  # the engines whose version a rule can key on
WHEN_KEYS = (*ENGINE_KEYS, "note", "refuse", "rename", "server_args", "env", "health", "patches")
MAX_SPECIFIER_CHARS = 1000
_WHEN_MAPS = ("server_args", "env", "health")


class VariantError(ServopsError):
    pass


def _read(name: str, root: Path) -> dict:
    if not NAME_RE.fullmatch(name or ""):
        raise VariantError(f"variant name {name!r}: use letters, digits, '.', '_' or '-'")
    path = root / f"{name}.yml"
    if not path.exists():
        names = sorted(p.stem for p in root.glob("*.yml"))
        raise VariantError(f"unknown variant {name!r}{did_you_mean(name, names)} (no {path}; known: "
                           f"{', '.join(names) or 'none'})")
    # types, ranges, env names, flag names, regexes: one line naming the file and key
    data = load_mapping(path, VARIANT, VariantError)
    if data.get("when") is not None:
        data["when"] = _check_when(path, name, data["when"])
    return data


def _check_when(path: Path, name: str, rules: Any) -> list[dict]:
    """`when:` rules, each validated (one-line errors naming the file and key) and tagged with
    the variant that declared it."""
    if not isinstance(rules, list):
        raise VariantError(f"{path}: 'when' must be a list of rules like {{sglang: '>=0.5.15', server_args: {{...}}}}")
    out = []
    for i, rule in enumerate(rules):
        where = f"{path}: when[{i}]"
        if not isinstance(rule, dict):
            raise VariantError(f"{where}: must be a mapping with the engine's version (sglang: or vllm:) and 'server_args', 'env' or 'health'")
        unknown = sorted(set(rule) - set(WHEN_KEYS))
        if unknown:
            raise VariantError(f"{where}: unknown key '{unknown[0]}' (known: {', '.join(WHEN_KEYS)})")
        keyed = [k for k in ENGINE_KEYS if k in rule]
        if len(keyed) > 1:
            raise VariantError(f"{where}: keys on both {' and '.join(keyed)}; a rule keys on the variant's "
                               f"engine only")
        engine = keyed[0] if keyed else engines.DEFAULT
        at = f"{where}.{engine}" if keyed else f"{where}.sglang (or .vllm)"
        spec = rule.get(engine)
        if not isinstance(spec, str) or not spec.strip():
            raise VariantError(f"{at}: give a PEP 440 version specifier, e.g. '>=0.5.15,<0.5.23'")
        if len(spec) > MAX_SPECIFIER_CHARS:  # a version of thousands of digits cannot even be compared
            raise VariantError(f"{at}: a specifier of {len(spec):,} characters; at most "
                               f"{MAX_SPECIFIER_CHARS} (e.g. '>=0.5.15,<0.5.23')")
        try:
            parsed = SpecifierSet(spec)
        except InvalidSpecifier:
            raise VariantError(f"{at}: {spec!r} is not a PEP 440 version specifier "
                               f"(e.g. '>=0.5.15,<0.5.23')") from None
        if not len(parsed):
            raise VariantError(f"{at}: give a PEP 440 version specifier, e.g. '>=0.5.15,<0.5.23'")
        for key in _WHEN_MAPS:
            if key in rule and rule[key] is not None and not isinstance(rule[key], dict):
                raise VariantError(f"{where}.{key}: must be a mapping")
        patches = rule.get("patches")
        if patches is not None and not (isinstance(patches, list) and all(
                isinstance(p, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", p) for p in patches)):
            raise VariantError(f"{where}.patches: a list of patch names (patches/<dist>/<name>.patch), "
                               f"the fix set those releases need")
        rename = rule.get("rename")
        if rename is not None:
            if not isinstance(rename, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and FLAG.fullmatch(k) and FLAG.fullmatch(v)
                    for k, v in rename.items()):
                raise VariantError(f"{where}.rename: a mapping of old flag -> new flag, e.g. "
                                   f"{{cuda-graph-max-bs: cuda-graph-max-bs-decode}}")
        if "refuse" in rule and (not isinstance(rule["refuse"], str) or not rule["refuse"].strip()):
            raise VariantError(f"{where}.refuse: one line saying why the variant cannot run on those releases")
        if not any(rule.get(k) for k in _WHEN_MAPS + ("rename", "refuse", "patches")):
            raise VariantError(f"{where}: sets nothing; give rename, server_args, env, health, patches or refuse")
        if "note" in rule and not isinstance(rule["note"], str):
            raise VariantError(f"{where}.note: must be text")
        rule = {k: v for k, v in rule.items() if k not in ENGINE_KEYS}
        out.append(dict(rule, engine=engine, spec=spec.strip(), source=name))
    return out


def _merge(parent: dict, child: dict) -> dict:
    out = dict(parent)
    for key, value in child.items():
        if key == "extends":
            continue
        if key == "when":
            out[key] = list(parent.get(key) or []) + list(value or [])
        elif key in _MAPS:
            merged = dict(parent.get(key) or {})
            for k, v in (value or {}).items():
                if v is None:
                    merged.pop(k, None)
                else:
                    merged[k] = v
            out[key] = merged
        elif key in _LISTS:
            merged = list(parent.get(key) or [])
            merged.extend(v for v in (value or []) if v not in merged)
            out[key] = merged
        else:
            out[key] = value
    return out


def load_variant(name: str, root: Path | None = None) -> dict[str, Any]:
    root = root or PLAYBOOK_ROOT
    chain: list[str] = []
    layers: list[dict] = []
    current: str | None = name
    while current is not None:
        if current in chain:
            raise VariantError(f"cyclic extends in {root}: {' -> '.join(chain + [current])}")
        chain.append(current)
        data = _read(current, root)
        layers.append(data)
        current = data.get("extends")
    merged: dict[str, Any] = {}
    for layer in reversed(layers):
        merged = _merge(merged, layer)
    merged["name"] = name
    merged["chain"] = list(reversed(chain))
    engine = _engine(merged, name)
    for rule in merged.get("when") or []:  # a rule keyed on another engine's version never matches
        if rule["engine"] != engine.name:
            raise VariantError(f"playbooks/{rule['source']}.yml: a 'when' rule keys on {rule['engine']}'s version "
                               f"but {name} runs on {engine.name}: key it on {engine.name}: '<specifier>'")
    # the engine room's defaults under the variant's own (sglang's variants name no engine)
    merged.setdefault("template", engine.template)
    merged["health"] = dict(engine.health, **(merged.get("health") or {}))
    if engine.crash_signatures:
        merged["crash_signatures"] = list(dict.fromkeys([*(merged.get("crash_signatures") or []),
                                                         *engine.crash_signatures]))
    for key in _MAPS:
        merged.setdefault(key, {})
    for key in _LISTS:
        merged.setdefault(key, [])
    merged.setdefault("when", [])
    return merged


def _engine(merged: dict, name: str):
    try:
        return engines.of_variant(merged)
    except engines.EngineError as exc:
        raise VariantError(f"playbooks/{name}.yml: {exc}") from None


def describe_rule(rule: dict) -> str:
    """'piecewise.yml when sglang >=0.5.23: -enable-piecewise-cuda-graph +cuda-graph-backend-prefill=breakable (note)'"""
    changes = [f"{old}->{new}" for old, new in (rule.get("rename") or {}).items()]
    for key in _WHEN_MAPS:
        for k, v in (rule.get(key) or {}).items():
            prefix = "" if key == "server_args" else f"{key}."
            if v is None:
                changes.append(f"-{prefix}{k}")
            elif v is True:
                changes.append(f"+{prefix}{k}")
            else:
                changes.append(f"+{prefix}{k}={v}")
    changes += [f"+patch {p}" for p in rule.get("patches") or []]
    if rule.get("refuse"):
        changes.append(f"REFUSE: {rule['refuse']}")
    note = f" ({rule['note']})" if rule.get("note") else ""
    return f"{rule.get('source', '?')}.yml when {rule['engine']} {rule['spec']}: {' '.join(changes)}{note}"


def _version(engine_version: str) -> Version:
    try:
        return Version(str(engine_version))
    except InvalidVersion:
        raise VariantError(f"engine version {engine_version!r} on the host is not a PEP 440 version; "
                           f"'when:' rules cannot be matched against it") from None


def matching_rules(variant: dict, engine_version: str | None) -> list[int]:
    """Indexes of the `when:` rules whose specifier contains the host's version of the variant's
    engine (none without one)."""
    if engine_version is None:
        return []
    version = _version(engine_version)
    return [i for i, rule in enumerate(variant.get("when") or [])
            if SpecifierSet(rule["spec"]).contains(version, prereleases=True)]


def apply_rules(variant: dict, indexes: list[int]) -> tuple[dict, list[str]]:
    """The variant with the given `when:` rules merged over it, in order."""
    rules = variant.get("when") or []
    out = {k: v for k, v in variant.items() if k != "when"}
    applied = []
    for i in indexes:
        rule = rules[i]
        if rule.get("rename"):
            # A flag whose name changed keeps the value the variant (or a child, or a tuning
            # trial) gave it: `cuda-graph-max-bs: 128` becomes `cuda-graph-max-bs-decode: 128`.
            args = {}
            for k, v in out["server_args"].items():
                args[rule["rename"].get(k, k)] = v
            out = dict(out, server_args=args)
        out = _merge(out, {k: rule[k] for k in _WHEN_MAPS if rule.get(k)})
        if rule.get("patches"):  # the fix set those releases need, added to the variant's own
            out = dict(out, patches=list(out.get("patches") or []) + [
                p for p in rule["patches"] if p not in (out.get("patches") or [])])
        if rule.get("refuse"):  # the last refusing rule (a child's) says why
            out["refuse"] = " ".join(rule["refuse"].split())
        applied.append(describe_rule(rule))
    out["when"] = []
    return out, applied


def resolve(variant: dict, engine_version: str | None) -> tuple[dict, list[str]]:
    """The variant as it launches on a host whose engine is `engine_version` (None: not installed):
    every matching `when:` rule merged in (maps merge, null drops a key), and a description of
    each rule that applied. The result has no rules left (`when: []`), so resolving it again is a
    no-op."""
    return apply_rules(variant, matching_rules(variant, engine_version))


def _probe_versions(rules: list[dict]) -> list[str]:
    """Versions that between them meet every combination of rules a real version can meet:
    each version a specifier names, its pre-release, a version just above it, the next minor
    of ~= and == .* specifiers, and one below them all."""
    points: set[Version] = set()
    for rule in rules:
        for spec in SpecifierSet(rule["spec"]):
            text = spec.version.rstrip(".*")
            try:
                v = Version(text)
            except InvalidVersion:
                continue
            release = list(v.release)
            base = ".".join(map(str, release))
            points.update({Version(base), Version(base + ".dev0"), Version(base + ".0.0.0.1")})
            if spec.operator == "~=" or spec.version.endswith(".*"):
                head = release[:-1] if spec.operator == "~=" and len(release) > 1 else release
                bumped = head[:-1] + [head[-1] + 1] if head else [release[0] + 1]
                points.add(Version(".".join(map(str, bumped))))
            points.add(Version(str(v)))
    points.add(Version("0"))
    return [str(p) for p in sorted(points)]


def when_branches(variant: dict) -> list[tuple[tuple[int, ...], str | None]]:
    """Every distinct combination of `when:` rules some version of the engine selects, as
    (rule indexes, an example version), the not-installed branch ((), None) first."""
    rules = variant.get("when") or []
    seen: dict[tuple[int, ...], str | None] = {(): None}
    for probe in _probe_versions(rules) if rules else []:
        key = tuple(matching_rules(variant, probe))
        seen.setdefault(key, probe)
    return list(seen.items())
