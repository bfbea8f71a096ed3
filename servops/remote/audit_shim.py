"""The audit's eyes inside the engine: a sitecustomize for the audit's child server, and its probe.

Stdlib only at import (torch is imported lazily, once the engine imports it). The audit program
(audit_compile.py) writes this file as `sitecustomize.py` into its work directory and puts that
directory first on the child server's PYTHONPATH, with SERVOPS_AUDIT_DIR naming the directory.
Every process of the server (sglang spawns its schedulers with the same environment) then:

- serves the files of the audit's fix set as the fix set has them (an import hook compiles those
  modules from `overlay.json`'s copies): the host's site-packages are never written, and the
  serving server beside the audit sees none of it;
- records every dynamo break of the compiled region in `breaks.jsonl`: dynamo's reason, and the
  chain of user functions it was inlining when it stopped, outermost first, each with the
  arguments it was called with as dynamo saw them (fake tensors' shapes, dtypes, strides, the
  symbolic dims with their hints, constants), so a fix can be written for the boundary call;
- chain-loads the sitecustomize this one shadows, if any.

Run as a script, `python audit_shim.py probe REQUEST.json`, it calls one function of the host's
engine for real at several sizes (the probe of a synthesised custom op): which arguments it
mutates, what it returns, which output dims follow which input dims.
"""

import json
import os
import sys

AUDIT_DIR = os.environ.get("SERVOPS_AUDIT_DIR", "")
MAX_RECORD = 256 * 1024  # one break's record, as written (a hostile repr cannot fill the disk)


def _append_record(record):
    if not AUDIT_DIR:
        return
    try:
        line = json.dumps(record, default=str)
    except (TypeError, ValueError):
        return
    if len(line) > MAX_RECORD:
        record = {k: record.get(k) for k in ("reason", "pid", "truncated")}
        record["truncated"] = True
        line = json.dumps(record, default=str)
    fd = os.open(os.path.join(AUDIT_DIR, "breaks.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


# ---- the fix set's files, served from copies -------------------------------------------------

def _install_overlay():
    try:
        with open(os.path.join(AUDIT_DIR, "overlay.json")) as f:
            overlay = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(overlay, dict) or not overlay:
        return
    import importlib.machinery

    class OverlayFinder(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else None
            if origin in overlay:
                copy = overlay[origin]

                class OverlayLoader(importlib.machinery.SourceFileLoader):
                    def get_code(self, name):  # never writes a .pyc of the copy beside the host's file
                        with open(copy, "rb") as f:
                            return compile(f.read(), self.path, "exec", dont_inherit=True)

                spec.loader = OverlayLoader(fullname, spec.origin)
            return spec

    sys.meta_path.insert(0, OverlayFinder)


# ---- dynamo's breaks, with the arguments of each inlined call ---------------------------------

def _dim(value):
    if isinstance(value, int):
        return value
    node = getattr(value, "node", None)
    hint = getattr(node, "hint", None)
    if hint is None:
        try:
            hint = node.shape_env.size_hint(node.expr)
        except Exception:  # noqa: BLE001 - a symbol without a hint: the record says so
            hint = None
    return {"sym": str(value), "hint": int(hint) if hint is not None else None}


def describe_value(vt, depth=0):
    """What dynamo knew of one argument (a VariableTracker), as JSON."""
    try:
        from torch._dynamo.variables import SymNodeVariable, TensorVariable
        from torch._dynamo.variables.lists import BaseListVariable
    except ImportError:
        return {"kind": "object", "type": type(vt).__name__}
    try:
        if isinstance(vt, TensorVariable):
            ev = vt.proxy.node.meta.get("example_value")
            return {"kind": "tensor", "shape": [_dim(d) for d in ev.shape], "stride": [_dim(s) for s in ev.stride()],
                    "dtype": str(ev.dtype), "device": ev.device.type}
        if isinstance(vt, SymNodeVariable):
            d = _dim(vt.sym_num)
            return {"kind": "symint", "sym": d["sym"], "hint": d["hint"]} if isinstance(d, dict) else \
                {"kind": "const", "type": "int", "value": d}
        if isinstance(vt, BaseListVariable) and depth < 2:
            return {"kind": "list", "items": [describe_value(v, depth + 1) for v in vt.items][:64]}
        if vt.is_python_constant():
            return _describe_constant(vt.as_python_constant())
    except Exception as exc:  # noqa: BLE001 - an argument dynamo cannot describe: the record says so
        return {"kind": "object", "type": type(vt).__name__, "note": repr(exc)[:200]}
    return {"kind": "object", "type": type(vt).__name__}


def _describe_constant(value):
    import torch
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "const", "type": type(value).__name__, "value": value}
    if isinstance(value, torch.dtype):
        return {"kind": "const", "type": "dtype", "value": str(value)}
    if isinstance(value, torch.device):
        return {"kind": "const", "type": "device", "value": str(value)}
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float)) for v in value):
        return {"kind": "list", "items": [_describe_constant(v) for v in value][:64]}
    return {"kind": "object", "type": type(value).__name__}


