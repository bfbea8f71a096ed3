"""FlashInfer-shaped GEMM (flashinfer.gemm.fp8_blockscale_gemm_sm90's shape of call)."""
from .gemm import fp8_blockscale_gemm

__all__ = ["fp8_blockscale_gemm"]
