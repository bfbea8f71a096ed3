"""Kernel selection and loading as FlashInfer does it: the CUDA version from the host's real
FlashInfer (flashinfer/jit/cpp_ext.py, whose unpatched query runs nvcc in a subprocess: the seed's
break), then the prebuilt module's path checked on disk before loading (FlashInfer's JIT loader
stats its AOT artifacts: posix.stat, which dynamo cannot trace either)."""
import os
import sys
import sysconfig
import types


def _flashinfer_module(modname):
    """flashinfer.jit.cpp_ext alone: flashinfer/__init__ needs CUDA extensions this CPU lacks."""
    import importlib
    if modname in sys.modules:
        return sys.modules[modname]
    parts = modname.split(".")
    site = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = [site] + [sysconfig.get_paths()["purelib"]]
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg not in sys.modules:
            shell = types.ModuleType(pkg)
            shell.__path__ = [d for d in (os.path.join(r, *parts[:i]) for r in roots) if os.path.isdir(d)]
            sys.modules[pkg] = shell
    return importlib.import_module(modname)


# resolved at import, as FlashInfer's own modules import cpp_ext: a call traces straight into it
is_cuda_version_at_least = _flashinfer_module("flashinfer.jit.cpp_ext").is_cuda_version_at_least


def build_and_load(name):
    """The JIT loader: a prebuilt module is used where its file exists, else it is built."""
    aot = os.path.join(os.environ.get("LABGEMM_AOT_DIR", os.path.expanduser("~/.cache/labgemm")), name + ".so")
    return os.path.exists(aot)
