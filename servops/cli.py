"""Glue between invoke tasks and servops: flags, host selection, the run-on-hosts pattern,
error handling and the recap every verb ends with."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterator

from invoke import Exit, Task
from invoke.parser.context import ParserContext

from . import interrupt
from .errors import NoData, ServopsError
from .inventory import Host, Inventory, load_inventory
from .output import EXIT_ATTENTION, EXIT_INTERRUPTED, FAILED, SKIPPED, Recap, err_console, safe_streams

# Flags shared by every task, with the spellings Ansible users already know.
SHORT_FLAGS = {
    "hosts": ["hosts", "H"],
    "inventory": ["inventory", "I"],
    "dry_run": ["dry-run", "check", "C"],
    "diff": ["diff", "D"],
}

COMMON_HELP = {
    "hosts": "Host or group names from the inventory, comma-separated (default: $SERVOPS_HOSTS, else all).",
    "inventory": "Inventory YAML file (default: $SERVOPS_INVENTORY or inventory/lab.yml).",
    "dry_run": "Check mode: report what would change; change nothing on the host.",
    "diff": "Show the changes (unified diff) that are, or in check mode would be, made.",
    "no_persist": "Connect afresh and leave no connection agent behind (default: the host's persist, 10m).",
}


class _NumberText(str):
    """A numeric flag's raw text. invoke would cast with int()/float() and print a traceback
    on `--grace abc`; the task wrapper converts it instead, with a one-line error."""

    metavar = "NUMBER"
    cast = float

    @classmethod
    def parse(cls, flag: str, raw, low: float | None, high: float | None):
        try:
            value = cls.cast(str(raw).strip())
        except ValueError:
            raise ServopsError(f"--{flag} {str(raw)!r}: expected {'an integer' if cls.cast is int else 'a number'}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ServopsError(f"--{flag} {str(raw)!r}: expected a finite number")
        if low is not None and value < low:
            raise ServopsError(f"--{flag} {value}: must be {low} or more")
        if high is not None and value > high:
            raise ServopsError(f"--{flag} {value}: must be {high} or less")
        return value


class IntText(_NumberText):
    metavar = "INT"
    cast = int


class FloatText(_NumberText):
    metavar = "FLOAT"
    cast = float


_invoke_help_for = ParserContext.help_for


def _help_for(self, flag):
    """invoke shows a value type only for str and int flags; show ours (INT, FLOAT) too."""
    names, text = _invoke_help_for(self, flag)
    metavar = getattr(self.flags[flag].kind, "metavar", None)
    if metavar:
        names = ", ".join(n + (f" {metavar}" if len(n.lstrip("-")) == 1 else f"={metavar}")
                          for n in names.split(", "))
    return names, text


ParserContext.help_for = _help_for


class ServopsTask(Task):
    """An invoke Task whose common flags get fixed names (-H, -I, -C/--check, -D) and whose
    numeric flags are parsed by servops (one-line errors, ranges)."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        if name in SHORT_FLAGS:
            opts["names"] = list(SHORT_FLAGS[name])
        if isinstance(default, bool):
            return opts
        if isinstance(default, int):
            opts["kind"] = IntText
        elif isinstance(default, float):
            opts["kind"] = FloatText
        return opts


HOSTS_ENV = "SERVOPS_HOSTS"


def require_hosts(verb: str, inventory: str | None) -> None:
    """A verb that changes hosts never defaults to every host: one line naming what it would
    have touched (bad input: exit 2, nothing touched)."""
    inv = load_inventory(inventory)
    names = [h.name for h in inv.select(None)]
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    raise ServopsError(f"{verb} changes hosts: name them with -H (a host, a group, or all) or ${HOSTS_ENV}; "
                       f"it would have touched {shown} ({inv.path})")


