"""fp8_blockscale_gemm: out = (x @ (w * w_scale blocks).T), FlashInfer's argument order."""
import torch

from .jit import build_and_load, is_cuda_version_at_least


def fp8_blockscale_gemm(input, weight, input_scale=None, weight_scale=None, out_dtype=None):
    """input (M, K) bf16; weight (N, K) fp8; weight_scale (N // 128, K // 128) fp32."""
    if not is_cuda_version_at_least("12.8"):
        raise RuntimeError("fp8_blockscale_gemm needs CUDA 12.8")
    build_and_load("fp8_blockscale_gemm_sm90")
    n, k = weight.shape
    bn, bk = n // weight_scale.shape[0], k // weight_scale.shape[1]
    w = weight.float().view(n // bn, bn, k // bk, bk) * weight_scale.float()[:, None, :, None]
    out = input.float() @ w.view(n, k).T
    return out.to(out_dtype or torch.bfloat16)
