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

from kernels import native
from kernels.dispatch import cdiv, check_extend, next_power_of_2, resolve_impl

# --- extend attention ----------------------------------------------------------------------------


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
    from kernels.jit import attention as jit

    # (1) check
    n, heads, d_qk, ctx, d_v = check_extend(q, k, v)
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
    block_dqk = max(16, next_power_of_2(d_qk))
    block_dv = max(16, next_power_of_2(d_v))
    block_m = block_m or 64
    block_n = block_n or (64 if block_dqk <= 128 else 32)
    grid = (cdiv(n, block_m), heads)
    jit.extend_attention_kernel[grid](
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
    the CPU path is the native kernel where it takes the operands (kernels/native/extend.h), else
    torch's fused SDPA."""
    if resolve_impl(impl, q, has_triton=True) == "triton":
        o, lse = extend_attention_triton(q, k, v, scale)
        return o, (lse if return_lse else None)
    if return_lse:
        return extend_attention_ref(q, k, v, scale)
    if native.takes_extend(q, k, v):  # torch's SDPA takes its math path here (Dv != Dqk)
        return native.extend_attention(q, k, v, scale), None
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
    from kernels.jit import attention as jit

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
    jit.merge_attn_states_kernel[(rows, heads)](
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
        BLOCK_D=next_power_of_2(d),
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
