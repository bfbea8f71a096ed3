"""The fix, synthesised: a dynamo break's boundary call made an opaque torch.library custom op.

Pure functions, from what the audit saw and what the probe measured, to a patch an sglang
maintainer would accept (the shape upstream always gives these fixes: sglang's own FlashInfer
GEMM wrappers, PR 23745's fp4_quantize):

- the schema from the arguments dynamo saw at capture (tensors, SymInts, floats, bools, dtypes,
  lists), bound to the function's own parameters;
- `mutates_args` from the probe: the tensors whose bytes the real call changed;
- the fake implementation from the probe's outputs at several sizes: each output dim is an input
  dim, an input dim scaled by a constant (or divided by an int argument), or a constant; its
  dtype an input's or a constant; its layout contiguous or column-major. An output the real call
  returns that is an argument (filled in place) is returned by the wrapper, not by the op;
- a plain Python wrapper under the function's own name, with its own defaults, that calls the
  op for the call pattern the capture made (which optional tensors were given) and the original
  function otherwise, appended to the function's module, so every caller gets it.

What cannot be wrapped says why: a Python value returned (a kernel handle, a bool), an output
whose size follows no input (data-dependent), an argument dynamo did not see as a tensor or a
constant, *args/**kwargs.
"""

from __future__ import annotations

import hashlib
import keyword
import re
from dataclasses import dataclass, field
from fractions import Fraction

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
DIST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")          # a distribution as the store names its folder
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+!-]{0,63}")     # PEP 440, local part included
REL = re.compile(r"[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*\.py")  # a module file under site-packages
DTYPE = re.compile(r"torch\.[a-z0-9_]{1,40}")
SIGNATURE_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY", "VAR_POSITIONAL", "VAR_KEYWORD")
ANNOTATION_TYPES = (("Tensor", "Tensor"), ("dtype", "ScalarType"), ("bool", "bool"), ("float", "float"),
                    ("int", "SymInt"), ("str", "str"), ("device", "Device"))


class CannotWrap(Exception):
    """The function cannot be made an opaque custom op; the message says why."""


@dataclass
class Param:
    name: str
    kind: str              # POSITIONAL_ONLY, POSITIONAL_OR_KEYWORD, KEYWORD_ONLY
    annotation: str | None
    has_default: bool
    seen: dict | None       # the argument dynamo saw at capture (None: the default was used)
    schema_type: str | None = None   # None: baked (None at capture, untyped): not an op argument
    optional: bool = False


@dataclass
class Fit:
    """What the probe showed of the outputs."""
    structure: str                       # tensor | tuple | list | none
    outputs: list[dict] = field(default_factory=list)   # per position: {kind: fresh|alias|none, ...}
    mutated: list[str] = field(default_factory=list)


# ---- the arguments as dynamo saw them -------------------------------------------------------------

def bind(signature: list[dict], args: list[dict], kwargs: dict[str, dict]) -> list[Param]:
    """The probe's signature rows bound to the arguments of the call dynamo inlined."""
    params, positional = [], list(args)
    for row in signature:
        kind = row["kind"]
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            raise CannotWrap(f"it takes {'*' if kind == 'VAR_POSITIONAL' else '**'}{row['name']}: a custom op's "
                             f"schema needs every argument named")
        if not IDENT.fullmatch(row["name"]) or keyword.iskeyword(row["name"]):
            raise CannotWrap(f"parameter {row['name']!r} is not a plain name")
        seen = None
        if kind != "KEYWORD_ONLY" and positional:
            seen = positional.pop(0)
        elif row["name"] in kwargs:
            seen = kwargs[row["name"]]
        params.append(Param(row["name"], kind, row.get("annotation"), row.get("default") != "<empty>", seen))
        if seen is None and row.get("default") == "<empty>":
            raise CannotWrap(f"parameter {row['name']} has no value at the call dynamo saw")
    if positional:
        raise CannotWrap(f"{len(positional)} more positional argument(s) than the function takes")
    for p in params:
        p.schema_type, p.optional = schema_type(p, _default_of(signature, p.name))
    return params


def _default_of(signature: list[dict], name: str) -> str:
    return next(r.get("default", "<empty>") for r in signature if r["name"] == name)


