"""Glue between invoke tasks and servops: flags, host selection, error handling, recap."""

from __future__ import annotations

import functools

from invoke import Exit, Task

from .errors import ServopsError
from .inventory import load_inventory
from .output import Recap, err_console

# Flags shared by every task, with the spellings Ansible users already know.
SHORT_FLAGS = {
    "hosts": ["hosts", "H"],
    "inventory": ["inventory", "I"],
    "dry_run": ["dry-run", "check", "C"],
    "diff": ["diff", "D"],
    "host": ["host"],  # no -h: that is --help
}

COMMON_HELP = {
    "hosts": "Host or group names from the inventory, comma-separated (default: all).",
    "inventory": "Inventory YAML file (default: $SERVOPS_INVENTORY or inventory/lab.yml).",
    "dry_run": "Check mode: report what would change; change nothing on the host.",
    "diff": "Show the changes (unified diff) that are, or in check mode would be, made.",
}


class ServopsTask(Task):
    """An invoke Task whose common flags get fixed names (-H, -I, -C/--check, -D)."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        if name in SHORT_FLAGS:
            opts["names"] = list(SHORT_FLAGS[name])
        return opts


def servops_task(*args, help=None, **kwargs):
    """@task with shared help for common flags and one-line errors instead of tracebacks."""
    merged_help = dict(COMMON_HELP)
    merged_help.update(help or {})

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(c, *a, **kw):
            try:
                result = fn(c, *a, **kw)
            except ServopsError as exc:
                err_console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
                raise Exit(code=exc.exit_code) from None
            if isinstance(result, Recap):
                result.render()
                for host in result.failed:
                    for message in result.hosts[host].messages[-1:]:
                        err_console.print(f"[bold red]error:[/] {message}", highlight=False)
                if result.failed:
                    raise Exit(code=2)
            return result

        import inspect as _inspect
        params = [p for p in _inspect.signature(fn).parameters]
        help_for = {k: v for k, v in merged_help.items() if k in params}
        return ServopsTask(wrapper, help=help_for, **kwargs)

    if args and callable(args[0]):
        return decorate(args[0])
    return decorate


def select(inventory: str | None, hosts: str | None):
    inv = load_inventory(inventory)
    return inv, inv.select(hosts)


def select_one(inventory: str | None, host: str | None):
    """One host: the named one, or the inventory's only host."""
    from .errors import InventoryError

    inv = load_inventory(inventory)
    chosen = inv.select(host or None)
    if len(chosen) != 1:
        raise InventoryError(f"{inv.path}: pick one host with --host (candidates: {', '.join(h.name for h in chosen)})")
    return chosen[0]
