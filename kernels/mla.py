"""MLA decode attention in the absorbed form, over the paged latent cache.

In multi-head latent attention every head's key and value are up-projections of one cached
latent per token: k_h = [W_UK_h c ; k_pe], v_h = W_UV_h c. Folding W_UK into the query
(q_lat_h = W_UK_h^T q_nope_h) turns decode into multi-query attention with a single shared
KV "head" of width L + R (the cache row itself) and a value of width L:

    s[h, j] = scale * <[q_lat_h ; q_pe_h], cache[j]>       j < seq_len
    o[h]    = softmax_j(s[h]) @ cache[:, :L]               (the caller applies W_UV and o_proj)
    lse[h]  = logsumexp_j(s[h])

With s_q > 1 query positions per sequence (MTP verification) the queries are the last s_q
positions, and query i sees keys j <= seq_len - s_q + i (causal).
"""

from __future__ import annotations

import torch

from kernels.dispatch import resolve_impl


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, s_q, H, L+R], kv_cache [num_blocks, block_size, L+R], block_table [B, max_blocks] int32,
    seq_lens [B] int32 (including the s_q new tokens) -> (o [B, s_q, H, L] in q's dtype, lse [B, s_q, H] float32)."""
    resolve_impl(impl, q, has_triton=False)
    return mla_decode_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, s_q, heads, _ = q.shape
    block_size = kv_cache.shape[1]
    max_len = int(seq_lens.max()) if batch else 0
    num_blocks = (max_len + block_size - 1) // block_size
    # [B, S, L+R]: each sequence's cache rows in order; S rounds max_len up to whole blocks.
    kv = kv_cache[block_table[:, :num_blocks].long()].flatten(1, 2).float()
    scores = torch.einsum("bqhd,bsd->bqhs", q.float(), kv) * scale  # [B, s_q, H, S]
    key_pos = torch.arange(kv.shape[1], device=q.device)
    last_visible = seq_lens.long()[:, None] - s_q + torch.arange(s_q, device=q.device)[None, :]  # [B, s_q]
    visible = key_pos[None, None, :] <= last_visible[:, :, None]  # [B, s_q, S]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, s_q, H]
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)  # empty sequences give zeros
    o = torch.einsum("bqhs,bsl->bqhl", probs, kv[..., :kv_lora_rank])
    return o.to(q.dtype), lse
