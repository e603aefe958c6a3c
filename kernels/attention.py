"""Prefill / chunked-prefill ("extend") attention with a causal mask over an already-cached prefix.

A sequence contributes n new query tokens at positions ctx - n .. ctx - 1 and attends to all
ctx keys of its context (the cached prefix plus the new tokens):

    s[i, h, j] = scale * <q[i, h], k[j, h]>           j <= ctx - n + i
    o[i, h]    = softmax_j(s[i, h]) @ v[:, h]
    lse[i, h]  = logsumexp_j(s[i, h])

The Triton kernel is flash attention: one program owns BLOCK_M queries of one head and streams
the keys it can see in blocks of BLOCK_N, keeping per query a running max m, a running sum
l = sum_j exp(s_j - m) and an unnormalised output acc = sum_j exp(s_j - m) v_j. A new block with
max m' rescales both by exp(m - m') before adding its own terms; at the end o = acc / l and
lse = m + log(l). Scores live in the log2 domain (scaled by log2(e)) so the exponentials are
exp2. Every product and sum is float32.

`merge_attn_states` combines two partial results over disjoint key sets by their LSEs (used for
split-K decode and for prefix + new-token attention done in two passes):

    m   = max(lse1, lse2)
    o   = (o1 * exp(lse1 - m) + o2 * exp(lse2 - m)) / (exp(lse1 - m) + exp(lse2 - m))
    lse = m + log(exp(lse1 - m) + exp(lse2 - m))

An empty side (lse = -inf, o = 0) gets weight 0; both sides empty give o = 0 and lse = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import resolve_impl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * LN2

# --- extend attention ----------------------------------------------------------------------------


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


def extend_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches extend_attention_kernel; block sizes default to the GPU's (tests shrink them)."""
    # (1) check
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [n, H, D], [ctx, H, D], [ctx, H, Dv]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    n, heads, d_qk = q.shape
    ctx, d_v = k.shape[0], v.shape[-1]
    if k.shape != (ctx, heads, d_qk):
        raise ValueError(f"k must be [ctx, H={heads}, Dqk={d_qk}], got {tuple(k.shape)}")
    if v.shape[:2] != (ctx, heads):
        raise ValueError(f"v must be [ctx={ctx}, H={heads}, Dv], got {tuple(v.shape)}")
    if ctx < n:
        raise ValueError(f"ctx (k.shape[0] = {ctx}) must be >= n (q.shape[0] = {n})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")

    # (2) allocate
    o = q.new_empty(n, heads, d_v)  # [n, H, Dv]
    lse = torch.empty(n, heads, dtype=torch.float32, device=q.device)  # [n, H]
    if n == 0:
        return o, lse

    # (3) launch
    block_dqk = max(16, triton.next_power_of_2(d_qk))
    block_dv = max(16, triton.next_power_of_2(d_v))
    block_m = block_m or 64
    block_n = block_n or (64 if block_dqk <= 128 else 32)
    grid = (triton.cdiv(n, block_m), heads)
    extend_attention_kernel[grid](
        q,
        k,
        v,
        o,
        lse,
        n,
        ctx,
        scale,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *o.stride(),
        *lse.stride(),
        D_QK=d_qk,
        D_V=d_v,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_DQK=block_dqk,
        BLOCK_DV=block_dv,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if block_dqk <= 128 else 8,
        num_stages=2,
    )
    return o, lse


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    impl: str = "auto",
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [n, H, Dqk], k [ctx, H, Dqk], v [ctx, H, Dv] with ctx >= n
    -> (o [n, H, Dv] in q's dtype, lse [n, H] float32). With return_lse=False the lse is None and
    the PyTorch path uses torch's fused SDPA."""
    if resolve_impl(impl, q, has_triton=True) == "triton":
        o, lse = extend_attention_triton(q, k, v, scale)
        return o, (lse if return_lse else None)
    if return_lse:
        return extend_attention_ref(q, k, v, scale)
    n, ctx = q.shape[0], k.shape[0]
    mask = None
    if ctx != n:  # queries sit at the end of the context: a shifted causal mask
        mask = (
            torch.arange(ctx, device=q.device)[None, :]
            <= (ctx - n + torch.arange(n, device=q.device))[:, None]
        )
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return o.transpose(0, 1), None


def extend_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n, ctx = q.shape[0], k.shape[0]
    scores = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * scale  # [H, n, ctx]
    causal = (
        torch.arange(ctx, device=q.device)[None, :] <= (ctx - n + torch.arange(n, device=q.device))[:, None]
    )
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    probs = torch.exp(scores - lse[..., None])
    o = torch.einsum("hij,jhd->ihd", probs, v.float())
    return o.to(q.dtype), lse.transpose(0, 1).contiguous()


# --- merging partial results -----------------------------------------------------------------------


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


def _rows_heads(o: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [T, H, D]: a view where the strides allow one (H is the second-to-last dim)."""
    if o.dim() == 1:
        return o.view(1, 1, -1)
    if o.dim() == 2:
        return o.unsqueeze(1)
    return o.reshape(-1, *o.shape[-2:])


def merge_attn_states_triton(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches merge_attn_states_kernel over every (row, head) of [..., H, D]."""
    # (1) check
    if o1.dim() == 0 or o1.shape != o2.shape:
        raise ValueError(
            f"o1 and o2 must be the same [..., D] shape, got {tuple(o1.shape)}, {tuple(o2.shape)}"
        )
    if lse1.shape != o1.shape[:-1] or lse2.shape != o1.shape[:-1]:
        raise ValueError(
            f"lse1 and lse2 must be o's shape without D, {tuple(o1.shape[:-1])}; "
            f"got {tuple(lse1.shape)}, {tuple(lse2.shape)}"
        )
    if lse1.dtype != torch.float32 or lse2.dtype != torch.float32:
        raise ValueError(f"lse1 and lse2 must be float32, got {lse1.dtype}, {lse2.dtype}")

    # (2) allocate
    o = torch.empty_like(o1, memory_format=torch.contiguous_format)  # [..., D] in o1's dtype
    lse = torch.empty(lse1.shape, dtype=torch.float32, device=lse1.device)  # [...]
    if o.numel() == 0:
        return o, lse
    o1_3, o2_3, o_3 = _rows_heads(o1), _rows_heads(o2), _rows_heads(o)  # [T, H, D]
    lse1_2, lse2_2, lse_2 = (x.reshape(o_3.shape[:2]) for x in (lse1, lse2, lse))  # [T, H]
    assert lse_2.data_ptr() == lse.data_ptr() and o_3.data_ptr() == o.data_ptr()  # views, not copies

    # (3) launch
    rows, heads, d = o_3.shape
    merge_attn_states_kernel[(rows, heads)](
        o1_3,
        lse1_2,
        o2_3,
        lse2_2,
        o_3,
        lse_2,
        *o1_3.stride(),
        *lse1_2.stride(),
        *o2_3.stride(),
        *lse2_2.stride(),
        *o_3.stride(),
        *lse_2.stride(),
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
    )
    return o, lse


def merge_attn_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """o* [..., D], lse* [...] float32 over disjoint key sets -> (o [..., D] in o1's dtype,
    lse [...] float32) over their union."""
    if resolve_impl(impl, o1, has_triton=True) == "triton":
        return merge_attn_states_triton(o1, lse1, o2, lse2)
    return merge_attn_states_ref(o1, lse1, o2, lse2)


def merge_attn_states_ref(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).nan_to_num(0.0)[..., None]
    w2 = torch.exp(lse2 - lse).nan_to_num(0.0)[..., None]
    o = o1.float() * w1 + o2.float() * w2
    return o.to(o1.dtype), lse
