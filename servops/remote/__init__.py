"""Python programs that run on the host's interpreter, sent over stdin.

Each program is `_common.py` followed by its own file; it reads its arguments as JSON from
argv[1] and prints one JSON object on stdout. A refusal prints {"error": ...} and exits 3.
"""

from functools import cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent


@cache
def program(name: str) -> str:
    common = (_HERE / "_common.py").read_text()
    body = (_HERE / f"{name}.py").read_text()
    return common + "\n\n# ---- " + name + " ----\n" + body
