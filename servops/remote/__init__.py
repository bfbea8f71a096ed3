"""Python programs that run on the host's interpreter, sent over stdin.

Each program is `_common.py` followed by its own file, preceded by its arguments as a JSON
string literal; it prints one JSON object as its last stdout line (progress lines before it are
JSON too). A refusal prints {"error": ...} and exits 3.
"""

from functools import cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Library files a program needs besides _common.py, placed before its own code.
_INCLUDES = {"diagnose_ctx": ["tracebacks"]}


@cache
def program(name: str) -> str:
    parts = ["_common"] + _INCLUDES.get(name, []) + [name]
    return "\n\n".join(f"# ---- {p} ----\n" + (_HERE / f"{p}.py").read_text() for p in parts)


def with_args(name: str, args) -> str:
    import json

    # A JSON string literal is also a valid Python string literal.
    return "_SERVOPS_ARGS = " + json.dumps(json.dumps(args, sort_keys=True)) + "\n" + program(name)