def _from_annotation(annotation: str | None) -> str | None:
    text = annotation or ""
    if re.search(r"List\[|list\[|Sequence\[|Tuple\[|tuple\[", text):
        inner = re.search(r"\[(.*)\]", text)
        base = _from_annotation(inner.group(1) if inner else "")
        return f"{base.rstrip('?')}[]" if base and base.rstrip("?") in ("SymInt", "float", "bool", "Tensor") else None
    for needle, schema in ANNOTATION_TYPES:
        if re.search(rf"\b{needle}\b", text):
            return schema
    return None


def _optional_annotation(annotation: str | None) -> bool:
    return bool(annotation) and bool(re.search(r"Optional\[|\bNone\b|\|", annotation))


def schema_type(p: Param, default: str) -> tuple[str | None, bool]:
    """(schema type, optional) for one parameter; (None, True) bakes a None the capture passed."""
    optional = default == "None" or _optional_annotation(p.annotation)
    seen = p.seen if p.seen is not None else _literal_default(default)
    if seen is None:
        raise CannotWrap(f"parameter {p.name}: its default {default} is not a value a schema can carry")
    kind = seen.get("kind")
    if kind == "tensor":
        return ("Tensor?" if optional else "Tensor"), optional
    if kind == "symint":
        return "SymInt", False
    if kind == "list":
        items = seen.get("items") or []
        kinds = {(i.get("kind"), i.get("type")) for i in items}
        if all(k in (("const", "int"), ("symint", None)) for k in kinds):
            return "SymInt[]", False
        if kinds <= {("const", "float"), ("const", "int")}:
            return "float[]", False
        if kinds <= {("tensor", None)} and items:
            return "Tensor[]", False
        if kinds <= {("const", "bool")}:
            return "bool[]", False
        raise CannotWrap(f"parameter {p.name}: a list of {sorted(str(k) for k in kinds)}")
    if kind == "const":
        t = seen.get("type")
        if t == "NoneType":
            base = _from_annotation(p.annotation)
            return (f"{base}?" if base else None), True
        base = {"bool": "bool", "int": "SymInt", "float": "float", "str": "str", "dtype": "ScalarType",
                "device": "Device"}.get(t) or _raise(f"parameter {p.name}: a {t} constant")
        return (f"{base}?" if optional else base), optional
    raise CannotWrap(f"parameter {p.name}: dynamo saw a {seen.get('type') or kind}, not a tensor or a constant")


def _raise(message: str):
    raise CannotWrap(message)


def _literal_default(default: str) -> dict | None:
    """A default as the probe printed it (repr), where it is a literal a schema carries."""
    if default == "None":
        return {"kind": "const", "type": "NoneType", "value": None}
    if default in ("True", "False"):
        return {"kind": "const", "type": "bool", "value": default == "True"}
    if re.fullmatch(r"-?\d+", default):
        return {"kind": "const", "type": "int", "value": int(default)}
    if re.fullmatch(r"-?(\d+\.\d*|\d*\.\d+|\d+)(e-?\d+)?|-?\d+e-?\d+", default):
        return {"kind": "const", "type": "float", "value": float(default)}
    if re.fullmatch(r"torch\.[a-z0-9_]+", default):
        return {"kind": "const", "type": "dtype", "value": default}
    if re.fullmatch(r"'[^'\\]*'", default):
        return {"kind": "const", "type": "str", "value": default[1:-1]}
    return None


# ---- the outputs, as the probe measured them ------------------------------------------------------

def _is_contiguous(shape: list[int], stride: list[int]) -> bool:
    expect = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expect:
            return False
        expect *= size
    return True


def _layout(out: dict) -> str:
    shape, stride = out["shape"], out["stride"]
    if _is_contiguous(shape, stride):
        return "contiguous"
    if len(shape) >= 2:
        swapped = shape[:-2] + [shape[-1], shape[-2]]
        sstride = stride[:-2] + [stride[-1], stride[-2]]
        if _is_contiguous(swapped, sstride):
            return "column-major"
    raise CannotWrap(f"an output of shape {shape} has strides {stride}: neither contiguous nor column-major")