def _frame_record(parent, func, args, kwargs):
    fn = getattr(func, "fn", None)
    code = getattr(fn, "__code__", None)
    try:
        filename = func.get_filename()
    except Exception:  # noqa: BLE001
        filename = getattr(code, "co_filename", None)
    parent_code = getattr(parent, "f_code", None)
    return {"module": getattr(fn, "__module__", None), "qualname": getattr(fn, "__qualname__", None),
            "name": getattr(code, "co_name", None), "file": filename,
            "firstlineno": getattr(code, "co_firstlineno", None),
            "called_from": {"file": getattr(parent_code, "co_filename", None), "line": getattr(parent, "lineno", None),
                            "function": getattr(parent_code, "co_name", None)},
            "args": [describe_value(a) for a in args][:64],
            "kwargs": {str(k): describe_value(v) for k, v in list(kwargs.items())[:64]}}


def _reason(exc):
    text = str(exc)
    return {"type": "%s.%s" % (type(exc).__module__, type(exc).__name__), "message": text[:4000]}


def _install_dynamo_hook(symbolic_convert):
    from torch._dynamo.exc import Unsupported
    inlining = symbolic_convert.InliningInstructionTranslator
    original_inline = inlining.inline_call.__func__

    def inline_call(cls, parent, func, args, kwargs, *rest, **kw):
        try:
            return original_inline(cls, parent, func, args, kwargs, *rest, **kw)
        except Unsupported as exc:
            if getattr(exc, "_servops_written", False):
                raise
            chain = exc.__dict__.setdefault("_servops_chain", [])
            try:
                chain.insert(0, _frame_record(parent, func, args, kwargs))
            except Exception:  # noqa: BLE001 - never let the audit's eyes change the engine's path
                pass
            if not isinstance(parent, inlining):  # the outermost inlined call: the break is whole
                exc._servops_written = True
                root_code = getattr(parent, "f_code", None)
                _append_record(dict(_reason(exc), pid=os.getpid(), chain=chain,
                                    root={"file": getattr(root_code, "co_filename", None),
                                          "function": getattr(root_code, "co_name", None),
                                          "line": getattr(parent, "lineno", None)}))
            raise

    inlining.inline_call = classmethod(inline_call)
    root = symbolic_convert.InstructionTranslator
    original_run = root.run

    def run(self, *a, **kw):  # a break in the compiled function itself (nothing inlined)
        try:
            return original_run(self, *a, **kw)
        except Unsupported as exc:
            if not getattr(exc, "_servops_written", False):
                exc._servops_written = True
                code = getattr(self, "f_code", None)
                _append_record(dict(_reason(exc), pid=os.getpid(), chain=[],
                                    root={"file": getattr(code, "co_filename", None),
                                          "function": getattr(code, "co_name", None),
                                          "line": getattr(self, "lineno", None)}))
            raise

    root.run = run


def _after_import(modname, callback):
    """Run callback(module) once `modname` has been imported (by whoever imports it first)."""
    import importlib.abc
    import importlib.machinery

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != modname:
                return None
            sys.meta_path.remove(self)
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find else None
                if spec is not None:
                    break
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_hook(module):
                exec_module(module)
                try:
                    callback(module)
                except Exception as exc:  # noqa: BLE001 - the engine runs on; the audit says it saw nothing
                    _append_record({"hook_error": repr(exc)[:500], "pid": os.getpid()})

            spec.loader.exec_module = exec_then_hook
            return spec

    sys.meta_path.insert(0, AfterImport())


def _chain_load_shadowed():
    """The sitecustomize this file shadows (a distribution's own), run as it would have been."""
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _follow_parent():
    """End this process when the one that started it ends: an audit program killed (SIGKILL, a
    dropped SSH connection) must not leave its audit server on the GPUs. Each process of the
    server (sglang spawns its schedulers with this sitecustomize) follows its own parent."""
    import threading
    import time
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(3)

    threading.Thread(target=watch, name="servops-audit-follow-parent", daemon=True).start()


def install():
    if not AUDIT_DIR:
        return
    _follow_parent()
    _install_overlay()
    _after_import("torch._dynamo.symbolic_convert", _install_dynamo_hook)
    try:
        _chain_load_shadowed()
    except Exception:  # noqa: BLE001 - the host's own sitecustomize failing is not the audit's finding
        pass


# ---- the probe: the real function, called at several sizes ------------------------------------

PROBE_MAX_ELEMENTS = 1 << 28  # a tensor's elements (its fp32 draw: 1 GiB); a case past it is refused


