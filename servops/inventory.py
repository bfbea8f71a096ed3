"""Ansible-style YAML inventory: `all: {hosts:, children:, vars:}` resolved into Host objects.

Variable precedence follows Ansible: `all` vars < parent group vars < child group vars < host vars.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import InventoryError, did_you_mean
from .schema import INVENTORY_VARS, NAME, SchemaError, coerce, load_yaml, persist_seconds, read_text

DEFAULT_INVENTORY = "inventory/lab.yml"

# Ansible spellings accepted as aliases, so an existing inventory works unchanged.
_ALIASES = {
    "ansible_host": "ssh_host",
    "ansible_port": "ssh_port",
    "ansible_user": "ssh_user",
    "ansible_ssh_private_key_file": "ssh_key",
}



@dataclass(frozen=True)
class Host:
    name: str
    vars: Mapping[str, Any]
    groups: tuple[str, ...] = ()
    source: str = ""

    def get(self, key: str, default: Any = None) -> Any:
        return self.vars.get(key, default)

    def require(self, key: str) -> Any:
        value = self.vars.get(key)
        if value is None or value == "":
            raise InventoryError(f"{self.source}: host '{self.name}' has no '{key}' var; set it under the host or a group")
        return value

    @property
    def ssh_host(self) -> str:
        return str(self.vars.get("ssh_host") or self.name)

    @property
    def ssh_port(self) -> int:
        return int(self.vars.get("ssh_port", 22))

    @property
    def ssh_user(self) -> str:
        return str(self.vars.get("ssh_user") or getpass.getuser())

    @property
    def ssh_key(self) -> str | None:
        key = self.vars.get("ssh_key")
        return os.path.expanduser(str(key)) if key else None

    @property
    def known_hosts(self) -> str:
        return os.path.expanduser(str(self.vars.get("known_hosts") or "~/.ssh/known_hosts"))

    @property
    def accept_new_host_keys(self) -> bool:
        return bool(self.vars.get("accept_new_host_keys", False))

    @property
    def persist(self) -> float:
        """Seconds the host's connection agent outlives the last command (0: none; default 10m)."""
        return persist_seconds(self.vars.get("persist", True))

    @property
    def venv(self) -> str:
        return str(self.require("venv"))

    @property
    def python(self) -> str:
        """The remote interpreter that owns the site-packages we operate on."""
        return str(self.vars.get("python") or f"{self.venv.rstrip('/')}/bin/python")


@dataclass
class Inventory:
    path: str
    hosts: dict[str, Host]
    groups: dict[str, list[str]] = field(default_factory=dict)

    def select(self, pattern: str | None) -> list[Host]:
        """Hosts matching a comma-separated list of host and group names ('all' by default)."""
        names: list[str] = []
        for part in (pattern or "all").split(","):
            part = part.strip()
            if not part:
                continue
            if part in self.groups:
                members = self.groups[part]
            elif part in self.hosts:
                members = [part]
            else:
                names = sorted(set(self.groups) | set(self.hosts))
                raise InventoryError(f"{self.path}: no host or group named '{part}'{did_you_mean(part, names)} "
                                     f"(known: {', '.join(names)})")
            names.extend(m for m in members if m not in names)
        if not names:
            raise InventoryError(f"{self.path}: pattern '{pattern}' selects no hosts")
        return [self.hosts[n] for n in names]


def _mapping(value: Any, where: str, path: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InventoryError(f"{path}: '{where}' must be a mapping, got {type(value).__name__}")
    return value


def _normalise_vars(raw: dict, where: str, path: str) -> dict:
    """Known vars checked against the schema (types, ranges, safe names); others kept as they are
    (templates may use them)."""
    out = {}
    for key, value in raw.items():
        key = _ALIASES.get(str(key), str(key))
        field = INVENTORY_VARS.get(key)
        if field is not None:
            try:
                value = coerce(value, field, f"{path}: {where}.{key}")
            except SchemaError as exc:
                raise InventoryError(str(exc)) from None
        out[key] = value
    return out


def _check_name(kind: str, name: Any, where: str, path: str) -> str:
    text = str(name)
    if not NAME.fullmatch(text):
        raise InventoryError(f"{path}: {where}: {kind} name {text!r} must be letters, digits, '.', '_' or '-' "
                             f"(it is used in file names and scripts)")
    return text


def parse_inventory(text: str, path: str = "<inventory>") -> Inventory:
    data = load_yaml(text, path, InventoryError)
    data = _mapping(data, "<top level>", path)
    if "all" not in data:
        raise InventoryError(f"{path}: top-level key 'all' is missing (Ansible YAML inventory format)")
    unknown_top = set(data) - {"all"}
    if unknown_top:
        raise InventoryError(f"{path}: unexpected top-level key '{sorted(unknown_top)[0]}'; put groups under all.children")

    host_vars: dict[str, dict] = {}
    host_chain: dict[str, list[tuple[str, dict]]] = {}  # host -> [(group, vars)] outermost first
    groups: dict[str, list[str]] = {}

    def walk(name: str, node: Any, chain: list[tuple[str, dict]], where: str) -> list[str]:
        node = _mapping(node, where, path)
        unknown = set(node) - {"hosts", "children", "vars"}
        if unknown:
            raise InventoryError(f"{path}: unknown key '{where}.{sorted(unknown)[0]}' (expected hosts, children, vars)")
        gvars = _normalise_vars(_mapping(node.get("vars"), f"{where}.vars", path), f"{where}.vars", path)
        chain = chain + [(name, gvars)]
        members: list[str] = []
        for hname, hvars in _mapping(node.get("hosts"), f"{where}.hosts", path).items():
            hname = _check_name("host", hname, f"{where}.hosts", path)
            hv = _normalise_vars(_mapping(hvars, f"{where}.hosts.{hname}", path), f"{where}.hosts.{hname}", path)
            host_vars.setdefault(hname, {}).update(hv)
            existing = host_chain.setdefault(hname, [])
            existing.extend(c for c in chain if c not in existing)
            members.append(hname)
        for cname, cnode in _mapping(node.get("children"), f"{where}.children", path).items():
            cname = _check_name("group", cname, f"{where}.children", path)
            for m in walk(cname, cnode, chain, f"{where}.children.{cname}"):
                if m not in members:
                    members.append(m)
        groups.setdefault(name, [])
        groups[name].extend(m for m in members if m not in groups[name])
        return members

    walk("all", data["all"], [], "all")
    hosts = {}
    for hname, chain in host_chain.items():
        merged: dict[str, Any] = {}
        for _group, gvars in chain:
            merged.update(gvars)
        merged.update(host_vars[hname])
        hosts[hname] = Host(
            name=hname,
            vars=merged,
            groups=tuple(g for g, _ in chain),
            source=path,
        )
    groups["all"] = list(hosts)
    return Inventory(path=path, hosts=hosts, groups=groups)


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    path = str(path or os.environ.get("SERVOPS_INVENTORY") or DEFAULT_INVENTORY)
    p = Path(path)
    if not p.is_file():
        raise InventoryError(f"{path}: inventory file not found; pass --inventory PATH or set SERVOPS_INVENTORY")
    return parse_inventory(read_text(p, InventoryError), path)


def lab_hint(host: Host) -> str:
    """A host of servops' own lab (group `lab`, on loopback): say how to start it."""
    if "lab" in host.groups and host.ssh_host.startswith("127."):
        return f"; is the lab up? invoke lab.up -H {host.name}"
    return ""


def deploy_root(host: Host) -> str:
    """Where servops keeps a host's releases, lock and journal (inventory var deploy_root)."""
    return str(host.get("deploy_root") or "~/.servops/deploy")