def fit_outputs(cases: list[dict], params: list[Param]) -> Fit:
    """The probe's successful cases -> per output position: fresh (shape rule, dtype, layout), an
    argument returned (alias), or None."""
    ok = [c for c in cases if c.get("ok")]
    if not ok:
        errors = "; ".join(sorted({c.get("error", "?") for c in cases}))[:500]
        raise CannotWrap(f"the function did not run at any probed size ({errors})")
    first = ok[0]["output"]
    kind = first.get("kind")
    if kind == "object":
        raise CannotWrap(f"it returns a Python value ({first.get('type')}), not tensors")
    structure = {"tensor": "tensor", "none": "none", "tuple": "tuple", "list": "list"}.get(kind)
    if structure is None:
        raise CannotWrap(f"it returns {kind}")
    per_case = [_positions(c["output"]) for c in ok]
    if len({len(p) for p in per_case}) != 1:
        raise CannotWrap("the number of outputs changes with the size")
    mutated = sorted({m for c in ok for m in c.get("mutated") or []})
    fit = Fit(structure=structure, mutated=mutated)
    names = {p.name: p for p in params}
    for i in range(len(per_case[0])):
        outs = [p[i] for p in per_case]
        kinds = {o.get("kind") for o in outs}
        if kinds == {"none"}:
            fit.outputs.append({"kind": "none"})
            continue
        if kinds != {"tensor"}:
            raise CannotWrap(f"output {i} is {sorted(kinds)} across the probed sizes")
        aliases = {o.get("alias") for o in outs}
        if len(aliases) == 1 and None not in aliases:
            fit.outputs.append({"kind": "alias", "param": aliases.pop()})
            continue
        if any(o.get("view_of") for o in outs):
            raise CannotWrap(f"output {i} is a view of argument {outs[0]['view_of']}: a custom op cannot return one")
        fit.outputs.append({"kind": "fresh", "dims": [_dim_rule(i, d, outs, ok, names) for d in range(len(outs[0]["shape"]))],
                            "dtype": _dtype_rule(outs, ok[0], params), "layout": _layout(outs[0]),
                            "like": _device_param(outs[0], ok[0], params)})
    return fit


def _positions(output: dict) -> list[dict]:
    if output.get("kind") in ("tuple", "list"):
        return list(output.get("items") or [])
    return [output]


def _dim_rule(index: int, d: int, outs: list[dict], cases: list[dict], params: dict[str, Param]) -> str:
    values = [o["shape"][d] for o in outs]
    candidates: list[tuple[int, str]] = []
    for pname, _param in params.items():
        shapes = [c["inputs"].get(pname) for c in cases]
        if any(s is None for s in shapes):
            continue
        for j in range(len(shapes[0])):
            ins = [s[j] if j < len(s) else None for s in shapes]
            if None in ins or 0 in ins:
                continue
            ratios = {Fraction(v, i) for v, i in zip(values, ins)}
            if len(ratios) != 1:
                continue
            r = ratios.pop()
            varied = len(set(ins)) > 1
            ref = f"{pname}.shape[{j}]"
            if r == 1:
                candidates.append((0 if varied else 2, ref))
            elif r.numerator == 1:
                divisor = _int_arg_equal(params, r.denominator)
                candidates.append((1 if varied else 3, f"{ref} // {divisor or r.denominator}"))
            elif r.denominator == 1:
                candidates.append((1 if varied else 3, f"{ref} * {r.numerator}"))
    if len(set(values)) == 1:
        candidates.append((4 if any(c[0] < 2 for c in candidates) else 2.5, str(values[0])))
    if not candidates:
        raise CannotWrap(f"output {index} dim {d} ({values} over the probed sizes) follows no input dim: "
                         f"a data-dependent size")
    return min(candidates)[1]


def _int_arg_equal(params: dict[str, Param], value: int) -> str | None:
    for p in params.values():
        seen = p.seen or {}
        if p.schema_type == "SymInt" and seen.get("kind") == "const" and seen.get("value") == value:
            return p.name
    return None


