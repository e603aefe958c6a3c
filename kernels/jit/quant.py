"""The Triton kernels of kernels/quant.py (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl

E4M3_MAX = 448.0


@triton.jit
def _round_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32
    arithmetic, so the cast after it is exact (the interpreter's own float8 cast misrounds where
    the mantissa carries into the exponent): e4m3 steps are 2^(e - 3) for |v| in [2^e, 2^(e+1)),
    2^-9 below 2^-6; adding and subtracting 1.5 x 2^23 rounds v / step to an integer, ties to even."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.exp2((tl.maximum(exponent, -6) - 3).to(tl.float32))
    return ((v / step + 12582912.0) - 12582912.0) * step


@triton.jit
def act_quant_kernel(
    x_ptr,  # [M, K] activations (any float)
    q_ptr,  # [M, K] e4m3
    s_ptr,  # [M, ceil(K / GROUP)] float32: each group's scale
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
):
    """One program per (row, group of K): scale = amax / 448 (a power of two rounded up with
    UE8M0), q = x / scale rounded to e4m3: DeepSeek's per-token, per-group activation
    quantization."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)), 1e-10) / E4M3_MAX
    if UE8M0:
        scale = tl.exp2(tl.ceil(tl.log2(scale)))
    q = _round_e4m3(tl.clamp(x / scale, -E4M3_MAX, E4M3_MAX))
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group, scale)


@triton.jit
def w8a8_block_gemm_kernel(
    a_ptr,  # [M, K] e4m3 activations
    as_ptr,  # [M, ceil(K / BLOCK_K)] float32 activation scales
    b_ptr,  # [N, K] e4m3 weight
    bs_ptr,  # [N, ceil(K / BLOCK_K)] float32 weight scales (one per row per block of K)
    c_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scales' block of K
    WIDEN: tl.constexpr,  # fp32 dots (the interpreter); on a GPU the e4m3 tiles go to tl.dot as they are
):
    """C = sum over K blocks of (A_blk @ B_blk^T) * a_scale[m, blk] * b_scale[n, blk], float32
    sums, stored in C's dtype."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if WIDEN:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        a_scale = tl.load(as_ptr + offs_m * stride_asm + kb, mask=m_mask, other=0.0)
        b_scale = tl.load(bs_ptr + offs_n * stride_bsn + kb, mask=n_mask, other=0.0)
        acc += part * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
