"""Python programs that run on the host's interpreter, sent over stdin.

Each program is `_common.py` followed by its own file, preceded by its arguments as a JSON
string literal; it prints one JSON object as its last stdout line (progress lines before it are
JSON too). A refusal prints {"error": ...} and exits 3.

Environment variables a program needs (an inventory `env`, a token) travel on stdin too: a
small launcher sets them and runs the program in a child python, so they are never on a
command line (`ps`) and the program sees them from its first import.
"""

import json
from functools import cache
from pathlib import Path
from typing import Mapping

_HERE = Path(__file__).resolve().parent
# Library files a program needs besides _common.py, placed before its own code.
_INCLUDES = {"diagnose_ctx": ["logscan", "tracebacks"],
             # launch_facts reads the model's config.json with jsonl.read_config_json
             "launch_check": ["procs", "jsonl", "sglang_args", "argtable", "launch_cache", "launch_facts", "cache_ledger"],
             "host_facts": ["procs", "jsonl", "launch_facts"],
             "launch_check_vllm": ["procs", "jsonl", "sglang_args", "vllm_args", "argtable", "launch_cache",
                                   "launch_facts", "cache_ledger"],
             "patch_op": ["procs", "jsonl", "patch_core"],
             "deploy_ctl": ["procs", "jsonl", "patch_core", "startlog", "cache_ledger"],
             "end_command": ["procs"], "audit_compile": ["procs", "jsonl", "model_shrink", "audit_verdicts"],
             # the call-site proof: children with deadlines (procs), the model's config.json read
             # bounded (jsonl.read_config_json)
             "preflight_dynamo": ["procs", "jsonl"],
             # a launch check that also answers what a deploy needs to know (PROGRAM+deploy_facts):
             # the current release (deploy_ctl's readers, included as a library), the patch state
             "deploy_facts": ["jsonl", "patch_core", "startlog", "deploy_ctl"]}

# Programs that only read the host and end within seconds: a warm connection agent may run them
# in its host-side warm interpreter (warm_runner.py) rather than on a fresh `python -`. Anything
# that changes the host, runs long or streams progress always gets its own process.
WARM = frozenset({"inspect_file", "verify_dist", "host_facts", "scrape", "diagnose_ctx"})

_LAUNCHER = """\
import os, subprocess, sys
os.environ.update(_SERVOPS_ENV)
sys.exit(subprocess.run([sys.executable, "-"], input=_SERVOPS_PROGRAM.encode()).returncode)
"""


@cache
def standalone(name: str) -> str:
    """A program that is its own whole text (warm_runner.py: no _common, no arguments)."""
    return (_HERE / f"{name}.py").read_text(encoding="utf-8")


@cache
def program(name: str) -> str:
    base, _, extra = name.partition("+")  # "launch_check+deploy_facts": extra's library before base's code
    parts = ["_common"] + _INCLUDES.get(base, []) + (_INCLUDES.get(extra, []) + [extra] if extra else []) + [base]
    parts = list(dict.fromkeys(parts))  # a library both include is placed once, where first needed
    # _SERVOPS_MAIN: which program runs (deploy_ctl, included as a library, then runs no op)
    return f"_SERVOPS_MAIN = {name!r}\n" + "\n\n".join(f"# ---- {p} ----\n" + (_HERE / f"{p}.py").read_text(encoding="utf-8") for p in parts)


def with_args(name: str, args, env: Mapping[str, str] | None = None) -> str:
    # A JSON string literal is also a valid Python string literal.
    text = "_SERVOPS_ARGS = " + json.dumps(json.dumps(args, sort_keys=True)) + "\n" + program(name)
    return with_env(text, env) if env else text


def with_env(text: str, env: Mapping[str, str]) -> str:
    """`text` run by a launcher that first sets `env` (both travel on stdin)."""
    return (f"_SERVOPS_ENV = {json.dumps({str(k): str(v) for k, v in env.items()})}\n"
            f"_SERVOPS_PROGRAM = {json.dumps(text)}\n" + _LAUNCHER)