def _dtype_rule(outs: list[dict], case: dict, params: list[Param]) -> str:
    dtypes = {o["dtype"] for o in outs}
    if len(dtypes) != 1:
        raise CannotWrap(f"an output's dtype changes with the size ({sorted(dtypes)})")
    dtype = dtypes.pop()
    constant = "_servops_torch." + dtype.replace("torch.", "")
    for p in params:  # a dtype argument that asked for it (out_dtype) decides first
        seen = p.seen or {}
        if p.schema_type and p.schema_type.startswith("ScalarType") and seen.get("value") == dtype:
            return f"({p.name} if {p.name} is not None else {constant})" if p.optional else p.name
    for p in params:
        seen = p.seen or {}
        if seen.get("kind") == "tensor" and seen.get("dtype") == dtype:
            return f"{p.name}.dtype"
    return constant


def _device_param(out: dict, case: dict, params: list[Param]) -> str:
    for p in params:
        seen = p.seen or {}
        if seen.get("kind") == "tensor" and p.schema_type == "Tensor" and seen.get("device") == out["device"]:
            return p.name
    raise CannotWrap("no tensor argument on the output's device to allocate its fake like")


# ---- what the host sent, checked before a byte of it is written into a patch ------------------------
# The probe's reply and the break record come from the audited host; the patch they make is stored
# and deployed to every host of that release. A field that would become code, a file name or a diff
# line is held to what a real reply holds; anything else says why it cannot be wrapped.

def _ints(value, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CannotWrap(f"the probe's reply: {what} is not a list of sizes")
    return value


def _check_tensor(out: dict, where: str, names: set[str]) -> None:
    _ints(out.get("shape"), f"{where}.shape")
    _ints(out.get("stride"), f"{where}.stride")
    if len(out["shape"]) != len(out["stride"]):
        raise CannotWrap(f"the probe's reply: {where} has {len(out['shape'])} dims and {len(out['stride'])} strides")
    if not DTYPE.fullmatch(str(out.get("dtype"))):
        raise CannotWrap(f"the probe's reply: {where}.dtype {str(out.get('dtype'))[:60]!r} is not a torch dtype")
    if not isinstance(out.get("device"), str):
        raise CannotWrap(f"the probe's reply: {where}.device is not a device")
    if out.get("alias") is not None and out.get("alias") not in names:
        raise CannotWrap(f"the probe's reply: {where}.alias is not a parameter of the function")


def check_probe(probe: dict, names: set[str]) -> None:
    """The probe's reply as a real probe sends it, or CannotWrap saying which field is not."""
    if not isinstance(probe.get("signature"), list) or not all(
            isinstance(r, dict) and isinstance(r.get("name"), str) and r.get("kind") in SIGNATURE_KINDS
            for r in probe["signature"]):
        raise CannotWrap("the probe's reply: its signature is not a list of parameters")
    for key, rx in (("dist", DIST), ("dist_version", VERSION), ("rel", REL)):
        value = probe.get(key)
        if not isinstance(value, str) or not rx.fullmatch(value) or ".." in value.split("/"):
            raise CannotWrap(f"the probe's reply: {key} {str(value)[:80]!r} is not a distribution's name, version "
                             f"or file")
    tail, count = probe.get("tail"), probe.get("line_count")
    if not isinstance(tail, list) or len(tail) > 3 or not all(isinstance(t, str) and "\n" not in t and "\r" not in t
                                                               for t in tail):
        raise CannotWrap("the probe's reply: tail is not the file's last lines")
    if not isinstance(count, int) or isinstance(count, bool) or count < len(tail) or \
            not isinstance(probe.get("ends_with_newline"), bool):
        raise CannotWrap("the probe's reply: line_count or ends_with_newline is not the file's")
    if not isinstance(probe.get("cases"), list) or not all(isinstance(c, dict) for c in probe["cases"]):
        raise CannotWrap("the probe's reply: cases is not a list of calls")
    for i, case in enumerate(c for c in probe["cases"] if c.get("ok")):
        output = case.get("output")
        inputs = case.get("inputs")
        if not isinstance(output, dict) or not isinstance(inputs, dict) or not isinstance(case.get("mutated") or [], list):
            raise CannotWrap(f"the probe's reply: case {i} has no output, inputs or mutated list")
        for name, shape in inputs.items():
            _ints(shape, f"case {i}.inputs.{str(name)[:40]}")
        if not isinstance(case.get("sizes") or {}, dict):
            raise CannotWrap(f"the probe's reply: case {i}.sizes is not a mapping of sizes")
        _ints(list((case.get("sizes") or {}).values()), f"case {i}.sizes")
        if not set(case.get("mutated") or []) <= names:
            raise CannotWrap(f"the probe's reply: case {i} mutated names no parameter of the function")
        items = output.get("items") if output.get("kind") in ("tuple", "list") else [output]
        if not isinstance(items, list) or not all(isinstance(o, dict) for o in items):
            raise CannotWrap(f"the probe's reply: case {i}'s output is not a list of values")
        for j, out in enumerate(items):
            if out.get("kind") == "tensor":
                _check_tensor(out, f"case {i} output {j}", names)


def check_frame(frame: dict) -> None:
    """The chain frame to wrap, as the shim records one: a module's dotted name, its arguments objects."""
    if not MODULE.fullmatch(str(frame.get("module"))):
        raise CannotWrap(f"{str(frame.get('module'))[:80]!r} is not a module name")
    args, kwargs = frame.get("args") or [], frame.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict) or not all(
            isinstance(a, dict) for a in list(args) + list(kwargs.values())):
        raise CannotWrap("the break record: the frame's arguments are not the values dynamo saw")


