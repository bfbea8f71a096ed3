"""The CLI's own mistakes as servops errors: one `error:` line naming the unknown verb, flag or
value and the closest valid spelling, exit 2 (invoke would print "No idea what 'x' is!" and exit 1).

invoke parses a verb's flags after loading tasks.py; `install()` wraps that step. The messages are
built by pure functions of the parse error, the verb's flags and argv, tested without a host.
"""

from __future__ import annotations

import re

from .errors import did_you_mean

EXIT_BAD_INPUT = 2


def flag_names(context) -> list[str]:
    """A verb's flags as a user types them (--variant, -H), inverse flags included."""
    return [str(f) for f in list(context.flags) + list(context.inverse_flags)]


_UNKNOWN = re.compile(r"No idea what (['\"])(?P<token>.*)\1 is!")
_NO_VALUE = re.compile(r"Flag '?(?:<Argument: )?(?P<flag>[\w-]+)[^!]*needed value")


def message(error_text: str, context, argv: list[str], verbs: list[str]) -> str:
    """One line for a parse error of invoke's, given the parser context it arose in (invoke's
    core context, which has no name, before any verb)."""
    verb = getattr(context, "name", None)
    unknown = _UNKNOWN.match(error_text)
    if unknown:
        token = unknown.group("token")
        i = argv.index(token) if token in argv else -1
        if i > 0 and argv[i - 1] == "-h":
            return f"-h is --help; hosts are -H: did you mean -H {token}?"
        if verb is None:
            return f"no verb {token!r}{did_you_mean(token, verbs)} (invoke --list shows them)"
        wrong = misplaced_flag(context, argv)
        if wrong:
            return wrong
        if token.startswith("-"):
            return f"{verb} has no flag {token}{did_you_mean(token, flag_names(context))} (invoke --help {verb})"
        return f"{verb} takes no argument {token!r} here; flags take values as --flag VALUE (invoke --help {verb})"
    if "did not receive required positional arguments" in error_text:
        names = [a.name for a in context.missing_positional_args] if context is not None else []
        need = ", ".join(f"--{n.replace('_', '-')} (or the value alone, first)" for n in names) or "an argument"
        return f"{verb} needs {need} (invoke --help {verb})"
    no_value = _NO_VALUE.match(error_text)
    if no_value:
        name = no_value.group("flag")
        flag = name if name.startswith("-") else ("-" if len(name) == 1 else "--") + name.replace("_", "-")
        return f"{flag} needs a value" + (f" (invoke --help {verb})" if verb else "")
    if "doesn't take any value" in error_text:
        return f"{verb}: {error_text.replace('Flag ', '').replace('<Argument: ', '').replace('>', '')}"
    return f"{verb + ': ' if verb else ''}{error_text}"


def misplaced_flag(context, argv: list[str]) -> str | None:
    """A typo'd flag that invoke took as a positional value (`deploy --varient x`: '--varient'
    became the variant): name it as the unknown flag it is."""
    for arg in getattr(context, "positional_args", []):
        value = arg.value
        if value == "-h":
            after = argv[argv.index("-h") + 1:argv.index("-h") + 2] if "-h" in argv else []
            return "-h is --help; hosts are -H" + (f": did you mean -H {after[0]}?" if after else "")
        if isinstance(value, str) and value.startswith("-"):
            return (f"{context.name} has no flag {value}{did_you_mean(value, flag_names(context))} "
                    f"(invoke --help {context.name})")
    return None


def install() -> None:
    """Wrap invoke's task parsing: its errors, and a typo'd flag eaten as a positional value,
    become one `error:` line and exit 2."""
    from invoke.exceptions import Exit, ParseError
    from invoke.program import Program

    if getattr(Program.parse_tasks, "_servops", False):
        return
    original = Program.parse_tasks

    def parse_tasks(self):
        argv = list(self.core.unparsed)
        verbs = list(self.collection.task_names) + [a for names in self.collection.task_names.values()
                                                    for a in names]
        try:
            original(self)
        except ParseError as exc:
            raise Exit(f"error: {message(str(exc), exc.context, argv, verbs)}", code=EXIT_BAD_INPUT) from None
        for ctx in self.tasks:
            wrong = misplaced_flag(ctx, argv)
            if wrong:
                raise Exit(f"error: {wrong}", code=EXIT_BAD_INPUT)

    parse_tasks._servops = True
    Program.parse_tasks = parse_tasks
    _with_contract(Program, "print_help")
    _with_contract(Program, "print_task_help")


def _with_contract(program_class, method: str) -> None:
    """`invoke --help` and `invoke --help VERB` end with the exit-status contract."""
    import textwrap

    from .output import EXIT_CONTRACT

    original = getattr(program_class, method)

    def printed(self, *args, **kwargs):
        original(self, *args, **kwargs)
        print(textwrap.fill(EXIT_CONTRACT, width=100, initial_indent="  ", subsequent_indent="    "))
        print()

    setattr(program_class, method, printed)