def servops_task(*args, help=None, bounds=None, changes: str | None = None, **kwargs):
    """@task with shared help for common flags, one-line errors instead of tracebacks, and
    the per-host recap printed for every verb that returns one.

    Numeric flags (an int or float default) are 0 or more unless `bounds` gives
    {flag: (low, high)} (None: unbounded). `changes`: the verb changes hosts (its name as the
    user types it), so -H is required (or $SERVOPS_HOSTS); read-only verbs default to all."""
    merged_help = dict(COMMON_HELP)
    if changes:
        merged_help["hosts"] = ("Host or group names from the inventory, comma-separated, or all: required (this "
                                f"verb changes hosts), or ${HOSTS_ENV}.")
    merged_help.update(help or {})

    def decorate(fn):
        import inspect as _inspect

        numeric = {name: (type(p.default), (bounds or {}).get(name, (0, None)))
                   for name, p in _inspect.signature(fn).parameters.items()
                   if type(p.default) in (int, float)}

        @functools.wraps(fn)
        def wrapper(c, *a, **kw):
            with safe_streams():  # text from a host never drives the operator's terminal
                return run(c, *a, **kw)

        def run(c, *a, **kw):
            if kw.pop("no_persist", False):  # read by servops.connagent (SERVOPS_PERSIST overrides `persist`)
                os.environ["SERVOPS_PERSIST"] = "0"
            try:
                if "hosts" in kw and not kw["hosts"]:
                    kw["hosts"] = os.environ.get(HOSTS_ENV) or None
                    if kw["hosts"] is None and changes:
                        require_hosts(changes, kw.get("inventory"))
                for name, (kind, (low, high)) in numeric.items():
                    if name in kw:
                        text_kind = IntText if kind is int else FloatText
                        kw[name] = text_kind.parse(name.replace("_", "-"), kw[name], low, high)
                result = fn(c, *a, **kw)
            except ServopsError as exc:
                err_console.print(f"error: {exc}", markup=False, highlight=False, style="bold red")
                raise Exit(code=exc.exit_code) from None
            except KeyboardInterrupt:
                err_console.print("interrupted", markup=False)
                raise Exit(code=EXIT_INTERRUPTED) from None
            except Exit:
                raise
            except Exception as exc:
                # Data shaped otherwise than servops writes it (a hostile or damaged host's reply,
                # a tampered local file) that got past the checks: one line, never a traceback.
                if os.environ.get("SERVOPS_DEBUG"):
                    raise
                text = " ".join(f"{type(exc).__name__}: {exc}".split())
                text = text if len(text) <= 500 else text[:500] + " ..."
                err_console.print(f"error: unexpected error ({text}): a host's reply or a local file servops did "
                                  f"not expect, or a servops bug (SERVOPS_DEBUG=1 shows the traceback); check the "
                                  f"host with invoke status", markup=False, highlight=False, style="bold red")
                raise Exit(code=EXIT_ATTENTION) from None
            if isinstance(result, Recap):
                result.render()
                if interrupt.requested():
                    raise Exit(code=EXIT_INTERRUPTED)
                if result.failed:
                    raise Exit(code=result.exit_code)
                return None
            return result

        params = [p for p in _inspect.signature(fn).parameters]
        if "hosts" in params:  # a verb that may connect: --no-persist too
            sig = _inspect.signature(fn)
            wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), _inspect.Parameter(
                "no_persist", _inspect.Parameter.KEYWORD_ONLY, default=False)])
            params.append("no_persist")
        help_for = {k: v for k, v in merged_help.items() if k in params}
        return ServopsTask(wrapper, help=help_for, **kwargs)

    if args and callable(args[0]):
        return decorate(args[0])
    return decorate


def select(inventory: str | None, hosts: str | None) -> tuple[Inventory, list[Host]]:
    inv = load_inventory(inventory)
    return inv, inv.select(hosts)


def select_one(inventory: str | None, hosts: str | None, verb: str) -> tuple[Inventory, Host]:
    """One host: the named one, or the inventory's only host."""
    inv, chosen = select(inventory, hosts)
    if len(chosen) != 1:
        raise ServopsError(f"{verb} works on one host; pick one with -H (selected: {', '.join(h.name for h in chosen)})")
    return inv, chosen[0]


class VerbRun:
    """One verb over the selected hosts: each host's (status, message[, data]) into the recap,
    the data kept for printing afterwards in inventory order."""

    def __init__(self, inv: Inventory, targets: list[Host]):
        self.inv, self.targets = inv, targets
        self.recap = Recap()
        self.results: dict[str, Any] = {}

    def run(self, op: Callable, *, groups: list[list[Host]] | None = None, **fleet_kwargs) -> "VerbRun":
        from .fleet import run_on_groups
        from .transport import Session

        def wrapped(sessions):
            out = op(sessions[0]) if groups is None else op(sessions)
            status, message, *data = out
            if data:
                self.results[sessions[0].host.name] = data[0]
            return status, message

        with Session(self.inv) as session:
            run_on_groups(session, groups or [[h] for h in self.targets], wrapped, self.recap, **fleet_kwargs)
        return self

    def local(self, op: Callable[[Host], tuple], explicit: bool = True) -> "VerbRun":
        """For verbs that read only local files (results/): op(host) per host, no connection;
        a failure is that host's failed line. Not `explicit` (no -H: every host), a host with no
        data here is skipped, saying so, rather than failed."""
        self.recap.expect([h.name for h in self.targets])
        for host in self.targets:
            try:
                status, message, *data = op(host)
            except (NoData, FileNotFoundError) as exc:
                self.recap.mark(host.name, FAILED if explicit else SKIPPED, str(exc))
                continue
            except (ServopsError, OSError, ValueError) as exc:
                self.recap.mark(host.name, FAILED, str(exc))
                continue
            if data:
                self.results[host.name] = data[0]
            self.recap.mark(host.name, status, message)
        return self

    def each(self) -> Iterator[tuple[Host, Any]]:
        for host in self.targets:
            if host.name in self.results:
                yield host, self.results[host.name]


def on_hosts(inventory: str | None, hosts: str | None, op: Callable, **fleet_kwargs) -> VerbRun:
    inv, targets = select(inventory, hosts)
    return VerbRun(inv, targets).run(op, **fleet_kwargs)
