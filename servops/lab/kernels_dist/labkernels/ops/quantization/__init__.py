from typing import Optional

import torch

from labkernels.selector import get_kernel


def per_token_group_quant(
    input: torch.Tensor,
    output_q: Optional[torch.Tensor] = None,
    output_s: Optional[torch.Tensor] = None,
    group_size: int = 128,
    *,
    eps: float = 1e-10,
    column_major_scales: bool = False,
):
    """Per-token-group FP8 quantization, sglang's signature: returns (x_q, x_s); pass
    output_q/output_s to quantize into caller-owned buffers."""
    return get_kernel("quantization.per_token_group_quant")(
        input, output_q, output_s, group_size, eps=eps, column_major_scales=column_major_scales
    )
