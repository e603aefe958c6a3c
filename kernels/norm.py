"""RMSNorm, optionally fused with the residual add.

    h = x + residual                  (when a residual is given: the new residual stream)
    y = weight * (h / sqrt(mean(h^2) + eps))

The statistics are computed in float32 and the normalised value is cast back to the input dtype
before the weight multiply, exactly as the HF DeepSeek reference does, so bf16 results match it.
The sum h is rounded to the input dtype before it is normalised, as the unfused `x + residual`
would be.

Kernel layout: one program per row; the row is loaded whole (BLOCK_D = D rounded up to a power
of two, masked), so the mean of squares is one reduction.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.dispatch import next_power_of_2, resolve_impl


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """[..., D] -> [M, D] with unit stride along D (a view when possible)."""
    t = t.reshape(-1, d)
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def _rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from kernels.jit import norm as jit

    # (1) check
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [D={d}], got shape {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}"
        )
    x2 = _rows(x, d)  # [M, D]
    r2 = _rows(residual, d) if residual is not None else x2
    weight = weight.contiguous()
    # (2) allocate: the output dtype follows `weight * normed`, as in the reference
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    out2, sum2 = out.view(-1, d), summed.view(-1, d)
    # (3) launch
    if x2.shape[0]:
        jit.rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out2,
            sum2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            sum2.stride(0),
            float(eps),
            D=d,
            HAS_RESIDUAL=residual is not None,
            BLOCK_D=next_power_of_2(d),
            num_warps=4 if d <= 4096 else 8,
        )
    return out if residual is None else (out, summed)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D], weight [D], residual [..., D] like x or None
    -> y [..., D] in x's dtype, or (y, x + residual) when a residual is given."""
    if resolve_impl(impl, x, has_triton=True) == "triton":
        return _rms_norm_triton(x, weight, eps, residual)
    if x.dim() == 2 and native.loaded() and native.takes(x, weight, residual):
        return native.rms_norm(x, weight, eps, residual)  # one call for the reference's eight ops
    if residual is None:
        return _rms_norm_torch(x, weight, eps)
    summed = x + residual
    return _rms_norm_torch(summed, weight, eps), summed


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the new residual stream is the sum."""
    return rms_norm(x, weight, eps, residual=residual, impl=impl)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)  # one fused op, same math
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)
