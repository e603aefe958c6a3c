"""Prefill / chunked-prefill ("extend") attention with a causal mask over an already-cached prefix.

A sequence contributes n new query tokens at positions ctx - n .. ctx - 1 and attends to all
ctx keys of its context (the cached prefix plus the new tokens):

    s[i, h, j] = scale * <q[i, h], k[j, h]>           j <= ctx - n + i
    o[i, h]    = softmax_j(s[i, h]) @ v[:, h]
    lse[i, h]  = logsumexp_j(s[i, h])

`merge_attn_states` combines two partial results over disjoint key sets by their LSEs (used for
split-K decode and for prefix + new-token attention done in two passes).
"""

from __future__ import annotations

import torch

from kernels.dispatch import resolve_impl


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
    resolve_impl(impl, q, has_triton=False)
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


def merge_attn_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o* [..., D], lse* [...] float32 over disjoint key sets -> (o, lse) over their union."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).nan_to_num(0.0)[..., None]
    w2 = torch.exp(lse2 - lse).nan_to_num(0.0)[..., None]
    o = o1.float() * w1 + o2.float() * w2
    return o.to(o1.dtype), lse