def _make_tensor(torch, desc, sizes, scale):
    shape = [scale.get(str(d), d) if isinstance(d, int) else sizes[d["sym"]] for d in desc["shape"]]
    numel = 1
    for d in shape:
        numel *= max(int(d), 0)
    if numel > PROBE_MAX_ELEMENTS:  # sizes come from a break record the host wrote: never an allocation past this
        raise ValueError("a %s tensor of %d elements, past the probe's bound (%d)" % (shape, numel, PROBE_MAX_ELEMENTS))
    dtype = getattr(torch, desc["dtype"].replace("torch.", ""))
    device = desc.get("device") or "cpu"
    if dtype.is_floating_point:
        t = torch.rand(shape, device=device, dtype=torch.float32).to(dtype)
    elif dtype == torch.bool:
        t = torch.zeros(shape, device=device, dtype=dtype)
    else:  # integer tensors index things: zeros are in range
        t = torch.zeros(shape, device=device, dtype=dtype)
    stride = desc.get("stride")
    if stride and len(shape) >= 2 and all(isinstance(s, int) for s in stride) and len(stride) == len(shape) \
            and stride[-2] == 1 and stride[-1] != 1:  # a column-major (transposed) argument stays one
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


def _value(torch, desc, sizes, scale):
    kind = desc.get("kind")
    if kind == "tensor":
        return _make_tensor(torch, desc, sizes, scale)
    if kind == "symint":
        return sizes[desc["sym"]]
    if kind == "list":
        return [_value(torch, d, sizes, scale) for d in desc["items"]]
    if kind == "const":
        if desc.get("type") == "dtype":
            return getattr(torch, desc["value"].replace("torch.", ""))
        if desc.get("type") == "device":
            return torch.device(desc["value"])
        return desc.get("value")
    raise ValueError("an argument the probe cannot make: %s" % desc.get("type"))


def _bytes(t):
    return t.detach().reshape(-1).view(__import__("torch").uint8).cpu() if t.numel() else t.detach().cpu()


def _out_desc(torch, value, inputs):
    if value is None:
        return {"kind": "none"}
    if isinstance(value, torch.Tensor):
        alias = view_of = None
        for name, t in inputs.items():
            if not (isinstance(t, torch.Tensor) and t.numel() and value.numel()):
                continue
            if t.data_ptr() == value.data_ptr() and t.shape == value.shape and t.stride() == value.stride():
                alias = name  # the argument itself, filled in place
            elif t.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
                view_of = name
        return {"kind": "tensor", "shape": list(value.shape), "stride": list(value.stride()),
                "dtype": str(value.dtype), "device": value.device.type, "alias": alias,
                "view_of": None if alias else view_of}
    if isinstance(value, (tuple, list)):
        return {"kind": "tuple" if isinstance(value, tuple) else "list",
                "items": [_out_desc(torch, v, inputs) for v in value]}
    return {"kind": "object", "type": type(value).__name__}


def probe(request):
    """Call `module:function` for real with each case's sizes; what it mutated and returned."""
    import importlib
    import inspect
    import torch
    module = importlib.import_module(request["module"])
    fn = module
    for part in request["qualname"].split("."):
        fn = getattr(fn, part)
    sig = inspect.signature(fn)
    def annotation(a):
        if a is inspect.Parameter.empty:
            return None
        if isinstance(a, type):
            return "%s.%s" % (a.__module__, a.__qualname__)
        return str(a)[:200]  # typing constructs print whole: typing.Optional[torch.Tensor]

    out = {"signature": [{"name": p.name, "kind": p.kind.name, "annotation": annotation(p.annotation),
                          "default": "<empty>" if p.default is inspect.Parameter.empty else repr(p.default)[:200]}
                         for p in sig.parameters.values()],
           "file": os.path.realpath(inspect.getsourcefile(inspect.unwrap(fn)) or ""),
           "device": None, "cases": []}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        out["device"] = "%s (sm_%d%d)" % (torch.cuda.get_device_name(), major, minor)
    out["torch"] = torch.__version__
    for case in request["cases"]:
        row = {"sizes": case["sizes"], "scale": case.get("scale")}
        out["cases"].append(row)
        try:
            torch.manual_seed(0)
            scale = case.get("scale") or {}
            args = [_value(torch, d, case["sizes"], scale) for d in request["args"]]
            kwargs = {k: _value(torch, d, case["sizes"], scale) for k, d in request["kwargs"].items()}
            bound = sig.bind(*args, **kwargs)
            named = dict(bound.arguments)
            before = {k: _bytes(v).clone() for k, v in named.items() if isinstance(v, torch.Tensor)}
            result = fn(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            row["mutated"] = sorted(k for k, b in before.items() if not torch.equal(b, _bytes(named[k])))
            row["inputs"] = {k: list(v.shape) for k, v in named.items() if isinstance(v, torch.Tensor)}
            row["output"] = _out_desc(torch, result, named)
            row["ok"] = True
        except Exception as exc:  # noqa: BLE001 - a size the function refuses: that case says why
            row["ok"] = False
            row["error"] = "%s: %s" % (type(exc).__name__, str(exc)[:500])
    return out


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "probe":
    install()  # the fix set's files, as the server sees them
    with open(sys.argv[2]) as f:
        req = json.load(f)
    try:
        result = probe(req)
    except Exception as exc:  # noqa: BLE001 - the module does not import, the function is gone
        result = {"error": "%s: %s" % (type(exc).__name__, str(exc)[:1000])}
    sys.stdout.write("\n" + json.dumps(result) + "\n")
elif __name__ == "sitecustomize":
    install()
