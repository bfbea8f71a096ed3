"""Deploy variants: `playbooks/<variant>.yml`, inheriting with `extends`.

Merging a child over its parent: mappings (server_args, env, health) merge key by key, with
`null` deleting a key; `patches` and `crash_signatures` are unions in order; scalars override.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from .errors import ServopsError
from .schema import SchemaError, check_variant

PLAYBOOK_ROOT = Path(os.environ.get("SERVOPS_PLAYBOOKS") or Path(__file__).resolve().parent.parent / "playbooks")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

KNOWN_KEYS = {"extends", "template", "server_args", "env", "patches", "health", "crash_signatures",
              "stop_grace", "description", "nnodes"}
_MAPS = ("server_args", "env", "health")
_LISTS = ("patches", "crash_signatures")
# No default timeout here: a variant's health.timeout wins, else the inventory's health_timeout,
# else 1200 s (servops.bringup.health_timeout).
DEFAULT_HEALTH = {"endpoint": "/health", "model_info": "/model_info", "interval": 2}


class VariantError(ServopsError):
    pass


def _read(name: str, root: Path) -> dict:
    if not NAME_RE.fullmatch(name or ""):
        raise VariantError(f"variant name {name!r}: use letters, digits, '.', '_' or '-'")
    path = root / f"{name}.yml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in root.glob("*.yml"))) or "none"
        raise VariantError(f"unknown variant {name!r}: no {path} (known: {known})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise VariantError(f"{path}: invalid YAML{f' at line {mark.line + 1}' if mark else ''}") from None
    if not isinstance(data, dict):
        raise VariantError(f"{path}: must be a mapping")
    try:
        data = check_variant(data, str(path))
    except SchemaError as exc:
        raise VariantError(str(exc)) from None
    unknown = set(data) - KNOWN_KEYS
    if unknown:
        raise VariantError(f"{path}: unknown key '{sorted(unknown)[0]}' (known: {', '.join(sorted(KNOWN_KEYS))})")
    for key in _MAPS:
        if key in data and data[key] is not None and not isinstance(data[key], dict):
            raise VariantError(f"{path}: '{key}' must be a mapping")
    for key in _LISTS:
        if key in data and data[key] is not None and not isinstance(data[key], list):
            raise VariantError(f"{path}: '{key}' must be a list")
    for pattern in data.get("crash_signatures") or []:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise VariantError(f"{path}: crash signature {pattern!r} is not a valid regex: {exc}") from None
    return data


def _merge(parent: dict, child: dict) -> dict:
    out = dict(parent)
    for key, value in child.items():
        if key == "extends":
            continue
        if key in _MAPS:
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
    merged.setdefault("template", "launch_sglang.sh.j2")
    merged["health"] = dict(DEFAULT_HEALTH, **(merged.get("health") or {}))
    for key in _MAPS:
        merged.setdefault(key, {})
    for key in _LISTS:
        merged.setdefault(key, [])
    return merged
