# An argparse parser as a flag table (plain JSON) and the parser rebuilt from it, so that a
# launch argv can be checked again later WITHOUT importing the engine that built the parser.
# Standard library only; engine-neutral (the engine's own validate() runs on the rebuilt parser).
#
# Every action is kept: its class, option strings, dest, nargs, const, default, type, choices,
# required, metavar, and the names validate() reads (servops_class, new_flag). The rebuilt
# parser is argparse's own, so argparse writes the same messages (unrecognized, invalid choice,
# invalid int value, expected one argument, required) and the same did-you-mean comes from the
# same option strings. What a table cannot reproduce it refuses to decide (raises Undecidable,
# and the caller asks the real parser):
#   - an action of a class that is not argparse's own (a custom __call__: a deprecated flag's
#     action, a LoRA path parser) when the argv uses it;
#   - a value of a flag with a custom `type=` function (or choices that are not plain values),
#     unless the real parser already converted that very value: its verdict (the value, or
#     argparse's message) is kept in the table's memo, recorded while the real parser ran;
#   - a parser of another class than argparse.ArgumentParser (a parse_args of its own, unless
#     the caller reproduces it: subclass_ok), one with mutually exclusive groups or @file
#     arguments: no table at all (table_of -> None).
import argparse

SCHEMA = 1
MAX_MEMO = 256          # memoized values per table
MAX_MEMO_TEXT = 512     # longest argv value memoized

_PRIMITIVE = (type(None), bool, int, float, str)
_TYPES = {None: None, str: "str", int: "int", float: "float"}
_TYPE_OF = {"str": str, "int": int, "float": float, None: None}
_STANDARD = dict((c.__name__, c) for c in (
    argparse._StoreAction, argparse._StoreConstAction, argparse._StoreTrueAction, argparse._StoreFalseAction,
    argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction)
    + tuple(getattr(argparse, n) for n in ("_ExtendAction", "BooleanOptionalAction") if hasattr(argparse, n)))


class Undecidable(Exception):
    """The table cannot give the real parser's verdict for this argv: ask the real parser."""


class _Shown(object):
    """A default or const that was not JSON: its text, as validate() reports such values."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text

    __repr__ = __str__


def _plain_list(value):
    return isinstance(value, (list, tuple)) and all(isinstance(v, _PRIMITIVE) for v in value)


def encode(value):
    """A default/const as JSON: primitives and lists of them as they are, anything else tagged."""
    if isinstance(value, _PRIMITIVE):
        return value
    if _plain_list(value):
        return list(value)
    if isinstance(value, dict):
        try:
            import json as _j
            return {"json": _j.loads(_j.dumps(value))}
        except (TypeError, ValueError):
            pass
    return {"text": str(value)}


def decode(value):
    if value == argparse.SUPPRESS:
        return argparse.SUPPRESS  # argparse tests it by identity
    if isinstance(value, dict):
        return value["json"] if "json" in value else _Shown(str(value.get("text")))
    return value


def _memo_kind(action):
    """True: this action's values are decided by the memo (a type or choices a table cannot rerun)."""
    if action.type not in _TYPES:
        return True
    choices = action.choices
    if choices is None:
        return False
    return not (isinstance(choices, (list, tuple, set, frozenset)) and all(isinstance(c, _PRIMITIVE) for c in choices))


def memo_key(action, arg_strings):
    return "%s\x00%s" % (action.option_strings[0] if action.option_strings else action.dest,
                         "\x00".join(arg_strings) if isinstance(arg_strings, (list, tuple)) else "\x01")


def table_of(parser, memo=None, subclass_ok=False):
    """The parser as a flag table (a dict), or None when a table cannot stand for it.
    subclass_ok: the parser's class is a subclass whose own parse_args the caller reproduces
    before the table parses (vLLM's FlexibleArgumentParser: vllm_args.normalize); its set of
    deprecated actions (`_deprecated`) is kept."""
    exact = type(parser) is argparse.ArgumentParser
    if not (exact or (subclass_ok and isinstance(parser, argparse.ArgumentParser))) \
            or parser._mutually_exclusive_groups or parser.fromfile_prefix_chars:
        return None
    deprecated = getattr(parser, "_deprecated", None) or ()
    actions = []
    for action in parser._actions:
        cls = type(action)
        row = {"class": cls.__name__ if _STANDARD.get(cls.__name__) is cls else None,
               "shown_class": getattr(action, "servops_class", None) or cls.__name__,
               "option_strings": list(action.option_strings), "dest": action.dest,
               "nargs": action.nargs if isinstance(action.nargs, (int, str, type(None))) else None,
               "const": encode(action.const), "default": encode(action.default),
               "required": bool(action.required), "memo": _memo_kind(action),
               "type": None, "choices": None,
               "metavar": action.metavar if isinstance(action.metavar, (str, type(None))) or _plain_list(action.metavar)
               else None}
        if isinstance(row["metavar"], tuple):
            row["metavar"] = list(row["metavar"])
        if getattr(action, "deprecated", False) is True:
            row["py_deprecated"] = True
        if action in deprecated:
            row["engine_deprecated"] = True
        new_flag = getattr(action, "new_flag", None)
        if isinstance(new_flag, str):
            row["new_flag"] = new_flag
        if not row["memo"]:
            row["type"] = _TYPES[action.type]
            row["choices"] = list(action.choices) if action.choices is not None else None
        elif isinstance(action.default, str):
            # argparse runs `type` on a str default: keep the converted value the real parser gives
            try:
                row["default"] = encode(parser._get_value(action, action.default))
            except Exception:
                row["default"] = {"text": action.default}
        actions.append(row)
    return {"schema": SCHEMA, "prog": parser.prog, "prefix_chars": parser.prefix_chars,
            "allow_abbrev": bool(getattr(parser, "allow_abbrev", True)),
            "exit_on_error": bool(getattr(parser, "exit_on_error", True)),
            "argument_default": encode(parser.argument_default),
            "actions": actions, "memo": dict(memo or {})}


