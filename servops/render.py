"""Render a variant into a launch script: Jinja2 with StrictUndefined and a `shquote` filter."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Mapping

import jinja2

from .errors import ServopsError
from .inventory import Host
from .shell import remote_path

TEMPLATE_ROOT = Path(os.environ.get("SERVOPS_TEMPLATES") or Path(__file__).resolve().parent.parent / "templates")


class RenderError(ServopsError):
    pass


def _environment(root: Path) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(root)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    # Like shquote, but a leading ~/ still means the remote user's home ("$HOME"/'rest').
    env.filters["remote_path"] = remote_path
    return env


def _render_value(env: jinja2.Environment, value: Any, context: Mapping, where: str) -> Any:
    if not isinstance(value, str) or "{" not in value:
        return value
    try:
        return env.from_string(value).render(context)
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


def render_launch(host: Host, variant: Mapping[str, Any], release_name: str, release_dir: str,
                  extra: Mapping[str, Any] | None = None, root: Path | None = None) -> str:
    env = _environment(root or TEMPLATE_ROOT)
    context: dict[str, Any] = dict(host.vars)
    context.update(host_name=host.name, variant_name=variant["name"], release_name=release_name,
                   release_dir=release_dir, python=host.python)
    context.setdefault("server_module", "sglang.launch_server")
    context.setdefault("server_files", [])
    context.update(extra or {})
    where = f"playbooks/{variant['name']}.yml"
    args = {k: _render_value(env, v, context, f"{where} server_args.{k}") for k, v in variant["server_args"].items()}
    context["argv"] = server_argv(args)
    # Host env (site facts such as CUDA_HOME) first, then the variant's own settings.
    launch_env = dict(host.get("env") or {})
    launch_env.update(variant["env"])
    context["env"] = {k: str(_render_value(env, v, context, f"{where} env.{k}")) for k, v in launch_env.items()}
    context["server_args"] = args
    try:
        template = env.get_template(variant["template"])
    except jinja2.TemplateNotFound:
        raise RenderError(f"{where}: template {variant['template']!r} not found in {root or TEMPLATE_ROOT}") from None
    try:
        return template.render(context)
    except jinja2.UndefinedError as exc:
        raise RenderError(f"templates/{variant['template']}: {exc.message}; set it in the inventory or variant") from None