def comment_line(text: object, limit: int = 300) -> str:
    """Text for one `# ...` line of the patch: printable characters only (a newline, a CR or a
    Unicode line separator in a host's message would end the comment and start code)."""
    return "".join(c if c.isprintable() else "?" for c in str(text))[:limit]


# ---- the patch ---------------------------------------------------------------------------------------

@dataclass
class Synthesis:
    name: str           # the patch's name in the store
    distribution: str
    version: str
    file: str           # relative to site-packages
    op: str             # namespace::name
    schema: str
    text: str           # the unified diff
    meta: dict          # the .yml


def op_schema(params: list[Param], fit: Fit) -> str:
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    args = []
    for p in params:
        if p.schema_type is None:
            continue
        t = p.schema_type
        if p.name in fit.mutated:
            t = t.replace("Tensor", f"Tensor({next(letters)}!)", 1)
        args.append(f"{t} {p.name}")
    fresh = [o for o in fit.outputs if o["kind"] == "fresh"]
    ret = "()" if not fresh else "Tensor" if len(fresh) == 1 else "(" + ", ".join("Tensor" for _ in fresh) + ")"
    return f"({', '.join(args)}) -> {ret}"


def _fake_expr(out: dict) -> str:
    dims = out["dims"]
    if out["layout"] == "column-major":
        swapped = dims[:-2] + [dims[-1], dims[-2]]
        return f"{out['like']}.new_empty(({', '.join(swapped)},), dtype={out['dtype']}).transpose(-1, -2)"
    return f"{out['like']}.new_empty(({', '.join(dims)},), dtype={out['dtype']})"


def _call_args(params: list[Param], values: dict[str, str] | None = None) -> str:
    values = values or {}
    parts = []
    for p in params:
        value = values.get(p.name, p.name)
        parts.append(f"{p.name}={value}" if p.kind == "KEYWORD_ONLY" else value)
    return ", ".join(parts)


def _def_params(params: list[Param], default_of: str | None) -> str:
    parts, star_done, slash_done = [], False, False
    for i, p in enumerate(params):
        if p.kind == "KEYWORD_ONLY" and not star_done:
            parts.append("*")
            star_done = True
        text = p.name + (f"={default_of}[{p.name!r}]" if default_of and p.has_default else "")
        parts.append(text)
        nxt = params[i + 1] if i + 1 < len(params) else None
        if p.kind == "POSITIONAL_ONLY" and (nxt is None or nxt.kind != "POSITIONAL_ONLY") and not slash_done:
            parts.append("/")
            slash_done = True
    return ", ".join(parts)


def _wrapped(params: str, indent: int, width: int = 100) -> str:
    """A long parameter list one per line (what black would do with it)."""
    if len(params) + indent <= width:
        return params
    return "\n    " + ",\n    ".join(params.split(", ")) + ",\n"


