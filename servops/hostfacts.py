"""Are the hosts of a fleet campaign alike? Each host's facts (one host program, read only:
servops/remote/host_facts.py), flattened to comparable text, and the facts that differ.

A fleet campaign compares trials run on different hosts, so the hosts must be the same machine
as far as a trial can tell: GPU model and count, the engine's distribution and version, the
model path the base launches (and what is there), the python, the servops patches applied to the
venv, and the server module the host runs. `differences` and `refusal` are pure (unit-tested
without a host); `gather` is the one SSH round trip per host.
"""

from __future__ import annotations

from . import hostreply
from .errors import ServopsError
from .hostreply import shown

# (key, what the table calls it), in the order they are shown
FACTS = (("gpus", "GPUs"), ("engine", "engine"), ("engine_version", "engine version"), ("model_path", "model path"),
         ("model", "model on the host"), ("python", "python"), ("patches", "servops patches"),
         ("server_module", "server module"))


class HostsDiffer(ServopsError):
    exit_code = 2


def flatten(raw: dict, model_path: str | None, server_module: str | None) -> dict[str, str]:
    """A host program's reply (and what the inventory says) as one text per fact."""
    gpu = raw.get("gpu") or {}
    names = gpu.get("names") or []
    if not gpu:
        gpus = "none (no nvidia-smi)"
    elif gpu.get("error"):
        gpus = f"unknown ({shown(gpu['error'])})"
    else:
        kinds = sorted({n.split(":", 1)[1].split("(UUID")[0].strip() if ":" in n else n for n in names})
        gpus = f"{gpu.get('count')} x {', '.join(kinds) or '?'}"
    engine = raw.get("engine") or {}
    model = raw.get("model") or {}
    state = model.get("state") or "-"
    if model.get("architectures"):
        state += " " + ",".join(model["architectures"])
    return {"gpus": gpus, "engine": str(engine.get("dist") or "not installed"),
            "engine_version": str(engine.get("version") or "-"), "model_path": str(model_path or "-"),
            "model": state, "python": str(raw.get("python") or "-"),
            "patches": ", ".join(raw.get("patches") or []) or "none", "server_module": str(server_module or "-")}


def differences(facts: dict[str, dict[str, str]]) -> list[tuple[str, dict[str, str]]]:
    """The facts whose value is not the same on every host: [(fact key, {host: value})]."""
    out = []
    for key, _title in FACTS:
        values = {host: f.get(key, "-") for host, f in facts.items()}
        if len(set(values.values())) > 1:
            out.append((key, values))
    return out


def title(key: str) -> str:
    return dict(FACTS).get(key, key)


def refusal(diffs: list[tuple[str, dict[str, str]]]) -> str:
    """The one error line: each differing fact, the hosts grouped by value (the odd ones first)."""
    parts = []
    for key, values in diffs:
        groups: dict[str, list[str]] = {}
        for host, v in values.items():
            groups.setdefault(v, []).append(host)
        shown = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
        parts.append(f"{title(key)} ({'; '.join(', '.join(hs) + ': ' + v for v, hs in shown)})")
    return ("the hosts are not alike, so their trials would not compare: " + "; ".join(parts)
            + "; make them alike or run the campaign on alike hosts (nothing was changed)")


def print_table(facts: dict[str, dict[str, str]], diffs: list[tuple[str, dict[str, str]]]) -> None:
    """Every fact per host, the differing ones marked."""
    from .output import print_table as show, table

    hosts = list(facts)
    t = table("fleet: the hosts' facts (* differs)", ["fact"] + hosts)
    differing = {k for k, _v in diffs}
    for key, name in FACTS:
        t.add_row(("* " if key in differing else "  ") + name, *[facts[h].get(key, "-") for h in hosts])
    show(t)


def gather(hs, base_variant: dict) -> dict[str, str]:
    """One host's facts (one SSH round trip), for the campaign's base variant."""
    from . import engines
    from .remote_exec import run_program
    from .render import render_launch

    engine = engines.of_variant(base_variant)
    argv = render_launch(hs.host, base_variant).argv
    model_path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == f"--{engine.model_flag}"), None) \
        or hs.host.get("model_path")
    raw = hostreply.check(run_program(hs, "host_facts", {"dists": list(engine.dists), "model_path": model_path}),
                          hostreply.HOST_FACTS, hs.host.name, "host_facts")
    return flatten(raw, model_path, engine.server_module(hs.host))
