"""The Triton kernels of kernels/attention.py (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * LN2


@triton.jit
def extend_attention_kernel(
    q_ptr,  # [n, H, D_QK]
    k_ptr,  # [ctx, H, D_QK]
    v_ptr,  # [ctx, H, D_V]
    o_ptr,  # [n, H, D_V]
    lse_ptr,  # [n, H] float32
    n,
    ctx,
    scale,
    stride_qm,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_om,
    stride_oh,
    stride_od,
    stride_lm,
    stride_lh,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,  # next power of two >= D_QK
    BLOCK_DV: tl.constexpr,  # next power of two >= D_V
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, "tf32" (exact on 16-bit values) otherwise
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    prefix = ctx - n  # query i sits at position prefix + i

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < n
    mask_dqk = offs_dqk < D_QK
    mask_dv = offs_dv < D_V
    rows_m = offs_m.to(tl.int64)  # row offsets can pass 2**31 elements on long contexts

    q_ptrs = q_ptr + head * stride_qh + rows_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_dqk[None, :], other=0.0).to(tl.float32)  # [M, DQK]
    qk_scale = scale * LOG2E  # scores in the log2 domain: s2 = log2(e) * s

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of s2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s2 - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # running sum of exp2(s2 - m_i) v

    # Keys past this block's last query are invisible to all of its rows: stop there.
    end = prefix + tl.minimum((pid_m + 1) * BLOCK_M, n)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        rows_n = offs_n.to(tl.int64)
        k_ptrs = k_ptr + head * stride_kh + rows_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd
        k_t = tl.load(k_ptrs, mask=mask_dqk[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # [DQK, N]
        # Scaled after the dot, not folded into q: 16-bit q and k stay exact in tf32.
        s2 = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        # Valid rows never see a key >= end (prefix + i < end); padding rows past n are never stored.
        visible = offs_n[None, :] <= (prefix + offs_m)[:, None]
        s2 = tl.where(visible, s2, float("-inf"))

        # Each valid row sees key 0, in the first block: m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s2, axis=1))
        alpha = tl.exp2(m_i - m_new)  # rescales what came before; 0 on the first block
        p = tl.exp2(s2 - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_ptrs = v_ptr + head * stride_vh + rows_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0).to(tl.float32)  # [N, DV]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * LN2  # back from log2 to natural log

    o_ptrs = o_ptr + head * stride_oh + rows_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])
    tl.store(lse_ptr + head * stride_lh + rows_m * stride_lm, lse, mask=mask_m)


@triton.jit
def merge_attn_states_kernel(
    o1_ptr,  # [T, H, D]
    lse1_ptr,  # [T, H] float32
    o2_ptr,  # [T, H, D]
    lse2_ptr,  # [T, H] float32
    o_ptr,  # [T, H, D]
    lse_ptr,  # [T, H] float32
    stride_o1t,
    stride_o1h,
    stride_o1d,
    stride_l1t,
    stride_l1h,
    stride_o2t,
    stride_o2h,
    stride_o2d,
    stride_l2t,
    stride_l2h,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    lse1 = tl.load(lse1_ptr + row * stride_l1t + head * stride_l1h)
    lse2 = tl.load(lse2_ptr + row * stride_l2t + head * stride_l2h)
    m = tl.maximum(lse1, lse2)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: keep exp2 away from -inf - -inf = NaN
    w1 = tl.exp2((lse1 - m) * LOG2E)  # an empty side (lse -inf) weighs 0
    w2 = tl.exp2((lse2 - m) * LOG2E)
    total = w1 + w2  # >= 1 unless both sides are empty
    nonempty = total > 0.0
    total = tl.where(nonempty, total, 1.0)

    o1 = tl.load(o1_ptr + row * stride_o1t + head * stride_o1h + offs_d * stride_o1d, mask=mask_d, other=0.0)
    o2 = tl.load(o2_ptr + row * stride_o2t + head * stride_o2h + offs_d * stride_o2d, mask=mask_d, other=0.0)
    o = (o1.to(tl.float32) * w1 + o2.to(tl.float32) * w2) / total  # [BLOCK_D]; 0 when both are empty
    lse = tl.where(nonempty, m + tl.log2(total) * LN2, float("-inf"))

    tl.store(
        o_ptr + row * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(o_ptr.dtype.element_ty),
        mask=mask_d,
    )
    tl.store(lse_ptr + row * stride_lt + head * stride_lh, lse)