def _guard(params: list[Param]) -> str:
    conds = []
    for p in params:
        if p.schema_type is None:
            conds.append(f"{p.name} is None")
        elif p.optional and p.schema_type.startswith("Tensor") and p.schema_type.endswith("?"):
            # which optional tensors were given decides what is mutated and returned: the op stands
            # for the pattern the capture made, the function itself for any other
            seen = p.seen or _literal_default("None")
            conds.append(f"{p.name} is None" if seen.get("type") == "NoneType" else f"{p.name} is not None")
    return " and ".join(conds) or "True"


def code_block(func: str, params: list[Param], fit: Fit, op: str, why: list[str]) -> str:
    """The lines appended to the function's module."""
    op_params = [p for p in params if p.schema_type is not None]
    positional_op = ", ".join(p.name for p in op_params)
    raw = f"_servops_raw_{func}"
    fresh_at = [i for i, o in enumerate(fit.outputs) if o["kind"] == "fresh"]
    if fit.structure in ("tuple", "list"):
        op_return = "out[%d]" % fresh_at[0] if len(fresh_at) == 1 else \
            "(" + ", ".join(f"out[{i}]" for i in fresh_at) + ("," if len(fresh_at) == 1 else "") + ")"
    else:
        op_return = "out"
    if not fresh_at:
        op_return = "None"
    fakes = [_fake_expr(fit.outputs[i]) for i in fresh_at]
    fake_return = "None" if not fakes else fakes[0] if len(fakes) == 1 else "(" + ", ".join(fakes) + ")"
    if fit.structure in ("tuple", "list"):
        parts, k = [], 0
        for o in fit.outputs:
            if o["kind"] == "fresh":
                parts.append("_out" if len(fresh_at) == 1 else f"_out[{k}]")
                k += 1
            elif o["kind"] == "alias":
                parts.append(o["param"])
            else:
                parts.append("None")
        rebuilt = ("(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")") if fit.structure == "tuple" \
            else "[" + ", ".join(parts) + "]"
    elif fit.structure == "tensor" and fit.outputs and fit.outputs[0]["kind"] == "alias":
        rebuilt = fit.outputs[0]["param"]
    elif fit.structure == "none":
        rebuilt = "None"
    else:
        rebuilt = "_out"
    muts = "".join(f"{m!r}, " for m in fit.mutated).rstrip(" ")
    comment = "".join(f"# {comment_line(line)}\n" for line in why)
    return (
        "\n\n"
        f"# ---- servops: {func} made an opaque custom op (synthesised by `invoke audit --fix`) ----\n"
        f"{comment}"
        "import torch as _servops_torch\n"
        "\n"
        f"{raw} = {func}\n"
        f"_servops_defaults_{func} = {{_p.name: _p.default for _p in __import__('inspect').signature({raw}).parameters.values()}}\n"
        "\n"
        "\n"
        f"@_servops_torch.library.custom_op({op!r}, mutates_args=({muts}), schema={op_schema(params, fit)!r})\n"
        f"def _servops_op_{func}({positional_op}):\n"
        f"    out = {raw}({_call_args(params, {p.name: 'None' for p in params if p.schema_type is None})})\n"
        f"    return {op_return}\n"
        "\n"
        "\n"
        f"@_servops_op_{func}.register_fake\n"
        f"def _servops_fake_{func}({positional_op}):\n"
        f"    return {fake_return}\n"
        "\n"
        "\n"
        f"def {func}({_wrapped(_def_params(params, f'_servops_defaults_{func}'), len(func) + 5)}):\n"
        f"    if {_guard(params)}:  # as the capture called it: opaque to dynamo\n"
        f"        _out = _servops_op_{func}({positional_op})\n"
        f"        return {rebuilt}\n"
        f"    return {raw}({_call_args(params)})\n"
        "\n"
        "\n"
        "# a module that imported the function under its name while this one was still loading (a cycle);\n"
        "# read from each module's own namespace, never through a module __getattr__\n"
        "for _servops_module in list(__import__('sys').modules.values()):\n"
        f"    if getattr(_servops_module, '__dict__', {{}}).get({func!r}) is {raw}:\n"
        f"        _servops_module.__dict__[{func!r}] = {func}\n"
    )


