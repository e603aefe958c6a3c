"""The Triton kernels of kernels/rotary.py (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def rotary_kernel(
    x_ptr,  # [N, H, R]
    cos_ptr,  # [N, R/2]
    sin_ptr,  # [N, R/2]
    out_ptr,  # [N, H, R], may be x_ptr
    stride_xn,
    stride_xh,
    stride_xr,
    stride_cn,
    stride_cr,
    stride_sn,
    stride_sr,
    stride_on,
    stride_oh,
    stride_or,
    num_heads,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)  # pair index
    mask_i = offs_i < HALF
    mask = (offs_h[:, None] < num_heads) & mask_i[None, :]  # [BLOCK_H, BLOCK_HALF]
    if INTERLEAVED:
        first, second = 2 * offs_i, 2 * offs_i + 1
    else:
        first, second = offs_i, offs_i + HALF
    x_row = x_ptr + token * stride_xn + offs_h[:, None] * stride_xh
    x1 = tl.load(x_row + first[None, :] * stride_xr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :] * stride_xr, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * stride_cn + offs_i * stride_cr, mask=mask_i, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sn + offs_i * stride_sr, mask=mask_i, other=0.0).to(tl.float32)
    out1 = x1 * c[None, :] - x2 * s[None, :]
    out2 = x2 * c[None, :] + x1 * s[None, :]
    # Every program loads its whole tile before storing, so out may alias x.
    out_row = out_ptr + token * stride_on + offs_h[:, None] * stride_oh
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_row + offs_i[None, :] * stride_or, out1.to(out_ty), mask=mask)
    tl.store(out_row + (offs_i[None, :] + HALF) * stride_or, out2.to(out_ty), mask=mask)
