import torch

FP8_MAX = 448.0


def per_token_group_quant(input, output_q, output_s, group_size, *, eps, column_major_scales):
    m, k = input.shape
    groups = input.float().view(m, k // group_size, group_size)
    scale = groups.abs().amax(dim=-1).clamp(min=eps) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, k).to(torch.float8_e4m3fn)
    if column_major_scales:
        scale = scale.t().contiguous().t()
    if output_q is not None:
        output_q.copy_(q)
        q = output_q
    if output_s is not None:
        output_s.copy_(scale)
        scale = output_s
    return q, scale
