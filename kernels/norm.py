"""RMSNorm, optionally fused with the residual add.

    y = weight * (x / sqrt(mean(x^2) + eps))

The statistics are computed in float32 and the normalised value is cast back to the input dtype
before the weight multiply, exactly as the HF DeepSeek reference does, so bf16 results match it.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)  # one fused op, same math
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the new residual stream is the sum."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
