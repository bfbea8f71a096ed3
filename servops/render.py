"""Render a variant into a launch script.

Jinja2 runs in an ImmutableSandboxedEnvironment (templates AND every user value that holds
`{{ }}`), with StrictUndefined. What reaches the script is quoted (`shquote`), validated
(`envname`) or neutralised (`comment`). Secret env values never go into the script: they go to
a 0600 `secrets.env` beside it, which the script sources.

The script does not name its release: it `cd`s to its own directory, so `render` prints
byte-for-byte what `deploy` writes, and equal scripts mean equal launches.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import jinja2
import jinja2.nodes
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from . import engines, jitcache
from .errors import ServopsError
from .inventory import Host
from .redact import is_secret_name
from .schema import ENV_NAME
from .shell import remote_path

TEMPLATE_ROOT = Path(os.environ.get("SERVOPS_TEMPLATES") or Path(__file__).resolve().parent.parent / "templates")


class RenderError(ServopsError):
    pass


def _envname(name: Any) -> str:
    text = str(name)
    if not ENV_NAME.fullmatch(text):
        raise RenderError(f"environment variable name {text!r} is not [A-Za-z_][A-Za-z0-9_]*")
    return text


def _comment(value: Any) -> str:
    """Text safe inside a `#` comment line: no newline or control character can end it."""
    return re.sub(r"[\x00-\x1f\x7f]", "?", str(value))


MAX_RENDERED = 1 << 20     # characters one value or one script may render to
MAX_STEPS = 2_000_000      # Python line events one render may take (loops over loops)
_BIG_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{5,})|\{[^{}]*:[^{}]*\d{5,}[^{}]*\}|\.\d{5,}")


class _Budget(BaseException):  # not an Exception: no `except Exception` in jinja swallows it
    pass


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with the resource attacks it leaves open closed: `'x' * 10**9`, `9**9**9`,
    a `%99999999s` width, and loops nested until the heat death of the universe (a step budget,
    counted by a trace function while a template runs)."""

    intercepted_binops = frozenset(["*", "**", "%"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64 and not -1 <= left <= 1:
            raise SecurityError(f"{left!r} ** {right!r} is too large")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDERED:
                    raise SecurityError(f"a sequence of {len(seq) * n:,} items is too large")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 4096:
                raise SecurityError("the product is too large")
        if operator == "%" and isinstance(left, str) and _BIG_WIDTH.search(left):
            raise SecurityError(f"format width in {left[:40]!r} is too large")
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _BIG_WIDTH.search(value.__self__):
            raise SecurityError(f"format width in {value.__self__[:40]!r} is too large")
        return wrapped

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        if isinstance(getattr(__obj, "__self__", None), (str, bytes, list, tuple)):  # 'x'.ljust(10**9)
            _check_sizes(getattr(__obj, "__name__", "call"), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _check_sizes(what: str, args, kwargs) -> None:
    """`'x'.ljust(10**9)`, `'x'|center(10**9)`: no call gets a size beyond what a value may hold."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDERED:
            raise SecurityError(f"{what}() with {a:,} is too large")
        if isinstance(a, str) and what in ("format", "do_format") and _BIG_WIDTH.search(a):
            raise SecurityError(f"format width in {a[:40]!r} is too large")


def _bounded_filter(name: str, func):
    import functools

    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        i = 0
        while i < len(args) and isinstance(args[i], (jinja2.Environment, jinja2.runtime.Context,
                                                       jinja2.nodes.EvalContext)):
            i += 1
        # the filtered value itself may be any size (`{{ 4000000|string }}`); its arguments may
        # not (`center(10**9)`), and a format string is checked for its widths
        if name == "format" and i < len(args):
            _check_sizes(name, (args[i],), {})
        _check_sizes(name, args[i + 1:], kwargs)
        return func(*args, **kwargs)

    return bounded


def _run_bounded(render, where: str) -> str:
    """`render()` under the step budget, its result at most MAX_RENDERED characters; any failure
    of the template's own code (1/0, int('x')) is one RenderError naming `where`."""
    import sys

    steps = [0]

    def tracer(frame, event, arg):
        steps[0] += 1
        if steps[0] > MAX_STEPS:
            raise _Budget()
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        out = render()
    except _Budget:
        raise RenderError(f"{where}: template code runs too long (over {MAX_STEPS:,} steps)") from None
    except (SecurityError, jinja2.TemplateError, RenderError):
        raise
    except (ArithmeticError, ValueError, TypeError, LookupError, AttributeError, MemoryError, RecursionError) as exc:
        raise RenderError(f"{where}: template code failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.settrace(previous)
    if isinstance(out, str) and len(out) > MAX_RENDERED:
        raise RenderError(f"{where}: renders to {len(out):,} characters; at most {MAX_RENDERED:,}")
    return out


def _environment(root: Path) -> jinja2.Environment:
    env = _BoundedSandbox(loader=jinja2.FileSystemLoader(str(root)), undefined=jinja2.StrictUndefined,
                                        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                                        autoescape=False)
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    # Like shquote, but a leading ~/ still means the remote user's home ("$HOME"/'rest').
    env.filters["remote_path"] = remote_path
    env.filters["envname"] = _envname
    env.filters["comment"] = _comment
    for name, func in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, func)
    return env


# A flag or env value may hold tabs and newlines (a JSON config); no other control character has
# a use there, and one (ESC, CR, NUL) would hide what the launch script really says.
_VALUE_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _render_value(env: jinja2.Environment, value: Any, context: Mapping, where: str) -> Any:
    if isinstance(value, list):
        return [_render_value(env, v, context, f"{where}[{i}]") for i, v in enumerate(value)]
    out = _render_template(env, value, context, where)
    m = _VALUE_CONTROL.search(out) if isinstance(out, str) else None
    if m:
        raise RenderError(f"{where}: the value holds control character {m.group()!r} at {m.start()}; "
                          f"write it without (tabs and newlines are fine)")
    return out


def _render_template(env: jinja2.Environment, value: Any, context: Mapping, where: str) -> Any:
    if not isinstance(value, str) or ("{" not in value and "%" not in value):
        return value
    try:
        return _run_bounded(lambda: env.from_string(value).render(context), where)
    except SecurityError as exc:
        raise RenderError(f"{where}: template code is not allowed here ({exc})") from None
    except jinja2.UndefinedError as exc:
        raise RenderError(f"{where}: {exc.message}; set it in the inventory for this host") from None
    except jinja2.TemplateError as exc:
        raise RenderError(f"{where}: {exc}") from None


def server_argv(server_args: Mapping[str, Any]) -> list[str]:
    """{'tp': 8, 'trust-remote-code': True, 'x': False} -> ['--tp', '8', '--trust-remote-code']."""
    argv: list[str] = []
    for key, value in server_args.items():
        flag = key if key.startswith("-") else f"--{key}"
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv.append(flag)
            argv.extend(str(v) for v in value)
        else:
            argv.extend([flag, str(value)])
    return argv


# a secret shorter than this is never matched against argv words: a "1" would take `--tp-size 1` with it
MIN_SECRET_CHARS = 4


def shell_words(argv: list[str], secret_env: Mapping[str, str]) -> list[str]:
    """argv as shell words; an argument equal to a secret env value (`--api-key <token>`) becomes
    "$NAME", expanded by bash from the secrets file, so the value never sits in the script."""
    by_value = {v: k for k, v in secret_env.items() if len(v) >= MIN_SECRET_CHARS}
    return [f'"${by_value[a]}"' if a in by_value else shlex.quote(a) for a in argv]


@dataclass
class Launch:
    """What a variant renders to on one host."""
    script: str
    argv: list[str]
    env: dict[str, str]
    secret_env: dict[str, str] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)  # server_args as rendered for this host

    def secrets_file(self) -> str:
        """`secrets.env`, sourced by the script with `set -a`: one quoted assignment per line."""
        return "".join(f"{_envname(k)}={shlex.quote(v)}\n" for k, v in self.secret_env.items())


def secret_names(host: Host) -> set[str]:
    return {str(n) for n in (host.get("secret_vars") or [])}


def render_launch(host: Host, variant: Mapping[str, Any], extra: Mapping[str, Any] | None = None,
                  root: Path | None = None) -> Launch:
    env = _environment(root or TEMPLATE_ROOT)
    context: dict[str, Any] = dict(host.vars)
    context.update(host_name=host.name, variant_name=variant["name"], python=host.python,
                   variant_source=variant.get("source") or f"playbooks/{variant['name']}.yml")
    engine = engines.of_variant(variant)
    context.update(server_module=engine.server_module(host), server_files=engine.server_files(host))
    context.update(extra or {})
    where = f"playbooks/{variant['name']}.yml"
    args = {k: _render_value(env, v, context, f"{where}: server_args.{k}") for k, v in variant["server_args"].items()}
    argv = server_argv(args)
    # The engine's defaults and its cache directories (the host's jit_cache_dir), then the host's
    # env (site facts such as CUDA_HOME), then the variant's own settings; a null drops what came
    # before it.
    launch_env: dict[str, str] = dict(engine.launch_env, **jitcache.cache_env(engine, host))
    for source, items in ((f"{host.source}: host {host.name} env", host.get("env") or {}), (f"{where}: env", variant["env"])):
        for k, v in items.items():
            if v is None:
                launch_env.pop(_envname(k), None)
            else:
                launch_env[_envname(k)] = str(_render_value(env, v, context, f"{source}.{k}"))
    secret = secret_names(host)
    secret_env = {k: v for k, v in launch_env.items() if is_secret_name(k) or k in secret}
    plain_env = {k: v for k, v in launch_env.items() if k not in secret_env}
    # A secret passed as a flag (--api-key sk-...) goes the same way: into the secrets file under
    # a generated name, the script saying "$SERVOPS_ARG_API_KEY".
    for key, value in args.items():
        flag = key.lstrip("-")
        if is_secret_name(flag) and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            text = str(value)
            if text and text not in secret_env.values():
                secret_env["SERVOPS_ARG_" + re.sub(r"[^A-Za-z0-9]", "_", flag).upper()] = text
    context.update(argv=argv, argv_shell=shell_words(argv, secret_env), env=plain_env,
                   secret_env=sorted(secret_env), server_args=args)
    try:
        template = env.get_template(variant["template"])
    except jinja2.TemplateNotFound:
        raise RenderError(f"{where}: template {variant['template']!r} not found in {root or TEMPLATE_ROOT}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise RenderError(f"templates/{variant['template']}:{exc.lineno}: {exc.message}") from None
    try:
        script = _run_bounded(lambda: template.render(context), f"templates/{variant['template']}")
    except SecurityError as exc:
        raise RenderError(f"templates/{variant['template']}: template code is not allowed ({exc})") from None
    except jinja2.UndefinedError as exc:
        raise RenderError(f"templates/{variant['template']}: {exc.message}; set it in the inventory or variant") from None
    except RenderError as exc:
        text = str(exc)
        raise RenderError(text if text.startswith("templates/") else f"templates/{variant['template']}: {text}") from None
    for value in secret_env.values():
        if len(value) >= 4 and value in script:
            raise RenderError(f"templates/{variant['template']}: a secret value would be written into the "
                              f"script; use the secrets file (secret_env), never the value")
    return Launch(script=script, argv=argv, env=plain_env, secret_env=secret_env, args=args)