def append_diff(rel: str, tail: list[str], line_count: int, ends_with_newline: bool, block: str) -> str:
    """A unified diff appending `block` at the end of `rel`, the file's last lines as context."""
    context = tail[-3:]
    start = line_count - len(context) + 1
    added = block.split("\n")
    if added and added[-1] == "":
        added = added[:-1]
    lines = [f"--- a/{rel}", f"+++ b/{rel}"]
    if ends_with_newline:
        lines.append(f"@@ -{start},{len(context)} +{start},{len(context) + len(added)} @@")
        lines += [f" {c}" for c in context] + [f"+{a}" for a in added]
    else:  # the last line gains its newline: it is replaced
        lines.append(f"@@ -{start},{len(context)} +{start},{len(context) + len(added)} @@")
        lines += [f" {c}" for c in context[:-1]] + [f"-{context[-1]}", "\\ No newline at end of file",
                                                    f"+{context[-1]}"] + [f"+{a}" for a in added]
    return "\n".join(lines) + "\n"


def synthesise(brk: dict, frame: dict, probe: dict, audit_id: str) -> Synthesis:
    """The patch for one break at one wrap point (a chain frame the probe called)."""
    func = frame.get("qualname")
    if not isinstance(func, str) or not IDENT.fullmatch(func) or keyword.iskeyword(func):
        raise CannotWrap(f"{comment_line(frame.get('module'), 80)}.{comment_line(func, 80)} is not a module-level function")
    check_frame(frame)
    if not isinstance(probe.get("signature"), list):
        raise CannotWrap("the probe's reply: its signature is not a list of parameters")
    check_probe(probe, {str(r.get("name")) for r in probe["signature"] if isinstance(r, dict)})
    params = bind(probe["signature"], frame.get("args") or [], frame.get("kwargs") or {})
    fit = fit_outputs(probe["cases"], params)
    dist, version, rel = probe["dist"], probe["dist_version"], probe["rel"]
    slug = re.sub(r"[^a-z0-9]+", "_", f"{dist}_{func}".lower()).strip("_")
    digest = hashlib.sha256(f"{dist}=={version}:{frame['module']}:{func}".encode()).hexdigest()[:6]
    op = f"servops::{slug}_{digest}"
    sizes = sorted({v for c in probe["cases"] if c.get("ok") for v in (c.get("sizes") or {}).values()})
    why = [f"torch.compile (the engine's prefill capture) cannot trace a call inside {func}:",
           f"  {brk['reason_line']}",
           f"  ({brk['boundary_text']})",
           "As a torch.library custom op with a fake implementation, dynamo keeps out of it and the",
           "compiled graph calls the function itself. Written by servops from the audit " + audit_id + ":",
           "the schema from the arguments seen at capture, the mutated arguments and the output",
           f"shapes from calling the function on {probe.get('device') or 'the host'} at sizes {sizes}."]
    block = code_block(func, params, fit, op, why)
    text = append_diff(rel, probe["tail"], probe["line_count"], probe["ends_with_newline"], block)
    name = f"audit-{func.replace('_', '-')}-{version}"
    meta = {
        "distribution": dist,
        "applies_to": f"{dist}=={version}",
        "why": (f"{brk['reason_line']} ({brk['boundary_text']}), found by servops' audit of the compiled region. "
                f"The patch makes {frame['module']}.{func} an opaque torch.library custom op ({op}) with a fake "
                f"implementation, so dynamo never enters it."),
        "files": [rel],
        "synthesised": {
            "audit": audit_id, "wraps": f"{frame['module']}:{func}", "op": op, "schema": op_schema(params, fit),
            "mutates": fit.mutated, "break": brk["reason_line"], "boundary": brk["boundary_text"],
            "frames": [f"{f.get('module')}.{f.get('qualname')}" for f in brk["chain"]],
            "probed_on": probe.get("device") or "cpu", "torch": probe.get("torch"), "sizes": sizes,
        },
    }
    return Synthesis(name=name, distribution=dist, version=version, file=rel, op=op, schema=op_schema(params, fit),
                     text=text, meta=meta)
