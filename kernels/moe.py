"""Fused mixture-of-experts: every token through its top-k SwiGLU experts, weighted and summed.

    out[t] = sum_k  w[t, k] * W2[e] (silu(W1[e] x_t) * W3[e] x_t),   e = topk_ids[t, k]

Experts are stored fused: w13[E, 2I, H] (gate rows then up rows) and w2[E, H, I]. Expert ids of
-1 (experts that live on another rank under expert parallelism) contribute nothing.

The reference sorts the (token, k) pairs by expert and runs one GEMM pair per expert that has
tokens; the Triton kernel does the same over padded expert blocks in one launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import resolve_impl


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    impl: str = "auto",
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K] -> [T, H] in x's dtype."""
    resolve_impl(impl, x, has_triton=False)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids.clamp(min=-1) + 1, minlength=w13.shape[0] + 1).tolist()
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order]
    start = counts[0]  # pairs routed to -1 sort first and are skipped
    inter = w2.shape[-1]
    num_pairs = len(flat_ids) - start
    if min(counts[1:]) > 0 and len(counts[1:]) * max(counts[1:]) <= 2 * num_pairs:
        return _fused_moe_padded(x, w13, w2, counts[1:], token_of[start:], weight_of[start:], out)
    for expert, count in enumerate(counts[1:]):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        gate_up = F.linear(x[tokens], w13[expert])  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        expert_out = F.linear(act, w2[expert])  # [n, H]
        expert_out = (expert_out * weight_of[start : start + count, None]).to(out.dtype)
        out.index_add_(0, tokens, expert_out)
        start += count
    return out


def _fused_moe_padded(x, w13, w2, counts, token_of, weight_of, out) -> torch.Tensor:
    """Every expert has tokens and the loads are even: pad each expert's tokens to the largest
    count and run all experts as two batched GEMMs instead of a loop of small ones (the decode
    regime, where each expert sees a handful of tokens). Same per-expert arithmetic as the loop."""
    num_experts, cap = len(counts), max(counts)
    counts_t = torch.tensor(counts, device=x.device)
    starts = torch.cumsum(counts_t, 0) - counts_t
    expert_of = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts_t)
    slot = torch.arange(len(token_of), device=x.device) - starts[expert_of]
    padded = x.new_zeros(num_experts, cap, x.shape[-1])
    padded[expert_of, slot] = x[token_of]  # [E, cap, H]
    gate_up = torch.bmm(padded, w13.transpose(1, 2))  # [E, cap, 2I]
    inter = w2.shape[-1]
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    expert_out = torch.bmm(act, w2.transpose(1, 2))[expert_of, slot]  # [pairs, H]
    out.index_add_(0, token_of, (expert_out * weight_of[:, None]).to(out.dtype))
    return out
