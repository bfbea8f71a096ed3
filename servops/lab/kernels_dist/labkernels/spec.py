import importlib


class KernelSpec:
    def __init__(self, op, target):
        self.op = op
        self.target = target

    def load(self):
        """Import and return the backing callable (as sglang/kernels/spec.py: importlib)."""
        module_path, _, attr = self.target.partition(":")
        obj = importlib.import_module(module_path)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
