"""Hostile server logs for diagnose, made to a size: the shapes that once cost it time quadratic in a
line's length (issue 48) and the ones that hid a failure from it. Used by the tests over the sshd
lab and by bench/diagnose_linear.py; each is deterministic.

Every maker returns text of at least `size` characters (a little over: whole lines).
"""

from __future__ import annotations

# A failing line of 100 kB: the knowledge base's patterns that opened with an unbounded repeat
# retried at every position of it (45 s of CPU for one such line).
_WORDS = "abc def ghi jkl "


def long_failing_lines(size: int, line: int = 100_000) -> str:
    one = "ERROR: RuntimeError: " + (_WORDS * (line // len(_WORDS))) + "\n"
    return one * max(1, -(-size // len(one)))


def repeated_bus_error(size: int, line: int = 20_000) -> str:
    """An exception message of "bus error " repeated (the host-limits cue's backtracking: 14.5 s at 20 kB)."""
    one = "RuntimeError: " + ("bus error " * (line // 10)) + "\n"
    return one * max(1, -(-size // len(one)))


def long_words(size: int, line: int = 50_000) -> str:
    """Lines of one long word after an exception type (a pattern that opens with \\w+ retries at
    every position of the word)."""
    one = "RuntimeError: " + ("a" * line) + "\n"
    return one * max(1, -(-size // len(one)))


def mixed(size: int) -> str:
    """The three shapes above, a third of the size each, then a real failure the report must name."""
    third = size // 3
    return (long_failing_lines(third) + repeated_bus_error(third) + long_words(third)
            + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")


def one_huge_line(size: int) -> str:
    """A log that is one line: `ERROR: RuntimeError: ...` and `size` characters more."""
    return "ERROR: RuntimeError: the engine failed: " + ("x" * size) + "\n"


def table_cell_continued(size: int, width: int = 100) -> str:
    """A drawn table whose one cell goes on over every row of the log (each row the continuation of
    the one above: its other cell blank, its cell filled to the column's width), then a failure."""
    one = "|   | " + ("y" * width) + " |\n"
    return ("| m | " + ("x" * width) + " |\n" + one * max(1, -(-size // len(one)))
            + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")


def logged_request_quoting_a_traceback(served_line: str, request_line: str) -> str:
    """A healthy log whose request lines quote a user's traceback inside the logged prompt: once in
    escaped newlines, once over several lines of the prompt. `request_line` is a real logged request
    (vLLM's `Received request ...: prompt: '...', params: ...`), `served_line` a real line of the
    server serving; the user's text replaces the prompt's."""
    head, sep, rest = request_line.partition("prompt: '")
    tail = rest[rest.index("', params:"):]
    user = ("My server crashed, what does this mean?\nTraceback (most recent call last):\n"
            '  File "/srv/app.py", line 12, in main\n    run()\nRuntimeError: CUDA error: an illegal memory access '
            "was encountered\nSegmentation fault (core dumped)\nAction: drain host\n")
    escaped = head + sep + user.replace("\n", "\\n") + tail
    multi = head + sep + user + tail
    return "\n".join([served_line, escaped, served_line, multi, served_line]) + "\n"