def record_values(parser, memo):
    """Make `parser` (the real one) write, into `memo`, its verdict on each value of a memo-kind
    flag it converts: {memo_key: ["ok", value] | ["error", argparse's message]}."""
    original = parser._get_values

    def recording(action, arg_strings):
        if not _memo_kind(action) or len(memo) >= MAX_MEMO \
                or sum(len(a) for a in arg_strings if isinstance(a, str)) > MAX_MEMO_TEXT:
            return original(action, arg_strings)
        key = memo_key(action, arg_strings)
        try:
            value = original(action, arg_strings)
        except argparse.ArgumentError as exc:
            memo[key] = ["error", exc.message]
            raise
        memo[key] = ["ok", encode(value)]
        return value

    parser._get_values = recording
    return parser


class _Opaque(argparse.Action):
    """An action of the engine's own class: the table knows its flag, not what it does."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise Undecidable("%s (%s)" % (option_string or self.dest, self.servops_class))


class _TableParser(argparse.ArgumentParser):
    def _get_values(self, action, arg_strings):
        if not getattr(action, "servops_memo", False):
            return argparse.ArgumentParser._get_values(self, action, arg_strings)
        memo = getattr(self, "servops_memo_table", {})
        verdict = memo.get(memo_key(action, arg_strings))
        if verdict is None:
            raise Undecidable("%s %s (a value the engine's own type converts)"
                              % (action.option_strings[0] if action.option_strings else action.dest,
                                 " ".join(arg_strings) if isinstance(arg_strings, list) else arg_strings))
        if verdict[0] == "error":
            raise argparse.ArgumentError(action, verdict[1])
        return decode(verdict[1])


def parser_of(table):
    """argparse parser rebuilt from a table (ValueError/KeyError/TypeError for a table that is not one)."""
    if not isinstance(table, dict) or table.get("schema") != SCHEMA:
        raise ValueError("not a flag table of schema %d" % SCHEMA)
    kwargs = {"prog": str(table["prog"]), "prefix_chars": str(table["prefix_chars"]), "add_help": False,
              "allow_abbrev": bool(table["allow_abbrev"]), "argument_default": decode(table["argument_default"])}
    try:
        parser = _TableParser(exit_on_error=bool(table["exit_on_error"]), **kwargs)
    except TypeError:  # python 3.8: no exit_on_error
        parser = _TableParser(**kwargs)
    memo = table.get("memo") or {}
    if not isinstance(memo, dict):
        raise ValueError("memo is not a mapping")
    parser.servops_memo_table = memo
    parser._deprecated = set()
    for row in table["actions"]:
        cls = _STANDARD.get(row["class"]) if row["class"] else _Opaque
        if cls is None:
            raise ValueError("unknown action class %r" % row["class"])
        action = cls.__new__(cls)
        metavar = row["metavar"]
        action.__dict__.update({
            "option_strings": [str(o) for o in row["option_strings"]], "dest": decode(str(row["dest"])),
            "nargs": row["nargs"], "const": decode(row["const"]), "default": decode(row["default"]),
            "type": _TYPE_OF[row["type"]], "choices": row["choices"], "required": bool(row["required"]),
            "help": None, "metavar": tuple(metavar) if isinstance(metavar, list) else metavar,
            "servops_class": str(row["shown_class"]), "servops_memo": bool(row["memo"])})
        action.deprecated = bool(row.get("py_deprecated"))  # python 3.13's own deprecated=
        if "new_flag" in row:
            action.new_flag = str(row["new_flag"])
        parser._add_action(action)
        if row.get("engine_deprecated"):
            parser._deprecated.add(action)
    return parser
