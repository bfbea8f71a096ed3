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
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

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


def _environment(root: Path) -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(loader=jinja2.FileSystemLoader(str(root)), undefined=jinja2.StrictUndefined,
                                        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                                        autoescape=False)
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    # Like shquote, but a leading ~/ still means the remote user's home ("$HOME"/'rest').
    env.filters["remote_path"] = remote_path
    env.filters["envname"] = _envname
    env.filters["comment"] = _comment
    return env


def _render_value(env: jinja2.Environment, value: Any, context: Mapping, where: str) -> Any:
    if isinstance(value, list):
        return [_render_value(env, v, context, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or ("{" not in value and "%" not in value):
        return value
    try:
        return env.from_string(value).render(context)
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


def shell_words(argv: list[str], secret_env: Mapping[str, str]) -> list[str]:
    """argv as shell words; an argument equal to a secret env value (`--api-key <token>`) becomes
    "$NAME", expanded by bash from the secrets file, so the value never sits in the script."""
    by_value = {v: k for k, v in secret_env.items() if len(v) >= 4}
    return [f'"${by_value[a]}"' if a in by_value else shlex.quote(a) for a in argv]


@dataclass
class Launch:
    """What a variant renders to on one host."""
    script: str
    argv: list[str]
    env: dict[str, str]
    secret_env: dict[str, str] = field(default_factory=dict)

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
    context.setdefault("server_module", "sglang.launch_server")
    context.setdefault("server_files", [])
    context.update(extra or {})
    where = f"playbooks/{variant['name']}.yml"
    args = {k: _render_value(env, v, context, f"{where}: server_args.{k}") for k, v in variant["server_args"].items()}
    argv = server_argv(args)
    # Host env (site facts such as CUDA_HOME) first, then the variant's own settings.
    launch_env: dict[str, str] = {}
    for k, v in (host.get("env") or {}).items():
        if v is not None:
            launch_env[_envname(k)] = str(_render_value(env, v, context, f"{host.source}: host {host.name} env.{k}"))
    for k, v in variant["env"].items():
        if v is None:
            launch_env.pop(k, None)
        else:
            launch_env[_envname(k)] = str(_render_value(env, v, context, f"{where}: env.{k}"))
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
        script = template.render(context)
    except SecurityError as exc:
        raise RenderError(f"templates/{variant['template']}: template code is not allowed ({exc})") from None
    except jinja2.UndefinedError as exc:
        raise RenderError(f"templates/{variant['template']}: {exc.message}; set it in the inventory or variant") from None
    except RenderError as exc:
        raise RenderError(f"templates/{variant['template']}: {exc}") from None
    for value in secret_env.values():
        if len(value) >= 4 and value in script:
            raise RenderError(f"templates/{variant['template']}: a secret value would be written into the "
                              f"script; use the secrets file (secret_env), never the value")
    return Launch(script=script, argv=argv, env=plain_env, secret_env=secret_env)
