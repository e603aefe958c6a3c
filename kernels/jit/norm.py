"""The Triton kernels of kernels/norm.py (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [M, D]
    residual_ptr,  # [M, D] or a dummy when HAS_RESIDUAL is false
    weight_ptr,  # [D]
    out_ptr,  # [M, D]
    sum_ptr,  # [M, D] x + residual out, or a dummy
    stride_xm,
    stride_rm,
    stride_om,
    stride_sm,
    eps,
    D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    x = tl.load(x_ptr + row * stride_xm + offs_d, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rm + offs_d, mask=mask, other=0.0)
        h = (h + r.to(tl.float32)).to(x.dtype)  # the residual stream is kept in the input dtype
        tl.store(sum_ptr + row * stride_sm + offs_d, h, mask=mask)
        h = h.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / D
    normed = (h * tl.rsqrt(variance + eps)).to(x.dtype).to(tl.float32)  # HF rounds here
    w = tl.load(weight_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_d, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
