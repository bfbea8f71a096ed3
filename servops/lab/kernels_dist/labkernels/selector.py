from functools import lru_cache

from labkernels.spec import KernelSpec

REGISTRY = {"quantization.per_token_group_quant": KernelSpec("quantization.per_token_group_quant",
                                                             "labkernels.ops.quantization._impl:per_token_group_quant")}


@lru_cache(maxsize=None)
def get_kernel(op):
    """The op's callable, resolved and cached (dynamo ignores the cache and traces the import)."""
    return REGISTRY[op].load()
